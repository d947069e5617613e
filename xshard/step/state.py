"""The state a step reads and writes: the places (slots) where its tensors live.

A compiled step is replayed without running its Python, so everything the step reads or changes
must be found again, on every call, at a fixed place: a module's parameter or buffer, a parameter's
``.grad``, an optimizer's ``state[p][key]``, an argument. A ``Slot`` is one such place: ``get()``
returns the tensor there (or None), ``set(t)`` puts one there. The random stream is no slot: it is
two host integers (see xshard.core.rng), fed to the program on each call (see program.py).

State is found from *roots*: the ``nn.Module``s, ``torch.optim.Optimizer``s and device tensors
among the step's arguments, its closure and default arguments, the globals its code names, the
object a bound method belongs to, and the ``state=`` given to ``xshard.compile``.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
import weakref
from functools import partial

import numpy as np
import torch
import torch.nn as nn

from xshard.core import api


class Slot:
    """A place holding a tensor (or None) that a step may read or write."""

    __slots__ = ("key", "name")

    def get(self):
        raise NotImplementedError

    def set(self, value) -> None:
        raise NotImplementedError

    def fast_get(self):
        """A function returning what ``get()`` returns, faster; see ``Program.check`` for when
        it may be used."""
        return self.get

    def forget(self) -> None:
        """Drops the lookups ``get`` keeps (the optimizers' state dicts were replaced)."""

    def __repr__(self):
        return self.name


class DictSlot(Slot):
    """``mapping[entry]``: a module's ``_parameters`` / ``_buffers`` / ``__dict__`` entry."""

    __slots__ = ("mapping", "entry")

    def __init__(self, key, name, mapping: dict, entry: str):
        self.key, self.name, self.mapping, self.entry = key, name, mapping, entry

    def get(self):
        return self.mapping.get(self.entry)

    def set(self, value) -> None:
        self.mapping[self.entry] = value

    def fast_get(self):
        return partial(self.mapping.get, self.entry)


class ItemSlot(Slot):
    """``items[index]`` of a list (None once the list is shorter)."""

    __slots__ = ("items", "index")

    def __init__(self, key, name, items: list, index: int):
        self.key, self.name, self.items, self.index = key, name, items, index

    def get(self):
        items = self.items
        return items[self.index] if self.index < len(items) else None

    def set(self, value) -> None:
        self.items[self.index] = value


class GradSlot(Slot):
    """``param.grad``."""

    __slots__ = ("param",)

    def __init__(self, key, name, param):
        self.key, self.name, self.param = key, name, param

    def get(self):
        return self.param.grad

    def set(self, value) -> None:
        self.param.grad = value

    def fast_get(self):
        return partial(getattr, self.param, "grad")


class OptimizerStateSlot(Slot):
    """``optimizer.state[param][entry]``."""

    __slots__ = ("optimizer", "param", "entry", "_state", "_per_param")

    def __init__(self, key, name, optimizer, param, entry):
        self.key, self.name = key, name
        self.optimizer, self.param, self.entry = optimizer, param, entry
        self._state = self._per_param = None

    def _lookup(self):
        # opt.state is keyed by parameters, whose __hash__ is Python code: look the parameter's
        # dict up once per opt.state object (load_state_dict makes a new one), and again after
        # ``forget`` (opt.state.clear() keeps the object and makes new per-parameter dicts).
        state = self.optimizer.state
        if state is not self._state or self._per_param is None:
            self._state, self._per_param = state, state.get(self.param)
        return self._per_param

    def get(self):
        per_param = self._lookup()
        return None if per_param is None else per_param.get(self.entry)

    def forget(self) -> None:
        self._state = self._per_param = None

    def fast_get(self):
        """Valid while ``optimizer.state`` and the parameter's dict in it are the same objects."""
        per_param = self._lookup()
        return self.get if per_param is None else partial(per_param.get, self.entry)

    def set(self, value) -> None:
        if value is None:
            per_param = self._lookup()
            if per_param is not None:
                per_param.pop(self.entry, None)
        else:
            self.optimizer.state[self.param][self.entry] = value
            self._per_param = None


class GroupParamSlot(Slot):
    """``optimizer.param_groups[group]['params'][index]`` (a parameter no module holds)."""

    __slots__ = ("groups", "group", "index")

    def __init__(self, key, name, optimizer, group, index):
        self.key, self.name = key, name
        self.groups, self.group, self.index = optimizer.param_groups, group, index

    def get(self):
        params = self.groups[self.group]["params"] if self.group < len(self.groups) else ()
        return params[self.index] if self.index < len(params) else None

    def set(self, value) -> None:
        raise AssertionError("parameters are updated in place, never replaced")


class CellSlot(Slot):
    """A closure cell of the step function."""

    __slots__ = ("cell",)

    def __init__(self, key, name, cell):
        self.key, self.name, self.cell = key, name, cell

    def get(self):
        return self.cell.cell_contents

    def set(self, value) -> None:
        self.cell.cell_contents = value


class HeldSlot(Slot):
    """A device tensor given in ``xshard.compile(..., state=)``: always that tensor object (the
    step updates it in place)."""

    __slots__ = ("tensor",)

    def __init__(self, key, name, tensor):
        self.key, self.name, self.tensor = key, name, tensor

    def get(self):
        return self.tensor

    def set(self, value) -> None:
        raise AssertionError("a tensor given as state is updated in place, never replaced")


class ArgSlot(Slot):
    """Leaf ``index`` of the flattened ``(args, kwargs)`` of the current call."""

    __slots__ = ("index", "leaves")

    def __init__(self, index: int, name: str):
        self.key, self.name, self.index = ("arg", index), name, index
        self.leaves: list = []

    def get(self):
        return self.leaves[self.index]

    def set(self, value) -> None:
        self.leaves[self.index] = value


class ArgGradSlot(Slot):
    """``.grad`` of the tensor argument ``arg`` holds in the current call: ``backward()`` in the
    step fills it for an argument that requires grad, as in eager."""

    __slots__ = ("arg",)

    def __init__(self, arg: ArgSlot):
        self.key, self.name, self.arg = ("arg_grad", arg.index), f"{arg.name}.grad", arg

    def get(self):
        return self.arg.get().grad

    def set(self, value) -> None:
        self.arg.get().grad = value


# -- roots ----------------------------------------------------------------------------------------


class Roots:
    """The modules, optimizers and loose device tensors a step works on, and the Python objects
    and settings it reached them through."""

    def __init__(self):
        self.modules: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.cells: list = []  # (closure cell, name) holding a device tensor
        # (dict, key, name) holding a device tensor: a module global, an attribute of the object
        # the step is a method of
        self.entries: list = []
        self.tensors: list = []  # (device tensor, name) given as state=
        # (container, key, name) of each Python setting the step function reads from its closure
        # or globals: container.get(key, default) reads it (see is_setting)
        self.settings: list = []
        # The same for the lists and dicts of settings the step reads (``"fast" in flags``): a
        # reader of their contents, compared after the settings (which name the entry changed)
        self.contents: list = []
        # (container, key, name) of every other object the step reaches that way (a module, an
        # optimizer, a function, a trainer): the guard compares them by identity (see [Note: what
        # the step reaches] in record.py)
        self.bindings: list = []
        self._seen: set = set()
        self._setting_names: set = set()

    def add(self, obj, depth: int = 0, name: str = "") -> None:
        if id(obj) in self._seen:
            return
        if isinstance(obj, nn.Module):
            self._seen.add(id(obj))
            self.modules.append(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self._seen.add(id(obj))
            self.optimizers.append(obj)
        elif isinstance(obj, (list, tuple, dict)) and depth < 2:
            # Device tensors in it are state (``params["w"]`` of a functional-style step): the
            # step may update them in place, or a list entry or dict value may be replaced.
            self._seen.add(id(obj))
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            for key, item in items:
                where = f"{name}[{key!r}]"
                if not api.is_device_tensor(item):
                    self.add(item, depth + 1, where)
                elif isinstance(obj, tuple):
                    self.tensors.append((item, where))
                else:
                    self.entries.append((obj, key, where))
        elif depth == 0 and has_attributes(obj):
            # An object the step is a method of (a trainer): its attributes, one level down.
            self._seen.add(id(obj))
            _initialize_scaler(obj)
            for name, item in list(vars(obj).items()):
                if api.is_device_tensor(item):
                    self.entries.append((vars(obj), name, f"{type(obj).__name__}.{name}"))
                else:
                    self.add(item, depth + 1)

    def add_setting(self, reader, name: str) -> None:
        """A setting read through an object (see [Note: settings read through objects])."""
        if name not in self._setting_names:
            self._setting_names.add(name)
            self.settings.append((reader, None, name))

    def reach(self, container, key, value, name: str) -> None:
        """``value``, read by the step from ``container.get(key)``: a setting the guard compares
        by value, or an object it compares by identity."""
        if is_setting(value):
            self.settings.append((container, key, name))
            return
        self.bindings.append((container, key, name))
        if type(value) in (list, dict) and contents(value) is not None:
            # What the step computes from a list or dict of settings (``"fast" in flags``,
            # ``lrs[i]``, ``cfg.get("w")``): its contents are compared by value.
            self.contents.append((Contents(container, key), None, f"{name} (contents)"))


def _transient(obj) -> set:
    """Attributes an object replaces on every step by design, which the guard does not compare:
    GradScaler's per-step record of each optimizer's overflow flags (its ``update()`` starts a new
    one; compared, a recording kept the last one's flags alive as values the step kept)."""
    return {"_per_optimizer_states"} if isinstance(obj, torch.amp.GradScaler) else set()


def _initialize_scaler(obj) -> None:
    """A GradScaler for the xshard device creates its scale and growth tracker at its first
    ``scale()``: created now, they are state a step updates, not values it keeps elsewhere."""
    if isinstance(obj, torch.amp.GradScaler) and obj.is_enabled() and obj._scale is None and \
            torch.device(obj._device).type == api.DEVICE_TYPE:
        obj._lazy_init_scale_growth_tracker(torch.device(obj._device))


def has_attributes(obj) -> bool:
    """Whether ``obj`` is an object with attributes of its own (not a class, module, function or
    tensor)."""
    return hasattr(obj, "__dict__") and not isinstance(
        obj, (type, types.ModuleType, types.FunctionType, torch.Tensor))


def find_roots(fn, extra=()) -> Roots:
    """Modules, optimizers and device tensors reachable from ``fn`` (see the module docstring)."""
    roots = Roots()
    for k, obj in enumerate(extra):
        if api.is_device_tensor(obj):
            roots.tensors.append((obj, f"state[{k}]"))
        else:
            roots.add(obj)
    seen_fns: set = set()

    def attributes(obj, code) -> None:
        # What the code names of the object it is a method of (``self.model``, ``self.scale``).
        if code is None or not has_attributes(obj) or isinstance(
                obj, (nn.Module, torch.optim.Optimizer)):
            return
        d = vars(obj)
        for name in sorted(_global_names(code) & d.keys() - _transient(obj)):
            if not api.is_device_tensor(d[name]):
                roots.reach(d, name, d[name], f"{type(obj).__name__}.{name}")

    def visit(f, bound=None):
        if id(f) in seen_fns:
            return
        seen_fns.add(id(f))
        if isinstance(f, functools.partial):
            for a in (*f.args, *f.keywords.values()):
                roots.add(a)
            visit(f.func)
            return
        if isinstance(f, types.MethodType):
            roots.add(f.__self__)
            attributes(f.__self__, getattr(f.__func__, "__code__", None))
            visit(f.__func__, f.__self__)
            return
        if isinstance(f, nn.Module):
            roots.add(f)
            return
        code = getattr(f, "__code__", None)
        if code is None:
            call = getattr(type(f), "__call__", None)
            if call is not None and not isinstance(f, type):
                roots.add(f)
                attributes(f, getattr(call, "__code__", None))
                if isinstance(call, types.FunctionType):
                    _reach_paths(roots, call, f, visit)
            return
        _reach_paths(roots, f, bound, visit)
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if api.is_device_tensor(value):
                roots.cells.append((cell, name))
                continue
            roots.reach(_CellReader(cell), None, value, f"closure variable {name!r}")
            if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
                visit(value)
            elif not is_setting(value):
                roots.add(value, depth=1, name=name)
        for name, where in _default_names(f).items():  # ``def step(x, model=model)``
            value = _default(f, *where)
            if api.is_device_tensor(value):
                roots.tensors.append((value, f"default argument {name!r}"))
            elif not is_setting(value):
                roots.add(value, depth=1, name=name)
                if type(value) in (list, dict):
                    roots.reach(_Call(partial(_default, f, *where)), None, value,
                                f"default argument {name!r}")
        for kind in ("__defaults__", "__kwdefaults__"):
            roots.reach(_AttributeReader(f), kind, getattr(f, kind), f"{f.__name__}.{kind}")
        reach_globals(f, code)

    def reach_globals(f, code) -> None:
        """The globals ``f`` reads: settings compared by value, other objects by identity, device
        tensors as state; the functions of its own module it names are visited."""
        module_globals = getattr(f, "__globals__", {})
        loaded = _loaded_globals(code)
        for name in sorted(_global_names(code)):
            value = module_globals.get(name)
            if value is None:
                continue
            if api.is_device_tensor(value):
                roots.entries.append((module_globals, name, name))
                continue
            # Only a name the code loads as a global: ``opt.step()`` does not read a global
            # ``step`` (a loop counter).
            if name in loaded:
                roots.reach(module_globals, name, value, f"global {name!r}")
            if isinstance(value, (nn.Module, torch.optim.Optimizer)):
                roots.add(value)
            elif isinstance(value, (list, tuple, dict)) and name in loaded:
                roots.add(value, depth=1, name=name)
            elif isinstance(value, types.FunctionType) and value.__module__ == f.__module__:
                visit(value)

    def method(f, m) -> None:
        """``f``, a function of ``type(m)`` the step runs on ``m`` (its forward, a helper method
        the forward calls on ``self``): what it reads through ``self``, its globals, the methods
        it calls on ``self`` in turn, and the Python objects it calls through ``self``
        (``self.rotary(q)``, ``self.scaler.apply(h)``, with their own settings)."""
        if (id(f), id(m)) in seen_methods:
            return
        seen_methods.add((id(f), id(m)))
        _reach_paths(roots, f, m, None)
        if id(f) not in seen_fns:  # its globals are the same for every instance
            seen_fns.add(id(f))
            reach_globals(f, f.__code__)
        this = f.__code__.co_varnames[0] if f.__code__.co_argcount else None
        for chain in read_paths(f.__code__).get(("local", this), ()):
            if chain[0][0] != "attr" or len(chain) > 2:
                continue
            helper = inspect.getattr_static(type(m), chain[0][1], None)
            if len(chain) == 1 and isinstance(helper, types.FunctionType):
                method(helper, m)
                continue
            obj = vars(m).get(chain[0][1])
            if obj is None or isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.Tensor)):
                continue
            if len(chain) == 1:  # ``self.act = my_activation``, a callable object
                if isinstance(obj, (types.FunctionType, types.MethodType, functools.partial)) \
                        or (has_attributes(obj) and callable(obj)):
                    visit(obj)
            elif chain[1][0] == "attr" and has_attributes(obj):
                helper = inspect.getattr_static(type(obj), chain[1][1], None)
                if isinstance(helper, types.FunctionType):
                    visit(types.MethodType(helper, obj))

    visit(fn)
    seen_methods: set = set()
    for root in roots.modules:  # grows while it is walked: a forward may name a global module
        for m in root.modules():
            forward = getattr(type(m), "forward", None)
            if isinstance(forward, types.FunctionType):
                method(forward, m)
            for hook in _module_hooks(m):  # what the hooks read, as the forward's
                visit(hook)
    for hooks in _GLOBAL_MODULE_HOOKS:
        for hook in list(getattr(nn.modules.module, hooks, {}).values()):
            visit(hook)
    tensors = [t for root in roots.modules for t in (*root.parameters(), *root.buffers())]
    tensors += [t for t, _ in roots.tensors]
    tensors += [cell.cell_contents for cell, _ in roots.cells]
    tensors += [container[key] for container, key, _ in roots.entries]
    for t in tensors:
        for hooks in (t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None)):
            for hook in list((hooks or {}).values()):
                visit(hook)
    return roots


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_backward_pre_hooks")
_GLOBAL_MODULE_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                        "_global_backward_hooks", "_global_backward_pre_hooks")


