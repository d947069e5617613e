"""Objects a compiled step reaches, replaced between calls: the model its closure, a global or a
trainer attribute names, a submodule, a module's function attribute, a parameter object, a hook,
the optimizer's state. Each compiled call computes what eager CPU PyTorch does (see [Note: what the
step reaches] in xshard/step/record.py). Before, each case replayed the objects of the recording:
a silent wrong answer."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import xshard
from xshard.core import api
from compile_testing import DEV, MLP, assert_same_run, make_batches, train_update


def _make(device, seed=0):
    torch.manual_seed(seed)
    model = MLP().to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


class _Trainer:
    def __init__(self, device):
        self.model, self.opt = _make(device)

    def step(self, x, y):
        return train_update(self.model, self.opt, x, y)


G_MODEL = G_OPT = None  # the global case's model and optimizer


def _global_step(x, y):
    return train_update(G_MODEL, G_OPT, x, y)


def _run(device, compiled, case):
    """Four steps; before the third, ``case`` replaces one object. Returns the losses, the
    parameters of the model trained last, and the compiled step."""
    global G_MODEL, G_OPT
    model, opt = _make(device)
    trainer = _Trainer(device)
    G_MODEL, G_OPT = model, opt
    act = torch.tanh
    hook = model.fc1.register_forward_hook(lambda m, args, out: out * 2)
    if case == "gradient hook removed":
        grad_hook = model.fc2.weight.register_hook(lambda g: g * 3)

    def closure_step(x, y):
        return train_update(model, opt, x, y)

    def act_step(x, y):
        loss = act(model.fc1(x)).sum() + model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    fn = {"closure model": closure_step, "global model": _global_step,
          "trainer attribute": trainer.step, "closure function": act_step}.get(case, closure_step)
    step = xshard.compile(fn) if compiled else fn
    losses = []
    for i, (x, y) in enumerate(make_batches("mlp", 4)):
        if i == 2:
            if case == "closure model":
                model, opt = _make(device, seed=1)
            elif case == "global model":
                G_MODEL, G_OPT = _make(device, seed=1)
            elif case == "trainer attribute":
                trainer.model, trainer.opt = _make(device, seed=1)
            elif case == "closure function":
                act = torch.sigmoid
            elif case == "submodule":
                model.fc1 = nn.Linear(8, 16).to(device)  # new, untrained by opt
            elif case == "module function attribute":
                model.fc1.forward = lambda x: torch.relu(nn.Linear.forward(model.fc1, x))
            elif case == "parameter object":
                model.fc2.bias = nn.Parameter(torch.ones(4).to(device))  # not in opt
            elif case == "hook replaced":
                hook.remove()
                hook = model.fc1.register_forward_hook(lambda m, args, out: out * 3)
            elif case == "hook added":  # where the step was recorded with none
                model.fc2.register_forward_hook(lambda m, args, out: out * 2)
            elif case == "gradient hook registered":
                model.fc1.weight.register_hook(lambda g: g * 2)
            elif case == "post-accumulate-grad hook registered":
                model.fc1.bias.register_post_accumulate_grad_hook(_halve_grad)
            elif case == "gradient hook removed":
                grad_hook.remove()
        losses.append(step(x.to(device), y.to(device)).item())
    trained = {"global model": G_MODEL, "trainer attribute": trainer.model}.get(case, model)
    return losses, [p.detach().cpu() for p in trained.parameters()], step


_CASES = {
    "closure model": "closure variable 'model' is another object",
    "global model": "global 'G_MODEL' is another object",
    "trainer attribute": "_Trainer.model is another object",
    "closure function": "closure variable 'act' is another object",
    "submodule": "modules of the MLP, entry 'fc1'",
    "module function attribute": "number of attributes of the Linear",
    "parameter object": "model.fc2.bias is another tensor object",
    "hook replaced": "forward hooks of the Linear, entry",
    "hook added": "number of forward hooks of the Linear: 0 -> 1",
    "gradient hook registered": "gradient hooks of model.fc1.weight: none -> 1",
    "post-accumulate-grad hook registered": "post-accumulate-grad hooks of model.fc1.bias: "
                                            "none -> 1",
    "gradient hook removed": "number of gradient hooks of model.fc2.weight: 1 -> 0",
}


def _halve_grad(p):
    p.grad.mul_(0.5)


@pytest.mark.parametrize("case", list(_CASES))
def test_objects_the_step_reaches_replaced_between_calls(case):
    cpu, dev = _run("cpu", False, case), _run(DEV, True, case)
    assert_same_run(cpu, dev)
    step = dev[2]
    # A new parameter the optimizer does not hold keeps its gradient: the next call finds one
    # where the step was recorded with None, and records again.
    assert step.traces == (3 if case in ("submodule", "parameter object") else 2), \
        step.retrace_reasons
    assert _CASES[case] in step.retrace_reasons[0], step.retrace_reasons


@pytest.mark.parametrize("change", ["state.clear()", "load_state_dict"])
def test_optimizer_state_cleared_or_loaded_between_calls(change):
    """``opt.state.clear()`` keeps the dict and makes new per-parameter dicts on the next step:
    the replay wrote into the old ones (Adam's state stayed where the clear left it). A loaded
    state dict made the guard compare its tensors with ``==`` (a RuntimeError)."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        fn = lambda x, y: train_update(model, opt, x, y)  # noqa: E731
        step = xshard.compile(fn) if compiled else fn
        losses = []
        for i, (x, y) in enumerate(make_batches("mlp", 6)):
            if i == 3:
                if change == "state.clear()":
                    opt.state.clear()
                else:
                    state = copy.deepcopy(opt.state_dict())
                    for s in state["state"].values():
                        s["exp_avg"] = s["exp_avg"].cpu() * 0.5
                    opt.load_state_dict(state)
            losses.append(step(x.to(device), y.to(device)).item())
        state = [{k: v.cpu() for k, v in s.items()} for s in opt.state.values()]
        return losses, [p.detach().cpu() for p in model.parameters()], state

    cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)
    for a, b in zip(cpu[2], dev[2]):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


