"""Full and sharded state dicts: saved under FSDP on 8 devices, loaded on 8, 4 or 1, or on CPU."""

import pytest
import torch

import xshard
import xshard.spmd as xs
from xshard.fsdp import FSDP, ShardedEntry

from tests.fsdp.fsdp_testing import POLICIES, SMALL, batches, gpt, mesh


@pytest.fixture(scope="module")
def saved():
    """An FSDP model on 8 devices whose values differ from a fresh init (no training needed)."""
    model = FSDP(gpt(seed=3, cfg=SMALL), auto_wrap_policy=POLICIES["transformer"])
    return dict(model=model, full=model.state_dict(), sharded=model.sharded_state_dict(),
                reference=gpt(seed=3, cfg=SMALL).state_dict())


def assert_same(state, reference):
    assert list(state) == list(reference)
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


def test_full_state_dict_is_cpu_tensors_with_original_names(saved):
    full = saved["full"]
    assert all(v.device.type == "cpu" for v in full.values())
    assert_same(full, saved["reference"])


def test_sharded_state_dict_holds_shards(saved):
    sharded = saved["sharded"]
    assert list(sharded) == list(saved["reference"])
    entry = sharded["blocks.0.mlp.fc.weight"]  # (128, 32) over 8 devices on dim 0
    assert isinstance(entry, ShardedEntry)
    assert entry.global_shape == (128, 32) and entry.dtype == torch.float32
    assert entry.sharding_spec == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert len(entry.shards) == 8
    assert all(data.shape == (16, 32) and data.device.type == "cpu" for _, data in entry.shards)
    assert_same({k: v.full() for k, v in sharded.items()}, saved["reference"])


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("n", [8, 4, 1])
def test_load_into_fsdp_on_n_devices(saved, kind, n):
    model = FSDP(gpt(seed=11, cfg=SMALL), mesh=mesh(n), auto_wrap_policy=POLICIES["transformer"])
    model.load_state_dict(saved[kind])
    assert_same(model.state_dict(), saved["reference"])
    # Loaded values stay sharded over the model's own mesh.
    weight = model.blocks[0].mlp.fc.weight
    expected = "{replicated}" if n == 1 else \
        "{devices=[%d,1]%s}" % (n, ",".join(str(i) for i in range(n)))
    assert xs.get_sharding_spec(weight) == expected
    payload = weight._cell.value.payload
    assert len(payload.sharding.device_set) == n
    assert {s.data.shape for s in payload.addressable_shards} == {(128 // n, 32)}
    assert model.lm_head.weight is model.wte.weight


def test_load_into_plain_cpu_model(saved):
    plain = gpt(seed=11, cfg=SMALL)
    plain.load_state_dict(saved["full"])
    assert_same(plain.state_dict(), saved["reference"])
    plain = gpt(seed=12, cfg=SMALL)
    plain.load_state_dict({k: v.full() for k, v in saved["sharded"].items()})
    assert_same(plain.state_dict(), saved["reference"])


def test_model_loaded_on_a_4_device_mesh_computes_like_cpu(saved):
    model = FSDP(gpt(seed=11, cfg=SMALL), mesh=mesh(4), auto_wrap_policy=POLICIES["transformer"])
    model.load_state_dict(saved["sharded"])
    reference = gpt(seed=11, cfg=SMALL)
    reference.load_state_dict(saved["full"])
    x, y = batches(1)[0]
    loss = model(x.to(xshard.device()), y.to(xshard.device()))
    torch.testing.assert_close(loss.cpu(), reference(x, y).detach(), rtol=1e-5, atol=1e-5)


def test_load_with_assign_keeps_the_sharded_parameters(saved):
    model = FSDP(gpt(seed=11, cfg=SMALL), auto_wrap_policy=POLICIES["transformer"])
    weight = model.blocks[0].mlp.fc.weight
    model.load_state_dict(saved["full"], assign=True)
    assert model.blocks[0].mlp.fc.weight is weight
    assert xs.get_sharding_spec(weight) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert_same(model.state_dict(), saved["reference"])
    half = {k: v.to(torch.bfloat16) for k, v in saved["full"].items()}
    with pytest.raises(ValueError, match=r"assign=True\): 'wte.weight' is torch.bfloat16 in the "
                                         r"state dict and torch.float32 in the module"):
        model.load_state_dict(half, assign=True)


def test_buffers_kept_in_buffer_dtype_are_saved_in_their_own():
    """MixedPrecision(buffer_dtype=...) keeps buffers in that dtype; the full state dict holds
    them in the dtype they had, as PyTorch's FSDP's, and loads back (assign=True too)."""
    from xshard.fsdp import MixedPrecision

    def net():
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
        module[1].running_mean.uniform_()
        return module

    plain = net()
    model = FSDP(net(), mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16))
    assert model[1].running_mean.dtype == torch.bfloat16
    state = model.state_dict()
    assert state["1.running_mean"].dtype == torch.float32
    assert state["1.num_batches_tracked"].dtype == torch.int64
    torch.testing.assert_close(state["1.running_mean"],
                               plain[1].running_mean.to(torch.bfloat16).float())
    model.load_state_dict(state, assign=True)
    assert model[1].running_mean.dtype == torch.bfloat16
    plain.load_state_dict(state)