def _module_hooks(m: nn.Module) -> list:
    return [h for name in _MODULE_HOOKS for h in getattr(m, name, {}).values()]


# [Note: settings read through objects]
# A Python setting the step reads through an object is built into the program like any other:
# ``cfg.loss_weight`` of a global or closure ``cfg``, ``self.cfg.scale`` in a method or a module's
# forward, ``weights["kl"]``, ``schedule[0]``. The code says which: the chains of attribute reads
# and constant subscripts it applies to a name it loads (``LOAD_GLOBAL cfg; LOAD_ATTR
# loss_weight``), in the step function, the functions it reaches, each module's ``forward`` and
# the methods that calls on ``self`` (a chain may be just the name: a global setting a forward
# reads). Each chain that ends in a setting (or None) when the step is recorded is read again on
# every call, the same way but only through instance dicts, dict keys and sequence indices (no
# property or ``__getattr__`` runs), and compared; a change records the step again. Chains from a
# default argument (``def step(x, cfg=cfg)``) start from the default. A list or dict of settings
# the step reaches (closure, global, default, the object it is a method of) is compared by its
# contents too, so what the code computes from it (``cfg.get("w")``, ``schedule[i]``, ``"fast"
# in flags``) is seen. A value a helper in another module reads is not: pass it as an argument.