class _Accumulating:
    """A trainer whose device tensors are attributes: a scale it reads, a total it updates."""

    def __init__(self, device):
        self.model, self.opt = _make(device)
        self.scale = torch.tensor(2.0).to(device)
        self.total = torch.zeros(()).to(device)

    def step(self, x, y):
        loss = train_update(self.model, self.opt, x, y) * self.scale
        self.total += loss.detach()
        return loss


def test_trainer_tensor_attributes_are_state():
    """A device tensor attribute of the object the step is a method of is state, as a closure
    variable is: updated in place by each call, and read anew when replaced."""
    def run(device, compiled):
        trainer = _Accumulating(device)
        step = xshard.compile(trainer.step) if compiled else trainer.step
        losses = []
        for i, (x, y) in enumerate(make_batches("mlp", 4)):
            if i == 2:
                trainer.scale = torch.tensor(3.0).to(device)
            losses.append(step(x.to(device), y.to(device)).item())
        return losses, trainer.total.cpu(), step

    cpu, dev = run("cpu", False), run(DEV, True)
    torch.testing.assert_close(dev[0], cpu[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dev[1], cpu[1], rtol=1e-5, atol=1e-6)
    assert dev[2].traces == 1


@pytest.mark.parametrize("where", ["host tensor lr", "device tensor lr", "tensor in a list",
                                   "tensor in a list replaced"])
def test_tensors_outside_the_state_changed_in_place(where):
    """A learning rate given as a tensor and changed in place (the replay kept the old rate):
    a device-tensor rate is built in as a constant, and a change to it records the step again. A
    device tensor the step reads from a list is state, read on every call."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP().to(device)
        lr = torch.tensor(0.1)
        if where == "device tensor lr":
            lr = lr.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=lr if "lr" in where else 0.1)
        weights = [torch.ones(4).to(device)]

        def train_step(x, y):
            loss = model(x, y) * weights[0].sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        step = xshard.compile(train_step) if compiled else train_step
        losses = []
        for i, (x, y) in enumerate(make_batches("mlp", 4)):
            if i == 2 and where == "tensor in a list replaced":
                weights[0] = torch.full((4,), 0.05).to(device)
            elif i == 2:
                changed = lr if "lr" in where else weights[0]
                changed.fill_(0.05)
            losses.append(step(x.to(device), y.to(device)).item())
        return losses, [p.detach().cpu() for p in model.parameters()], step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the built-in tensor's warning
        cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)
    if where == "device tensor lr":
        assert dev[2].traces == 2 and "reads as a constant" in dev[2].retrace_reasons[0]
        assert "written" in dev[2].retrace_reasons[0]
    else:
        assert dev[2].traces == 1, dev[2].retrace_reasons  # read on every call


def _functional_params(container):
    """Tensors a step reads and updates from a dict, list or tuple, not a module."""
    if container == "dict":
        return {"w": torch.zeros(3, device=DEV)}
    if container == "list":
        return [torch.zeros(3, device=DEV)]
    return (torch.zeros(3, device=DEV),)


GLOBAL_PARAMS = None


@pytest.mark.parametrize("where", ["global", "closure"])
@pytest.mark.parametrize("container", ["dict", "list", "tuple"])
def test_tensors_in_a_container_updated_by_the_step(where, container):
    """Device tensors in a dict, list or tuple the step's closure or globals name are state: the
    step's in-place updates and replaced entries are kept, as in eager (the replay used to read
    them as constants and return the first call's values)."""
    global GLOBAL_PARAMS
    params = GLOBAL_PARAMS = _functional_params(container)
    key = "w" if container == "dict" else 0

    def closure_step(x):
        out = (params[key] * x).sum()
        params[key].add_(x)
        return out

    def global_step(x):
        out = (GLOBAL_PARAMS[key] * x).sum()
        GLOBAL_PARAMS[key].add_(x)
        return out

    step = xshard.compile(closure_step if where == "closure" else global_step)
    outs = [step(torch.ones(3, device=DEV)).item() for _ in range(4)]
    assert outs == [0.0, 3.0, 6.0, 9.0]
    assert params[key].tolist() == [4.0, 4.0, 4.0]
    assert step.traces == 1, step.retrace_reasons
    if container != "tuple":  # an entry replaced between calls is read
        params[key] = torch.full((3,), 10.0, device=DEV)
        assert step(torch.ones(3, device=DEV)).item() == 30.0
        assert params[key].tolist() == [11.0, 11.0, 11.0]


@pytest.mark.parametrize("view", ["flat", "row", "transposed"])
def test_closure_view_of_a_parameter_follows_the_updates(view):
    """A view of a parameter with another shape, read by the step after the update: each call
    reads the updated weight through it, and it stays a view (the replay stored it as a new
    tensor holding the first call's value)."""
    def run(device, compiled):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 3, bias=False).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        w = model.weight.detach()
        seen = {"flat": w.view(-1), "row": w[0], "transposed": w.t()}[view]

        def train_step(x):
            train_update(lambda v: model(v).sum(), opt, x)
            return seen.sum() * 1.0

        step = xshard.compile(train_step) if compiled else train_step
        outs = [step(torch.ones(1, 2, device=device)).item() for _ in range(3)]
        return outs, seen.detach().cpu(), model.weight.detach().cpu(), step

    cpu, dev = run("cpu", False), run(DEV, True)
    torch.testing.assert_close(dev[0], cpu[0])
    torch.testing.assert_close(dev[1], cpu[1])
    torch.testing.assert_close(dev[2], cpu[2])
    assert dev[3].traces == 1, dev[3].retrace_reasons


