"""What FSDP does to a module: names, tied parameters, parameter shardings, and its errors."""

import pytest
import torch
import torch.nn as nn

import xshard
import xshard.spmd as xs
from xshard.fsdp import FSDP, MixedPrecision
from xshard.fsdp.fully_shard import TrainingState

from tests.fsdp.fsdp_testing import POLICIES, gpt, mesh

ALL = "0,1,2,3,4,5,6,7"


def test_names_parameters_and_tied_embeddings_are_kept():
    reference = gpt()
    names = list(reference.state_dict().keys())
    param_names = [n for n, _ in reference.named_parameters()]
    model = FSDP(gpt(), auto_wrap_policy=POLICIES["transformer"])
    assert type(model).__name__ == "FSDPGPT" and isinstance(model, FSDP)
    assert list(model.state_dict().keys()) == names
    assert [n for n, _ in model.named_parameters()] == param_names
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    assert model.lm_head.weight is model.wte.weight  # still one parameter
    assert all(p.device.type == xshard.device().type for p in model.parameters())
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert [u for u in model.fsdp_units][-1] is model
    assert all(u.state is TrainingState.IDLE for u in model._fsdp_units)
    # Values on the device are the original ones.
    full = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)


def test_each_parameter_belongs_to_exactly_one_unit():
    model = FSDP(gpt(), auto_wrap_policy=POLICIES["size"])
    owned = [id(p) for u in model._fsdp_units for p in u.params]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide = nn.Parameter(torch.randn(16, 48))    # largest dim 1
        self.tall = nn.Parameter(torch.randn(48, 16))    # largest dim 0
        self.uneven = nn.Parameter(torch.randn(9, 5))    # 9 rows over 8 devices: padded to 16
        self.uneven16 = nn.Parameter(torch.randn(9, 16))
        self.scalar = nn.Parameter(torch.tensor(3.0))
        self.one = nn.Parameter(torch.tensor([2.0]))
        self.register_buffer("steps", torch.tensor(7))

    def forward(self, x):
        return (x @ self.wide @ self.tall).sum() * self.scalar * self.one


def test_parameter_sharding_strings_largest_dim():
    reference = Odd()
    model = FSDP(Odd())
    model.load_state_dict(reference.state_dict())
    assert xs.get_sharding_spec(model.wide) == "{devices=[1,8]" + ALL + "}"
    assert xs.get_sharding_spec(model.tall) == "{devices=[8,1]" + ALL + "}"
    assert xs.get_sharding_spec(model.uneven) == "{devices=[8,1]" + ALL + "}"
    assert xs.get_sharding_spec(model.uneven16) == "{devices=[1,8]" + ALL + "}"
    assert xs.get_sharding_spec(model.scalar) == "{replicated}"
    assert xs.get_sharding_spec(model.one) == "{devices=[8]" + ALL + "}"
    assert xs.get_sharding_spec(model.steps) == ""  # buffers are not sharded
    full = model.state_dict()  # syncs the load
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
    # The uneven parameter is stored padded (16 rows, 2 per device), still annotated.
    payload = model.uneven._cell.value.payload
    assert payload.shape == (16, 5)
    assert {s.data.shape for s in payload.addressable_shards} == {(2, 5)}
    assert xs.get_sharding_spec(model.uneven) == "{devices=[8,1]" + ALL + "}"


def test_parameter_sharding_strings_dim_0():
    model = FSDP(Odd(), shard_param_on_dim_0=True)
    assert xs.get_sharding_spec(model.wide) == "{devices=[8,1]" + ALL + "}"
    assert xs.get_sharding_spec(model.uneven16) == "{devices=[8,1]" + ALL + "}"
    assert model.uneven16._cell.value.payload.shape == (16, 16)
    assert xs.get_sharding_spec(model.scalar) == "{replicated}"