_LOAD_NAME = {"LOAD_GLOBAL": "global", "LOAD_NAME": "global", "LOAD_DEREF": "closure",
              "LOAD_CLASSDEREF": "closure", "LOAD_FAST": "local", "LOAD_FAST_CHECK": "local",
              "LOAD_FAST_BORROW": "local"}
_PATHS = weakref.WeakKeyDictionary()  # code object -> {(kind, name): set of chains}
_NO_KEY = object()


def read_paths(code) -> dict:
    """``{(kind, name): {chain}}``: each chain of ``("attr", name)`` / ``("item", constant)`` steps
    ``code`` (or code defined in it) applies to a name it loads (kind ``global``, ``closure`` or
    ``local``), and each chain's prefixes."""
    paths = _PATHS.get(code)
    if paths is None:
        paths = _PATHS[code] = {}
        _scan(code, paths)
    return paths


def _scan(code, paths) -> None:
    root, chain, key = None, (), _NO_KEY
    for ins in dis.get_instructions(code):
        op = ins.opname
        if key is not _NO_KEY:  # a constant after a chain: a subscript extends it
            if op == "BINARY_SUBSCR" or (op == "BINARY_OP" and ins.argrepr == "[]"):
                chain += (("item", key),)
                paths.setdefault(root, set()).add(chain)
                key = _NO_KEY
                continue
            if op == "COPY" and ins.arg == 2:  # ``cfg["n"] += 1`` keeps the object and the key
                continue
            root, key = None, _NO_KEY
        kind = _LOAD_NAME.get(op)
        if kind is not None:
            root, chain = (kind, ins.argval), ()
        elif root is not None and op == "COPY" and ins.arg == 1:  # ``cfg.n += 1`` keeps cfg
            continue
        elif root is not None and op in ("LOAD_ATTR", "LOAD_METHOD"):
            chain += (("attr", ins.argval),)
            paths.setdefault(root, set()).add(chain)
            if op == "LOAD_METHOD":
                root = None
        elif root is not None and op == "LOAD_CONST" and type(ins.argval) in (str, int):
            key = ins.argval
        else:
            root = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _scan(const, paths)


