"""An exception inside an FSDP unit's forward or backward leaves nothing behind (#10 item 4).

After it, the unit's modules hold their parameters again, no saved-tensor hooks are installed,
autograd outside FSDP works, and the next FSDP step computes eager's gradients and releases what
it gathered.
"""

from functools import partial

import pytest
import torch
import torch.nn as nn

import xshard
import xshard.spmd as xs
from xshard.fsdp import FSDP, transformer_auto_wrap_policy

DEV = xshard.device()


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("failure in backward")


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail = None  # "forward" | "backward" | None

    def forward(self, x):
        y = self.lin(x).tanh()
        if self.fail == "forward":
            raise RuntimeError("failure in forward")
        if self.fail == "backward":
            y = _FailInBackward.apply(y)
        return y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Layer(), Layer()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.b(self.a(x))).sum()


def _models():
    torch.manual_seed(0)
    eager = Net()
    model = Net()
    model.load_state_dict(eager.state_dict())
    model = FSDP(model, auto_wrap_policy=partial(transformer_auto_wrap_policy,
                                                 transformer_layer_cls={Layer}))
    return model, eager


def _saved_tensor_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _assert_clean(model, params):
    assert _saved_tensor_hooks() is None
    assert [p for _, p in model.named_parameters()] == params  # the Parameters, not gathered copies
    # autograd outside FSDP
    x = torch.tensor([1.0, -2.0, 3.0], device=DEV, requires_grad=True)
    (x.tanh() * x).sum().backward()
    cpu = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    (cpu.tanh() * cpu).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), cpu.grad)


def _assert_next_step_matches_eager(model, eager, x):
    model.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    model(x.to(DEV)).backward()
    eager(x).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
        assert xs.get_sharding_spec(p.grad) == xs.get_sharding_spec(p), name
    assert all(u.backward_gathered is None for u in model._fsdp_units)  # released at the end


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("layer", ["a", "b"])
def test_an_exception_in_a_unit_leaves_nothing_behind(where, layer):
    model, eager = _models()
    params = [p for _, p in model.named_parameters()]
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    getattr(model, layer).fail = where
    with pytest.raises(RuntimeError, match=f"failure in {where}"):
        model(x.to(DEV)).backward()
    _assert_clean(model, params)
    getattr(model, layer).fail = None
    _assert_next_step_matches_eager(model, eager, x)
    _assert_next_step_matches_eager(model, eager, x)  # and the one after
