"""Model and optimizer checkpoints: FSDP under either wrap policy and a 2-D (data, model) sharded GPT,
with AdamW state; resumed training equals the uninterrupted run; the consolidated torch.save file is
the full state dict and loads into the plain CPU model."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import xshard
import xshard.checkpoint as xcp
from xshard.fsdp import FSDP

from tests.checkpoint.checkpoint_testing import (SMALL, adamw, assert_same, batches, fsdp_gpt, gpt,
                                                 mesh, model_state, shard_2d, snapshot, spec_of,
                                                 train)


def specs(model: nn.Module, opt) -> dict:
    """Sharding of every parameter and optimizer state tensor."""
    out = {k: spec_of(v) for k, v in nn.Module.state_dict(model).items()}
    for i, entry in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": spec_of(v) for k, v in entry.items()
                    if isinstance(v, torch.Tensor) and v.device.type == "xshard"})
    return out


@pytest.fixture(scope="module", params=["transformer", "size"])
def fsdp_run(request, tmp_path_factory):
    """An FSDP GPT after 2 AdamW steps, saved, then trained 2 more steps (the uninterrupted run)."""
    policy = request.param
    data = batches(4)
    model = fsdp_gpt(seed=3, policy=policy)
    opt = adamw(model)
    train(model, opt, data[:2])
    path = tmp_path_factory.mktemp(policy) / "step_2"
    xcp.save({"model": model, "optim": opt, "step": 2}, path)
    run = dict(policy=policy, data=data, path=path, model=model_state(model),
               optim=snapshot(opt.state_dict()), full=model.state_dict(),
               specs=specs(model, opt))
    run["continued"] = train(model, opt, data[2:])
    return run


def test_fsdp_resume_equals_uninterrupted_run(fsdp_run):
    model = fsdp_gpt(seed=9, policy=fsdp_run["policy"])
    opt = adamw(model)
    state = {"model": model, "optim": opt, "step": 0}
    xcp.load(state, fsdp_run["path"])
    assert state["step"] == 2
    assert_same(model_state(model), fsdp_run["model"])
    assert_same(snapshot(opt.state_dict()), fsdp_run["optim"])
    assert specs(model, opt) == fsdp_run["specs"]  # sharded as before, moments included
    assert train(model, opt, fsdp_run["data"][2:]) == fsdp_run["continued"]


def test_fsdp_checkpoint_loads_under_the_other_policy_on_4_devices(fsdp_run):
    other = {"transformer": "size", "size": "transformer"}[fsdp_run["policy"]]
    model = fsdp_gpt(seed=9, policy=other, m=mesh((4,), ("fsdp",)))
    opt = adamw(model)
    xcp.load({"model": model, "optim": opt}, fsdp_run["path"])
    assert_same(model_state(model), fsdp_run["model"])
    assert_same(snapshot(opt.state_dict()), fsdp_run["optim"])
    assert spec_of(model.blocks[0].mlp.fc.weight) == "{devices=[4,1]0,1,2,3}"


def test_fsdp_checkpoint_loads_into_a_2d_sharded_model(fsdp_run):
    grid = mesh((4, 2), ("data", "model"))
    model = shard_2d(gpt(seed=9, cfg=SMALL), grid)
    xcp.load({"model": model}, fsdp_run["path"])
    assert_same(model_state(model), fsdp_run["model"])
    assert spec_of(model.blocks[0].mlp.fc.weight) == \
        "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"


def test_consolidated_file_is_the_full_state_dict(fsdp_run, tmp_path):
    dcp_to_torch_save(fsdp_run["path"], tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert sorted(full) == ["model", "optim", "step"] and full["step"] == 2
    # FSDP's own full state dict, under the plain model's keys.
    assert_same(full["model"], fsdp_run["full"])
    # DCP writes every dict key as a string: the optimizer's parameter ids come back as '0', '1'...
    optim = full["optim"]
    assert sorted(optim["state"]) == sorted(str(k) for k in fsdp_run["optim"]["state"])
    optim["state"] = {int(k): v for k, v in optim["state"].items()}
    assert_same(optim, fsdp_run["optim"])
    plain = gpt(seed=5, cfg=SMALL)
    plain.load_state_dict(full["model"])  # strict: same keys as the unwrapped model
    assert_same(dict(plain.state_dict()), fsdp_run["full"])
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt.load_state_dict(optim)
    assert torch.equal(opt.state[plain.wte.weight]["exp_avg"],
                       fsdp_run["optim"]["state"][0]["exp_avg"])


def test_2d_sharded_model_resumes_exactly_and_loads_into_fsdp(tmp_path):
    grid = mesh((4, 2), ("data", "model"))
    data = batches(4)
    model = shard_2d(gpt(seed=3, cfg=SMALL), grid)
    opt = adamw(model)
    train(model, opt, data[:2], grid)
    xcp.save({"model": model, "optim": opt}, tmp_path / "ckpt")
    saved, saved_optim, saved_specs = model_state(model), snapshot(opt.state_dict()), \
        specs(model, opt)
    continued = train(model, opt, data[2:], grid)

    resumed = shard_2d(gpt(seed=9, cfg=SMALL), grid)
    resumed_opt = adamw(resumed)
    compiles = xshard.metrics.snapshot()["compiles"]
    xcp.load({"model": resumed, "optim": resumed_opt}, tmp_path / "ckpt")
    assert_same(model_state(resumed), saved)
    assert_same(snapshot(resumed_opt.state_dict()), saved_optim)
    assert specs(resumed, resumed_opt) == saved_specs
    assert train(resumed, resumed_opt, data[2:], grid) == continued
    # Loading compiles nothing of its own beyond priming the optimizer; the resumed steps reuse
    # the uninterrupted run's executables.
    assert xshard.metrics.snapshot()["compiles"] - compiles <= 1

    fsdp = fsdp_gpt(seed=11)
    fsdp_opt = adamw(fsdp)
    xcp.load({"model": fsdp, "optim": fsdp_opt}, tmp_path / "ckpt")
    assert_same(model_state(fsdp), saved)
    assert_same(snapshot(fsdp_opt.state_dict()), saved_optim)


def test_state_dicts_work_as_well_as_objects(tmp_path):
    """model.state_dict() / opt.state_dict() in the state, as PyTorch users write it."""
    grid = mesh((4, 2), ("data", "model"))
    model = shard_2d(gpt(seed=3, cfg=SMALL), grid)
    opt = adamw(model)
    train(model, opt, batches(1), grid)
    xcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1},
             tmp_path / "ckpt")
    other = shard_2d(gpt(seed=9, cfg=SMALL), grid)
    other_opt = xcp.prime_optimizer(adamw(other))
    state = {"model": other.state_dict(), "optim": other_opt.state_dict(), "step": 0}
    xcp.load(state, tmp_path / "ckpt")
    other.load_state_dict(state["model"])
    other_opt.load_state_dict(state["optim"])
    assert state["step"] == 1
    assert_same(model_state(other), model_state(model))
    assert_same(snapshot(other_opt.state_dict()), snapshot(opt.state_dict()))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_optimizer_state_for_some_parameters_loads_into_a_fresh_optimizer(tmp_path, optimizer):
    """A layer that had no gradient yet when the checkpoint was saved has no optimizer state in it:
    a fresh optimizer loads the rest and leaves that layer without state, as
    ``opt.load_state_dict`` does (the load refused the checkpoint: "not in the checkpoint")."""
    def make(model):
        if optimizer == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(model.parameters(), lr=1e-2)

    def run(model, opt, xs, late):
        for x in xs:
            h = torch.tanh(model[0](x.to(next(model.parameters()).device)))
            loss = (model[1](h) if late else h).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        xshard.sync()

    xs = [torch.randn(8, 6, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
    model = FSDP(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6)))
    model.load_state_dict(eager.state_dict())
    eager_opt, opt = make(eager), make(model)
    run(model, opt, xs[:2], late=False)  # the second layer gets no gradient, so no state
    run(eager, eager_opt, xs[:2], late=False)
    xcp.save({"model": model, "optim": opt}, tmp_path / "ckpt")
    fresh = FSDP(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6)))
    fresh_opt = make(fresh)
    xcp.load({"model": fresh, "optim": fresh_opt}, tmp_path / "ckpt")
    assert len(fresh_opt.state_dict()["state"]) == 2
    run(fresh, fresh_opt, xs[2:], late=True)
    run(eager, eager_opt, xs[2:], late=True)
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=1e-5, atol=1e-6)


class _Loader:
    """A stateful data loader's position (DCP's Stateful: state_dict / load_state_dict)."""

    def __init__(self):
        self.position, self.epoch = 0, 0

    def state_dict(self):
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.position, self.epoch = state["position"], state["epoch"]


def test_schedulers_scalers_and_loaders_are_loaded_in_place(tmp_path):
    """Objects with state_dict / load_state_dict, at any depth, get their saved state back and
    stay in the state dict (an LR scheduler got its old state back, and was replaced by a dict;
    a nested one was pickled whole and the user's object left as it was)."""
    def make():
        model = nn.Linear(3, 3).to(xshard.device())
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)

    model, opt, sched = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 9)
    loader = _Loader()
    loader.position, loader.epoch = 17, 2
    for _ in range(3):
        opt.step()
        sched.step()
    xcp.save({"model": model, "optim": opt, "sched": sched, "train": {"loader": loader},
              "scaler": scaler}, tmp_path / "ckpt")
    model2, opt2, sched2 = make()
    scaler2, loader2 = torch.amp.GradScaler("cpu"), _Loader()
    state = {"model": model2, "optim": opt2, "sched": sched2, "train": {"loader": loader2},
             "scaler": scaler2}
    xcp.load(state, tmp_path / "ckpt")
    assert state["sched"] is sched2 and state["train"]["loader"] is loader2
    assert state["scaler"] is scaler2 and scaler2.get_scale() == 2.0 ** 9
    assert (loader2.position, loader2.epoch) == (17, 2)
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr()
    for o, s in ((opt, sched), (opt2, sched2)):
        o.step()
        s.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