class _PathReader:
    """A chain of steps read from a root, as ``get(key, default)`` reads a settings dict (see
    [Note: settings read through objects])."""

    __slots__ = ("root", "chain")

    def __init__(self, root, chain):
        self.root, self.chain = root, chain  # root(): the object the chain starts from

    def get(self, _key, default):
        return _follow(self.root(), self.chain, default)

    def put(self, _key, value) -> None:
        """Sets what ``get`` reads back to ``value`` (a refused recording puts its settings
        back), where the chain still leads to a place that can hold it."""
        *chain, (kind, key) = self.chain
        obj = _follow(self.root(), chain, _NO_KEY)
        if kind == "attr":
            d = getattr(obj, "__dict__", None)
            if type(d) is dict and key in d:
                d[key] = value
        elif isinstance(obj, (dict, list)) and key in (obj if isinstance(obj, dict) else
                                                      range(-len(obj), len(obj))):
            obj[key] = value


def _follow(obj, chain, default):
    """``obj`` through ``chain`` (instance dicts, dict keys, sequence indices), else ``default``."""
    for kind, key in chain:
        if kind == "attr":
            try:
                d = object.__getattribute__(obj, "__dict__")
            except AttributeError:
                return default
            if type(d) is not dict or key not in d:
                return default
            obj = d[key]
        elif isinstance(obj, dict):
            obj = dict.get(obj, key, default)
        elif isinstance(obj, (list, tuple)) and type(key) is int and \
                -len(obj) <= key < len(obj):
            obj = obj[key]
        else:
            return default
    return obj


