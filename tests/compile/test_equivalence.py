"""xshard.compile equals the lazy path: same losses, parameters, buffers and optimizer state over
10 steps with a learning rate that changes every step, for an MLP, a CNN with BatchNorm and the
GPT-style decoder (one device, FSDP on 8 devices, a 2-D mesh), with SGD, Adam and AdamW in their
default and foreach forms. The lazy path is itself checked against eager CPU PyTorch by tests/core.
"""

import functools

import pytest
import torch

import xshard
import xshard.spmd as xs
from compile_testing import (DEV, OPTIMIZERS, TOL, assert_models_close, assert_state_close,
                             compiled_step, make_batches, scheduler, train_compiled, train_lazy,
                             twins)
from xshard.fsdp import FSDP, transformer_auto_wrap_policy
from xshard.mesh import Mesh
from xshard.models.gpt import Block
from xshard.step.optim import make_capturable

# The Adam family runs capturable in a compiled step (its step count on the device, see
# xshard/step/optim.py): bias corrections are computed in float32 on the device instead of float64
# on the host, which moves parameters by a few float32 ulps per step.
ADAM_TOL = dict(rtol=1e-4, atol=1e-5)


def tol(opt_name):
    return ADAM_TOL if opt_name.startswith("adam") else TOL


def run_both(kind, opt_name, foreach, wrap=None, place=None, capturable_lazy=False):
    (m_lazy, o_lazy), (m_comp, o_comp) = twins(kind, opt_name, foreach, wrap)
    if capturable_lazy:
        make_capturable([o_lazy])
    data = make_batches(kind)
    lazy = train_lazy(m_lazy, o_lazy, data, scheduler(o_lazy), place)
    step = compiled_step(m_comp, o_comp)
    comp = train_compiled(step, data, scheduler(o_comp), place)
    # Step 1 creates the optimizer state (a program of its own), step 2 records the steady step;
    # the other 8, with a new learning rate each, replay it. Plain SGD keeps no state.
    assert step.traces == (1 if opt_name == "sgd" else 2), step.retrace_reasons
    assert step.calls == len(data)
    return (m_lazy, o_lazy, lazy), (m_comp, o_comp, comp)


def check(kind, opt_name, foreach, **kwargs):
    (m1, o1, lazy), (m2, o2, comp) = run_both(kind, opt_name, foreach, **kwargs)
    t = tol(opt_name)
    torch.testing.assert_close(comp, lazy, **t)
    assert_models_close(m1, m2, **t)  # parameters and buffers (BatchNorm running stats)
    assert_state_close(o1, o2, **t)
    return m1, o1, m2, o2


@pytest.mark.parametrize("foreach", [None, True, False], ids=["default", "foreach", "for_loop"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_mlp(opt_name, foreach):
    check("mlp", opt_name, foreach)


def test_replay_adds_no_error():
    """Against a lazy run of the same capturable optimizer the compiled step agrees to the last
    place: it is the lazy step's graph, but with AdamW's step counts read and stored once (see
    [Note: values computed twice] in xshard.core.graph), and XLA fuses that program differently."""
    (m1, o1, lazy), (m2, o2, comp) = run_both("mlp", "adamw", None, capturable_lazy=True)
    assert comp == lazy
    assert_models_close(m1, m2, rtol=1e-6, atol=1e-7)
    assert_state_close(o1, o2, rtol=1e-6, atol=1e-7)


def test_cnn_batchnorm():
    m1, _, m2, _ = check("cnn", "sgd_momentum", None)
    bn = m2.stem[1]
    assert int(bn.num_batches_tracked.item()) == 10
    assert not torch.equal(bn.running_mean.cpu(), torch.zeros(bn.num_features))


@pytest.mark.slow
@pytest.mark.parametrize("opt_name,foreach", [("adamw", None), ("adam", True)])
def test_cnn_batchnorm_adam(opt_name, foreach):
    check("cnn", opt_name, foreach)


def test_gpt():
    check("gpt", "adamw", None)


@pytest.mark.slow
@pytest.mark.parametrize("opt_name,foreach", [("adam", True), ("sgd_momentum", None),
                                              ("adamw", True)])
def test_gpt_optimizers(opt_name, foreach):
    check("gpt", opt_name, foreach)


def _specs(model, opt):
    params = {n: xs.get_sharding_spec(p) for n, p in model.named_parameters()}
    state = {(n, k): xs.get_sharding_spec(v) for n, p in model.named_parameters()
             for k, v in opt.state[p].items() if v.dim()}
    return params, state


def _fsdp(model):
    return FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                          transformer_layer_cls={Block}))


def test_gpt_fsdp():
    m1, o1, m2, o2 = check("gpt", "adamw", None, wrap=_fsdp)
    params, state = _specs(m2, o2)
    assert (params, state) == _specs(m1, o1)
    # Parameters and both moments stay sharded over the 8 devices (FSDP's layout).
    assert params["blocks.0.mlp.fc.weight"] == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert state[("blocks.0.mlp.fc.weight", "exp_avg")] == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert state[("blocks.0.mlp.fc.weight", "exp_avg_sq")] == "{devices=[8,1]0,1,2,3,4,5,6,7}"


def _two_d(model):
    mesh = _mesh_2d()
    model = model.to(DEV)
    for block in model.blocks:
        xs.mark_sharding(block.attn.qkv.weight, mesh, ("model", None))
        xs.mark_sharding(block.attn.proj.weight, mesh, (None, "model"))
        xs.mark_sharding(block.mlp.fc.weight, mesh, ("model", None))
        xs.mark_sharding(block.mlp.proj.weight, mesh, (None, "model"))
    return model


@functools.cache
def _mesh_2d():
    return Mesh(range(8), (4, 2), ("data", "model"))


def _place_2d(x, y):
    x, y = x.to(DEV), y.to(DEV)
    xs.mark_sharding(x, _mesh_2d(), ("data", None))
    xs.mark_sharding(y, _mesh_2d(), ("data", None))
    return x, y


def test_gpt_2d_mesh():
    xshard.metrics.clear_counters()  # fallbacks counted by earlier tests
    m1, o1, m2, o2 = check("gpt", "adamw", True, wrap=_two_d, place=_place_2d)
    params, state = _specs(m2, o2)
    assert (params, state) == _specs(m1, o1)
    row = "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"
    assert params["blocks.1.mlp.fc.weight"] == row
    assert state[("blocks.1.mlp.fc.weight", "exp_avg")] == row
    assert params["blocks.1.attn.proj.weight"] == \
        "{devices=[1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"
    assert xshard.metrics.snapshot()["cpu_fallbacks"] == {}