@pytest.mark.parametrize("wrap", ["plain", "FSDP"])
def test_checkpoint_saved_and_loaded_between_calls(wrap, tmp_path):
    """xshard.checkpoint.save after call 3, load after call 5: the calls after the load continue
    from the saved state, as eager PyTorch does from a copy of its state dicts."""
    import xshard.checkpoint as xcp
    from xshard.fsdp import FSDP

    def run(device, compiled):
        torch.manual_seed(0)
        model = MLP()
        model = FSDP(model) if compiled and wrap == "FSDP" else model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        fn = lambda x, y: train_update(model, opt, x, y)  # noqa: E731
        step = xshard.compile(fn) if compiled else fn
        losses = []
        for i, (x, y) in enumerate(make_batches("mlp", 8)):
            if i == 3:
                if compiled:
                    xcp.save({"model": model, "optim": opt}, tmp_path / "ckpt")
                else:
                    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
            if i == 5:
                if compiled:
                    xcp.load({"model": model, "optim": opt}, tmp_path / "ckpt")
                else:
                    model.load_state_dict(saved[0])
                    opt.load_state_dict(saved[1])
            losses.append(step(x.to(device), y.to(device)).item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "NAdam", "RMSprop"])
def test_optimizer_state_dict_resumes_on_the_cpu_and_back(name, tmp_path):
    """xshard.compile switches the optimizer to capturable (its step counts on the device); its
    state_dict still says capturable=False with host step counts, as eager saves it: a CPU
    optimizer refused the checkpoint ("If capturable=True, params and state_steps must be on
    supported devices"). Resumed on the CPU, and loaded back into the compiled step (one more
    recording), training goes on as eager's."""
    def make(device):
        torch.manual_seed(0)
        model = MLP().to(device)
        return model, getattr(torch.optim, name)(model.parameters(), lr=0.01)

    data = make_batches("mlp", 6)
    ref, ref_opt = make("cpu")
    ref_losses = [train_update(ref, ref_opt, x, y).item() for x, y in data]

    model, opt = make(DEV)
    step = xshard.compile(lambda x, y: train_update(model, opt, x, y))
    losses = [step(x.to(DEV), y.to(DEV)).item() for x, y in data[:3]]
    assert api.is_device_tensor(next(iter(opt.state.values()))["step"])
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    assert api.is_device_tensor(next(iter(opt.state.values()))["step"])  # the live state stays
    saved = torch.load(tmp_path / "ckpt.pt", map_location="cpu")
    assert all(not g["capturable"] for g in saved["optim"]["param_groups"])
    assert all(s["step"].device.type == "cpu" for s in saved["optim"]["state"].values())

    cpu_model, cpu_opt = make("cpu")
    cpu_model.load_state_dict(saved["model"])
    cpu_opt.load_state_dict(copy.deepcopy(saved["optim"]))  # (it keeps CPU tensors as given)
    cpu_losses = losses + [train_update(cpu_model, cpu_opt, x, y).item() for x, y in data[3:]]
    torch.testing.assert_close(cpu_losses, ref_losses, rtol=1e-5, atol=1e-6)

    opt.load_state_dict(saved["optim"])
    losses += [step(x.to(DEV), y.to(DEV)).item() for x, y in data[3:]]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


