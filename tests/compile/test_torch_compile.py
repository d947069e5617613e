"""torch.compile on xshard tensors never fails: Dynamo breaks its graph at their ops, which run on
xshard's lazy path with the values they have outside torch.compile, and one warning names
xshard.compile (see xshard/step/dynamo.py)."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from compile_testing import DEV, GPT_TINY, MLP, make_batches
from xshard.models import GPT
from xshard.step import dynamo as xdynamo


@pytest.fixture
def fresh_warning():
    """The warning is once per process; each test sees it anew."""
    import torch._dynamo

    torch._dynamo.reset()
    xdynamo._STATE["warned"] = False
    yield
    torch._dynamo.reset()


def _train(step, data, n=3):
    return [float(step(x.to(DEV), y.to(DEV)).item()) for x, y in data[:n]]


def _training_pair():
    torch.manual_seed(0)
    base = MLP()
    pairs = []
    for _ in range(2):
        model = copy.deepcopy(base).to(DEV)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x, y, model=model, opt=opt):
            loss = F.cross_entropy(model.fc2(torch.tanh(model.fc1(x))), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        pairs.append((model, step))
    return pairs


@pytest.mark.parametrize("backend", ["inductor", "xshard", "openxla"])
def test_training_step_runs_lazily_with_one_warning(fresh_warning, backend):
    (m_eager, s_eager), (m_comp, s_comp) = _training_pair()
    data = make_batches("mlp", 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _train(torch.compile(s_comp, backend=backend), data)
    eager = _train(s_eager, data)
    assert compiled == eager
    for p, q in zip(m_comp.parameters(), m_eager.parameters()):
        assert torch.equal(p.cpu(), q.cpu())
    ours = [w for w in caught if "xshard.compile" in str(w.message)]
    assert len(ours) == 1
    assert "torch.compile does not capture xshard tensors" in str(ours[0].message)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")  # Dynamo's own note
def test_model_forward_with_device_factory(fresh_warning):
    """GPT's forward makes ``torch.arange(t, device=idx.device)``, which Dynamo captures on its own;
    that graph runs on the lazy path too, whatever the backend."""
    torch.manual_seed(0)
    model = GPT(GPT_TINY).to(DEV)
    idx = torch.randint(0, GPT_TINY.vocab_size, (2, GPT_TINY.block_size)).to(DEV)
    with pytest.warns(UserWarning, match="use xshard.compile"):
        out = torch.compile(model)(idx)
    torch.testing.assert_close(out.cpu(), model(idx).cpu(), rtol=0, atol=0)


def test_cpu_tensors_still_compile(fresh_warning):
    """Graphs without xshard tensors still reach the backend."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    fn = torch.compile(lambda a: torch.sin(a) * 2, backend=backend)
    a = torch.randn(5)
    torch.testing.assert_close(fn(a), torch.sin(a) * 2)
    assert len(seen) == 1


def _reads_and_transfers():
    weight = torch.ones(4) * 3
    return {
        "item": lambda t: (t * 2).sum().item(),
        "cpu": lambda t: (t * 3).cpu(),
        "tolist": lambda t: (t * 2).tolist(),
        "to_device": lambda t: t * weight.to(t.device),
        "tensor_on_device": lambda t: t * torch.tensor([1.0, 2.0, 3.0, 4.0], device=t.device),
        "mask": lambda t: t[t > 1],  # a CPU fallback
    }


@pytest.mark.filterwarnings("ignore:.*xshard.compile")
@pytest.mark.parametrize("case", list(_reads_and_transfers()))
def test_reads_transfers_and_fallbacks_run_lazily(fresh_warning, case):
    """They failed inside Dynamo, which traced the code JAX runs for them (an InternalTorchDynamo
    Error, or a LoweringError naming a JAX tracer)."""
    f = _reads_and_transfers()[case]
    x = torch.arange(4.0)
    got = torch.compile(f)(x.to(DEV))
    want = f(x)
    if isinstance(want, torch.Tensor):
        assert torch.equal(got.cpu(), want)
    else:
        assert got == want


def _subtract(x):
    x -= 1
    return x


def _scale_row(x):
    x[0] *= 5
    return x


def _add_number(x, n):
    x += n
    return x


@pytest.mark.filterwarnings("ignore:.*xshard.compile")
@pytest.mark.parametrize("fn, extra", [(_subtract, ()), (_scale_row, ()), (_add_number, (2,))])
def test_augmented_assignment_on_an_input(fresh_warning, fn, extra):
    """``x -= 1`` on an xshard input sent Dynamo into a RecursionError."""
    got = torch.compile(fn)(torch.arange(3.0, device=DEV), *extra)
    assert torch.equal(got.cpu(), fn(torch.arange(3.0), *extra))


@pytest.mark.filterwarnings("ignore:.*xshard.compile")
def test_sharded_tensor_runs_lazily(fresh_warning):
    """What mark_sharding returns (an XLAShardedTensor, a subclass): Dynamo took it for a tensor
    it could fake, and failed."""
    import numpy as np

    import xshard.spmd as xs

    x = torch.randn(16, 4)
    sharded = xs.mark_sharding(x.to(DEV), xs.Mesh(np.arange(8), (8,), ("data",)), ("data", None))
    got = torch.compile(lambda t: torch.tanh(t) * 2)(sharded)
    torch.testing.assert_close(got.cpu(), torch.tanh(x) * 2)