def _reach_paths(roots: Roots, f, bound, visit) -> None:
    """Guards the settings ``f``'s code reads through objects: from its globals, its closure and
    ``bound`` (the object it is a method of, its first argument); ``visit``s the methods it calls
    on such objects (``trainer.step(x)``), when given."""
    code = f.__code__
    closure = dict(zip(code.co_freevars, f.__closure__ or ()))
    module_globals = getattr(f, "__globals__", {})
    this = code.co_varnames[0] if bound is not None and code.co_argcount else None
    defaults = _default_names(f)
    for (kind, name), chains in read_paths(code).items():
        if kind == "global":
            root = partial(module_globals.get, name, None)
        elif kind == "closure" and name in closure:
            root = _CellReader(closure[name]).value
        elif kind == "local" and name == this:
            root = partial(_itself, bound)
        elif kind == "local" and name in defaults:
            # ``def step(x, cfg=cfg)``: the default's settings (an argument passed instead is
            # compared with the call's key)
            root = partial(_default, f, *defaults[name])
        else:
            continue
        for chain in chains:
            if len(chain) == 1 and chain[0][0] == "attr":
                obj = root()
                if visit is not None and kind != "local" and has_attributes(obj) and \
                        not isinstance(obj, (nn.Module, torch.optim.Optimizer)):
                    method = inspect.getattr_static(type(obj), chain[0][1], None)
                    if isinstance(method, types.FunctionType):
                        visit(types.MethodType(method, obj))
                if (kind == "local" and name == this) or isinstance(obj, nn.Module):
                    continue  # ``self.scale``, ``model.scale``: compared already (module settings)
            reader = _PathReader(root, chain)
            value = reader.get(None, _NO_KEY)
            if _through_param_groups(root(), chain):
                continue  # ``opt.param_groups[0]["lr"]``: the optimizer's groups are compared
            if value is None or (value is not _NO_KEY and is_setting(value)):
                where = type(bound).__name__ if kind == "local" and name == this else name
                roots.add_setting(reader, where + "".join(
                    f".{k}" if t == "attr" else f"[{k!r}]" for t, k in chain))