def test_model_and_settings_bound_as_default_arguments():
    """``def step(x, y, model=model, opt=opt)``: the defaults are state roots (the step raised a
    StateError: its updates were "kept outside the model"), and a default changed since the
    recording records the step again."""
    def run(device, compiled):
        model, opt = _make(device)

        def train_step(x, y, model=model, opt=opt, *, scale=1.0):
            return train_update(model, opt, x, y) * scale

        step = xshard.compile(train_step) if compiled else train_step
        losses = []
        for i, (x, y) in enumerate(make_batches("mlp", 4)):
            if i == 2:
                train_step.__kwdefaults__ = {"scale": 3.0}
            losses.append(step(x.to(device), y.to(device)).item())
        return losses, [p.detach().cpu() for p in model.parameters()], step

    cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)
    assert dev[2].traces == 2 and "train_step.__kwdefaults__" in dev[2].retrace_reasons[0]


# Settings a model's code reads from its module's globals: not through the step function but
# through a forward, a helper method it calls on ``self``, a helper function of this module, a
# function attribute, or a plain Python object the forward calls.
SCALE_FORWARD = SCALE_METHOD = SCALE_HELPER = SCALE_ATTRIBUTE = 1.0


class _Config:
    pass


_CONFIG = _Config()


class _Scaler:
    """Not a module: a helper object the forward calls, with a setting of its own."""

    def __init__(self):
        self.scale = 1.0

    def __call__(self, h):
        return h * self.scale

    def shift(self, h):
        return h + (self.scale - 1.0)


def _activation(h):
    return torch.tanh(h) * SCALE_HELPER


def _attribute_activation(h):
    return h * SCALE_ATTRIBUTE