def test_training_step_with_scalar_and_uneven_parameters():
    torch.manual_seed(0)
    reference = Odd()
    model = FSDP(Odd())
    model.load_state_dict(reference.state_dict())
    x = torch.randn(4, 16)
    reference(x).backward()
    model(x.to(xshard.device())).backward()
    xshard.sync()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None:
            assert q.grad is None
            continue
        assert xs.get_sharding_spec(p.grad) == xs.get_sharding_spec(p), name
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_mesh_without_fsdp_axis():
    with pytest.raises(ValueError, match="must have an axis named 'fsdp'.*\\('data',\\)"):
        FSDP(nn.Linear(4, 4), mesh=mesh(8, ("data",)))


def test_unknown_extra_data_axis():
    with pytest.raises(ValueError, match="extra_data_axis='batch' is not an axis of the mesh"):
        FSDP(nn.Linear(4, 4), mesh=mesh(8, ("data", "fsdp"), (2, 4)), extra_data_axis="batch")


def test_wrapping_twice():
    model = FSDP(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="already wrapped with FSDP"):
        FSDP(model)


def test_deepcopy_is_a_model_of_its_own():
    """copy.deepcopy of an FSDP model (AveragedModel's EMA copy) raised (FSDP.__new__ wanted a
    module): the copy keeps the shardings and units, its units gather its own parameters, and
    it trains apart from the original, both as eager does."""
    import copy
    import functools

    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from xshard.fsdp import size_based_auto_wrap_policy

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=functools.partial(
        size_based_auto_wrap_policy, min_num_params=10))
    twin = copy.deepcopy(model)
    assert type(twin) is type(model) and len(twin.fsdp_units) == 3
    assert twin.fsdp_units[0] is twin[0] and twin._fsdp_units[0].root is twin
    assert xs.get_sharding_spec(twin[0].weight) == xs.get_sharding_spec(model[0].weight)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    ref_ema = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    ref_twin = copy.deepcopy(ref)
    x = torch.randn(8, 8)
    for m, lr, dev in ((ref, 0.1, "cpu"), (ref_twin, 0.3, "cpu"), (model, 0.1, xshard.device()),
                       (twin, 0.3, xshard.device())):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        for _ in range(2):
            m(x.to(dev)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    ema.update_parameters(model)
    ref_ema.update_parameters(ref)
    for a, b, e, f in zip(ref.parameters(), model.parameters(), ref_ema.parameters(),
                          ema.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(f.detach().cpu(), e.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(ref_twin.parameters(), twin.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-5, atol=1e-6)


def test_not_a_module():
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        FSDP(torch.zeros(3))


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "buffer_dtype"])
def test_mixed_precision_needs_float_dtypes(field):
    with pytest.raises(ValueError, match=f"MixedPrecision.{field}=torch.int32 must be a "
                                         f"floating-point torch.dtype"):
        MixedPrecision(**{field: torch.int32})
    with pytest.raises(ValueError, match="floating-point"):
        MixedPrecision(**{field: "bf16"})


def test_mixed_precision_is_frozen():
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    with pytest.raises(Exception):
        mp.param_dtype = torch.float16
    assert mp.reduce_dtype is None and mp.cast_forward_inputs


def test_mixed_precision_must_be_the_dataclass():
    with pytest.raises(TypeError, match="MixedPrecision"):
        FSDP(nn.Linear(4, 4), mixed_precision={"param_dtype": torch.bfloat16})


@pytest.mark.parametrize("kwargs, match", [
    (dict(reshard_after_forward="yes"), "reshard_after_forward must be True or False, got 'yes'"),
    (dict(shard_output="batch"), "shard_output must be a callable"),
    (dict(auto_wrap_policy="size"), "auto_wrap_policy must be a callable or None"),
    (dict(mesh=mesh(8, ("data",))), "must have an axis named 'fsdp'"),
])
def test_bad_arguments_raise_and_leave_the_module_as_given(kwargs, match):
    module = nn.Linear(4, 4)
    with pytest.raises((TypeError, ValueError), match=match):
        FSDP(module, **kwargs)
    assert type(module) is nn.Linear and module.weight.device.type == "cpu"
    assert isinstance(FSDP(module), FSDP)  # and it can still be wrapped