def _itself(obj):
    return obj


def _through_param_groups(obj, chain) -> bool:
    """Whether ``chain`` from ``obj`` reads an optimizer's ``param_groups`` (a learning rate is
    the program's input while the step is recorded; the guard compares the groups)."""
    for step in chain:
        if isinstance(obj, torch.optim.Optimizer) and step == ("attr", "param_groups"):
            return True
        obj = _follow(obj, (step,), _NO_KEY)
        if obj is _NO_KEY:
            return False
    return False


def _default_names(f) -> dict:
    """``{name: (attribute, key)}`` of ``f``'s parameters that have defaults: the default is
    ``getattr(f, attribute)[key]``."""
    code = f.__code__
    positional = f.__defaults__ or ()
    names = code.co_varnames[code.co_argcount - len(positional):code.co_argcount]
    out = {name: ("__defaults__", i) for i, name in enumerate(names)}
    out.update((name, ("__kwdefaults__", name)) for name in f.__kwdefaults__ or {})
    return out


def _default(f, attribute, key):
    """A default of ``f``'s (None when ``__defaults__`` or ``__kwdefaults__`` no longer has it:
    the guard compares those too)."""
    try:
        return getattr(f, attribute)[key]
    except (TypeError, IndexError, KeyError):
        return None


_SETTING_TYPES = (bool, int, float, complex, str, torch.dtype, torch.device)