class _NestedMomentum(torch.optim.Optimizer):
    """Keeps each parameter's state in nested containers only (as Shampoo-style optimizers do)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state["momentum"] = {"buffers": [torch.zeros_like(p), torch.zeros_like(p)]}
                first, second = state["momentum"]["buffers"]
                first.mul_(0.9).add_(p.grad)
                second.mul_(0.5).add_(p.grad.square())
                p.sub_(group["lr"] * first / (second.sqrt() + 1))


@pytest.mark.parametrize("optimizer", ["nested", "lbfgs"])
def test_optimizer_state_priming_does_not_make_loads(tmp_path, optimizer):
    """An optimizer keeping its per-parameter state in nested containers only (refused: 'not
    stepped yet'), and LBFGS (whose step wants a closure, and whose search direction and history
    only later steps create) resume as the uninterrupted run."""
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))

    def make():
        torch.manual_seed(1)
        model = nn.Linear(5, 1).to(xshard.device())
        if optimizer == "lbfgs":
            return model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3,
                                            history_size=4)
        return model, _NestedMomentum(model.parameters())

    def run(model, opt, steps):
        xd = x.to(xshard.device())

        def closure():
            opt.zero_grad()
            loss = model(xd).square().mean()
            loss.backward()
            return loss

        for _ in range(steps):
            opt.step(closure)
        return model.weight.cpu()

    model, opt = make()
    run(model, opt, 2)
    xcp.save({"model": model, "optim": opt}, tmp_path / "ckpt")
    model2, opt2 = make()
    xcp.load({"model": model2, "optim": opt2}, tmp_path / "ckpt")
    torch.testing.assert_close(run(model2, opt2, 2), run(model, opt, 2), rtol=0, atol=0)


def test_optimizer_state_of_parameters_the_optimizer_lacks_is_refused(tmp_path):
    """A checkpoint of an optimizer over more parameters than the one loading it is refused
    before anything is written (entries only later steps create are added for parameters the
    optimizer has, never for others)."""
    def make(layers):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(layers)]).to(xshard.device())
        opt = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 3, device=xshard.device())).sum().backward()
        opt.step()
        return model, opt

    _, big = make(2)
    xcp.save({"optim": big}, tmp_path / "ckpt")
    _, small = make(1)
    before = snapshot(small.state_dict())
    with pytest.raises(xcp.CheckpointError, match="holds 6 entries under 'optim' that the state "
                                                 "to load into lacks"):
        xcp.load({"optim": small}, tmp_path / "ckpt")
    assert_same(snapshot(small.state_dict()), before)


def test_mixed_precision_buffers_load_under_any_buffer_dtype(tmp_path):
    """FSDP's ``MixedPrecision(buffer_dtype=bfloat16)`` keeps BatchNorm's running stats in
    bfloat16; a checkpoint holds them in the dtype they had (float32, as ``FSDP.state_dict``), so
    it loads into a model without mixed precision and back (it failed on the dtype)."""
    from xshard.fsdp import MixedPrecision

    def net(mp):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        with torch.no_grad():
            module[1].running_mean.uniform_()
            module[1].running_var.uniform_(1, 2)
        return FSDP(module, mixed_precision=MixedPrecision(buffer_dtype=torch.bfloat16)
                    if mp else None)

    low = net(mp=True)
    assert low[1].running_mean.dtype == torch.bfloat16
    full = low.state_dict()
    xcp.save({"model": low}, tmp_path / "low")
    plain = net(mp=False)
    with torch.no_grad():
        plain[1].running_mean.zero_()
    xcp.load({"model": plain}, tmp_path / "low")
    assert plain[1].running_mean.dtype == torch.float32
    assert_same(model_state(plain), full)
    # And back: a float32 checkpoint into bfloat16 buffers.
    with torch.no_grad():
        plain[1].running_var.fill_(3.0)
    xcp.save({"model": plain}, tmp_path / "plain")
    xcp.load({"model": low}, tmp_path / "plain")
    assert low[1].running_var.dtype == torch.bfloat16
    assert (low[1].running_var.cpu() == 3.0).all()
    assert_same(model_state(low)["1.running_mean"].float(), full["1.running_mean"])