class _GlobalReader(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.config = _CONFIG
        self.scaler, self.shifter = _Scaler(), _Scaler()
        self.act = _attribute_activation

    def forward(self, x, y):
        h = self.shifter.shift(self.scaler(self.act(_activation(self.fc1(x)))))
        logits = self._head(h) * SCALE_FORWARD
        return nn.functional.cross_entropy(logits, y)

    def _head(self, h):
        return self._scaled(self.fc2(h)) * SCALE_METHOD

    def _scaled(self, h):
        return h * self.config.scale


_GLOBAL_CHANGES = {
    "global read by forward": ("SCALE_FORWARD", "global 'SCALE_FORWARD': 1.0 -> 2.0"),
    "global read by a method forward calls": ("SCALE_METHOD", "global 'SCALE_METHOD'"),
    "global read by a helper function": ("SCALE_HELPER", "global 'SCALE_HELPER'"),
    "global read by a function attribute": ("SCALE_ATTRIBUTE", "global 'SCALE_ATTRIBUTE'"),
    "setting through self in a method's method": ("config", "_GlobalReader.config.scale: "
                                                            "1.0 -> 2.0"),
    "setting of an object forward calls": ("scaler", "_Scaler.scale: 1.0 -> 2.0"),
    "setting of an object whose method forward calls": ("shifter", "_Scaler.scale"),
    "helper function replaced": ("_activation", "global '_activation' is another object"),
}


@pytest.mark.parametrize("change", list(_GLOBAL_CHANGES))
def test_settings_read_by_module_code_changed_between_calls(change):
    """A setting a module's forward reads as a global, or that a method, a function or a Python
    object the forward calls reads, was built into the program and kept after it changed: a
    silent wrong answer. Each is compared on every call now, as the step function's own are."""
    name, reason = _GLOBAL_CHANGES[change]

    def run(device, compiled):
        global SCALE_FORWARD, SCALE_METHOD, SCALE_HELPER, SCALE_ATTRIBUTE, _activation
        SCALE_FORWARD = SCALE_METHOD = SCALE_HELPER = SCALE_ATTRIBUTE = _CONFIG.scale = 1.0
        activation = _activation
        torch.manual_seed(0)
        model = _GlobalReader().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fn = lambda x, y: train_update(model, opt, x, y)  # noqa: E731
        step = xshard.compile(fn) if compiled else fn
        losses = []
        try:
            for i, (x, y) in enumerate(make_batches("mlp", 4)):
                if i == 2:
                    if name == "config":
                        _CONFIG.scale = 2.0
                    elif name in ("scaler", "shifter"):
                        getattr(model, name).scale = 2.0
                    elif name == "_activation":
                        _activation = lambda h: torch.sigmoid(h) * 2  # noqa: E731
                    else:
                        globals()[name] = 2.0
                losses.append(step(x.to(device), y.to(device)).item())
        finally:
            _activation = activation
        return losses, [p.detach().cpu() for p in model.parameters()], step

    cpu, dev = run("cpu", False), run(DEV, True)
    assert_same_run(cpu, dev)
    assert dev[2].traces == 2 and reason in dev[2].retrace_reasons[0], dev[2].retrace_reasons


HOOK_SCALE = 1.0


def test_settings_read_by_hooks_are_compared_on_every_call():
    """A global a tensor hook or a module hook reads was the first call's value on every later
    call (gradients and outputs of SCALE=1 after SCALE was 5), silently."""
    global HOOK_SCALE
    w = torch.ones(3, device=DEV, requires_grad=True)
    w.register_hook(lambda g: g * HOOK_SCALE)
    lin = nn.Linear(3, 1, bias=False).to(DEV)
    nn.init.ones_(lin.weight)
    lin.register_forward_hook(lambda m, i, o: o * HOOK_SCALE)

    @xshard.compile
    def step(x):
        (w * x).sum().backward()
        g = w.grad.clone()
        w.grad = None
        return g, lin(x).sum()

    x = torch.ones(3, device=DEV)
    try:
        for scale in (1.0, 5.0, 0.0, 5.0):
            HOOK_SCALE = scale
            g, y = step(x)
            assert g.tolist() == [scale] * 3 and y.item() == 3 * scale
        assert step.traces == 3  # 5.0 again: its program is found
    finally:
        HOOK_SCALE = 1.0