def is_setting(value) -> bool:
    """Whether ``value`` is a Python setting a recorded step builds in (a number, NumPy's too, a
    string, a dtype, a tuple of those): the guard compares it on every call."""
    return type(value) in _SETTING_TYPES or isinstance(value, np.generic) or (
        type(value) in (tuple, torch.Size) and all(is_setting(v) for v in value))


_CONTENTS_LIMIT = 256  # entries of a list or dict of settings compared by value


class _Unsettled(Exception):
    pass


def contents(value):
    """A list or dict of settings (nested lists, tuples and dicts of them too, at most
    ``_CONTENTS_LIMIT`` entries in all) as nested tuples, compared by value; else None."""
    count = 0

    def freeze(v):
        nonlocal count
        count += 1
        if count > _CONTENTS_LIMIT:
            raise _Unsettled
        if v is None or is_setting(v):
            return v
        if type(v) in (list, tuple):
            return tuple(map(freeze, v))
        if type(v) is dict and all(map(is_setting, v)):
            return tuple((k, freeze(x)) for k, x in v.items())
        raise _Unsettled

    try:
        return freeze(value)
    except _Unsettled:
        return None


class Contents:
    """The contents of ``container.get(key)``, a list or dict of settings, read as
    ``get(_, default)`` reads a settings dict (the object itself when it holds anything else)."""

    __slots__ = ("container", "key")

    def __init__(self, container, key):
        self.container, self.key = container, key

    def get(self, _key, default):
        value = self.container.get(self.key, default)
        frozen = contents(value) if type(value) in (list, dict) else None
        return value if frozen is None else frozen

    def put(self, _key, frozen) -> None:
        """Puts back contents ``get`` read, when they are flat (settings only)."""
        value = self.container.get(self.key, None)
        if type(value) is list and all(map(is_setting, frozen)):
            value[:] = frozen
        elif type(value) is dict and all(is_setting(v) for _, v in frozen):
            value.clear()
            value.update(frozen)


class _CellReader:
    """A closure cell read as ``get(key, default)``, as a settings dict is."""

    __slots__ = ("cell",)

    def __init__(self, cell):
        self.cell = cell

    def get(self, _key, default):
        try:
            return self.cell.cell_contents
        except ValueError:  # emptied
            return default

    def put(self, _key, value) -> None:
        self.cell.cell_contents = value

    def value(self):
        return self.get(None, None)


class _Call:
    """A function's result read as ``get(key, default)`` reads a settings dict."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def get(self, _key, default):
        return self.fn()


class _AttributeReader:
    """An object's attributes read as ``get(name, default)``, as a settings dict is."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def get(self, name, default):
        return getattr(self.obj, name, default)

    def put(self, name, value) -> None:
        setattr(self.obj, name, value)


def _loaded_globals(code) -> set:
    """The names ``code`` (and the functions it defines) reads as globals."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL",
                                                                            "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _loaded_globals(const)
    return names


def _global_names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


# -- slots ----------------------------------------------------------------------------------------


def state_slots(roots: Roots) -> list[Slot]:
    """Every place of the roots' state, in a fixed order (the same roots give the same list)."""
    slots: list[Slot] = []
    params: dict = {}  # id -> (param, name)
    for r, root in enumerate(roots.modules):
        prefix = f"module{r}" if len(roots.modules) > 1 else "model"
        for mod_name, m in root.named_modules(remove_duplicate=True):
            where = f"{prefix}.{mod_name}" if mod_name else prefix
            for name, p in m._parameters.items():
                slots.append(DictSlot(("param", id(m), name), f"{where}.{name}", m._parameters,
                                      name))
                if p is not None and id(p) not in params:
                    params[id(p)] = (p, f"{where}.{name}")
            for name in m._buffers:
                slots.append(DictSlot(("buffer", id(m), name), f"{where}.{name}", m._buffers,
                                      name))
            for name, value in list(vars(m).items()):
                if api.is_device_tensor(value) and not name.startswith("_"):
                    slots.append(DictSlot(("attr", id(m), name), f"{where}.{name}", m.__dict__,
                                          name))
    for o, opt in enumerate(roots.optimizers):
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in params:
                    name = f"optimizer{o}.param_groups[{g}]['params'][{i}]"
                    slots.append(GroupParamSlot(("group_param", id(opt), g, i), name, opt, g, i))
                    params[id(p)] = (p, name)
    loose = [CellSlot(("cell", id(cell)), name, cell) for cell, name in roots.cells]
    loose += [HeldSlot(("held", id(t)), name, t) for t, name in roots.tensors]
    loose += [(DictSlot if isinstance(container, dict) else ItemSlot)(
        ("entry", id(container), key), name, container, key)
        for container, key, name in roots.entries]
    for slot in loose:
        # A leaf tensor that requires grad (``w`` of a functional-style step): backward() fills
        # its gradient, as it does a parameter's.
        t = slot.get()
        if is_leaf_requiring_grad(t) and id(t) not in params:
            params[id(t)] = (t, slot.name)
    slots += loose
    for p, name in params.values():
        slots.append(GradSlot(("grad", id(p)), f"{name}.grad", p))
    for o, opt in enumerate(roots.optimizers):
        for p, (param, name) in ((p, params[id(p)]) for g in opt.param_groups
                                 for p in g["params"]):
            for entry in sorted(opt.state.get(p, {}), key=str):
                slots.append(OptimizerStateSlot(("opt_state", id(opt), id(p), entry),
                                                f"optimizer{o}.state[{name}][{entry!r}]", opt,
                                                p, entry))
    return slots


def is_leaf_requiring_grad(obj) -> bool:
    return api.is_device_tensor(obj) and obj.requires_grad and obj.grad_fn is None


def merge_slots(first: list[Slot], second: list[Slot]) -> list[Slot]:
    """``first`` followed by the slots of ``second`` that it lacks (by key)."""
    keys = {s.key for s in first}
    return first + [s for s in second if s.key not in keys]
