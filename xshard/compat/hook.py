"""The import hook that makes ``import torch_xla...`` load xshard.compat's modules.

``python -m xshard.compat script.py`` (and the processes ``xmp.spawn`` starts from it) install it;
nothing else does, so in any other process ``import torch_xla`` finds a real torch_xla or nothing,
and an installed torch_xla is never touched. A name maps to the *same* module object as its
``xshard.compat`` twin (``torch_xla.core.xla_model is xshard.compat.xla_model``), so there is one
state however a module is imported.

``ALIASES`` is the whole mapping; ``REPLACEMENTS`` names what to use for torch_xla modules that
have no counterpart. Packages on the way to a name (``torch_xla.core``, ``torch_xla.debug``) are
made up as empty packages. Adding a module is one line in ``ALIASES``, e.g.
``"torch_xla.debug.profiler": "xshard.profiler"`` (any module can stand for one).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# torch_xla's module -> the module that stands for it.
ALIASES = {
    "torch_xla": "xshard.compat",
    "torch_xla.core.xla_model": "xshard.compat.xla_model",
    "torch_xla.distributed.parallel_loader": "xshard.compat.parallel_loader",
    "torch_xla.distributed.xla_multiprocessing": "xshard.compat.xla_multiprocessing",
    "torch_xla.runtime": "xshard.compat.runtime",
    "torch_xla.distributed.spmd": "xshard.compat.spmd",
    "torch_xla.distributed.fsdp": "xshard.compat.fsdp",
    "torch_xla.distributed.fsdp.wrap": "xshard.compat.fsdp.wrap",
    "torch_xla.distributed.fsdp.utils": "xshard.compat.fsdp.utils",
    "torch_xla.experimental.spmd_fully_sharded_data_parallel": "xshard.compat.fsdp.spmd",
    "torch_xla.debug.profiler": "xshard.compat.profiler",
    "torch_xla.debug.metrics": "xshard.compat.metrics",
    "torch_xla.distributed.spmd.xla_sharding": "xshard.compat.spmd",
    "torch_xla.distributed.spmd.xla_sharded_tensor": "xshard.spmd.sharded_tensor",
    "torch_xla.distributed.spmd.debugging": "xshard.spmd.debugging",
    "torch_xla.experimental.xla_sharding": "xshard.compat.spmd",  # before torch_xla 2.3
    "torch_xla.amp": "xshard.compat.amp",
    "torch_xla.amp.syncfree": "xshard.compat.amp.syncfree",
    "torch_xla.utils.checkpoint": "torch.utils.checkpoint",  # torch_xla's copy of it
    "torch_xla.test.test_utils": "xshard.compat.test_utils",  # its examples' logging helpers
}

# torch_xla modules with no counterpart here, and what to use instead.
REPLACEMENTS = {
    "torch_xla.distributed.xla_backend": (
        "torch.distributed's 'xla' backend (DDP over XLA collectives) has no counterpart; average "
        "gradients with xm.optimizer_step(optimizer) in processes started by xmp.spawn, or run one "
        "SPMD program (xr.use_spmd(), xshard.spmd / xshard.fsdp)"),
    "torch_xla.core.xrt_run_server": "XRT is gone (PJRT replaced it); nothing needs starting",
    "torch_xla.core.xla_env_vars": "xshard reads PJRT_DEVICE and XSHARD_* variables only",
    "torch_xla.utils.serialization": "save with xm.save(data, path) (CPU tensors, read by "
                                     "torch.load) or xshard.checkpoint for sharded state",
    "torch_xla.utils.utils": "torch_xla's internal helpers; use the standard library",
    "torch_xla.distributed.xla_multiprocessing_legacy":
        "use torch_xla.distributed.xla_multiprocessing",
    "torch_xla.core.functions": (
        "its differentiable collectives have no counterpart here; xm.all_reduce / xm.all_gather "
        "are not differentiated through. For a gradient across replicas, compute the loss on "
        "each replica and average the gradients (xm.optimizer_step), or run one SPMD program "
        "(xr.use_spmd()) where autograd sees the whole computation"),
}


def _packages() -> set[str]:
    """Packages on the way to an alias or a replacement note (made up as empty packages)."""
    out = set()
    for name in (*ALIASES, *REPLACEMENTS):
        parts = name.split(".")
        for i in range(1, len(parts)):
            out.add(".".join(parts[:i]))
    return out - set(ALIASES) - set(REPLACEMENTS)


class CompatModuleNotFoundError(ModuleNotFoundError):
    """A ``torch_xla`` module xshard.compat does not provide (the message says what to use)."""


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str | None):
        self.target = target

    def create_module(self, spec):
        if self.target is None:  # a package on the way to an alias
            module = types.ModuleType(spec.name)
            module.__path__ = []
            module.__doc__ = f"Made up by xshard.compat: holds {spec.name}'s modules."
            return module
        module = importlib.import_module(self.target)
        if spec.submodule_search_locations is not None and not hasattr(module, "__path__"):
            module.__path__ = []  # a plain module standing for a package: its modules are aliases
        return module

    def exec_module(self, module):
        pass  # the target ran when it was imported


class TorchXlaFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch_xla`` and its modules in ``ALIASES`` (first on ``sys.meta_path``)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch_xla" and not fullname.startswith("torch_xla."):
            return None
        if fullname in ALIASES:
            # An alias with aliased modules under it (torch_xla.distributed.spmd) is a package.
            package = any(name.startswith(fullname + ".") for name in ALIASES)
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(ALIASES[fullname]),
                                                  is_package=package)
        if fullname in _packages():
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(None), is_package=True)
        known = ", ".join(sorted(ALIASES))
        if fullname in REPLACEMENTS:
            raise CompatModuleNotFoundError(
                f"{fullname} is not provided by xshard.compat: {REPLACEMENTS[fullname]}.",
                name=fullname)
        raise CompatModuleNotFoundError(
            f"{fullname} is not provided by xshard.compat (this process runs torch_xla scripts on "
            f"xshard). Provided: {known}. Use xshard's own API for the rest (xshard.spmd, "
            f"xshard.fsdp, xshard.metrics).", name=fullname)


_FINDER = TorchXlaFinder()


_TORCH_AUTOCAST: list = []  # torch.autocast before install() replaced it


def _autocast_xla_means_xshard():
    """``torch.autocast`` whose device type ``"xla"`` means ``"xshard"``: PyTorch accepts "xla"
    without torch_xla, and it would leave xshard tensors in float32, silently."""
    import torch

    base = torch.amp.autocast

    class autocast(base):
        __doc__ = base.__doc__

        def __init__(self, device_type, *args, **kwargs):
            super().__init__("xshard" if device_type == "xla" else device_type, *args, **kwargs)

    _TORCH_AUTOCAST.append(base)
    torch.autocast = torch.amp.autocast = autocast


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (idempotent), and makes ``torch.autocast("xla")``
    autocast xshard tensors. Raises if a real ``torch_xla`` is already imported in this process:
    the two cannot share the ``torch_xla`` names."""
    if _FINDER in sys.meta_path:
        return
    loaded = sys.modules.get("torch_xla")
    if loaded is not None and not getattr(loaded, "__name__", "").startswith("xshard.compat"):
        raise RuntimeError(
            "a real torch_xla is already imported in this process, so xshard.compat cannot stand "
            "for it; run the script with python -m xshard.compat script.py (a fresh process).")
    sys.meta_path.insert(0, _FINDER)
    _autocast_xla_means_xshard()


def uninstall() -> None:
    """Removes the finder and forgets the ``torch_xla`` modules it loaded (tests use this)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    if _TORCH_AUTOCAST:
        import torch

        torch.autocast = torch.amp.autocast = _TORCH_AUTOCAST.pop()
    for name in [n for n in sys.modules if n == "torch_xla" or n.startswith("torch_xla.")]:
        module = sys.modules[name]
        if module.__name__.startswith("xshard.compat") or \
                isinstance(getattr(module, "__loader__", None), _AliasLoader):
            del sys.modules[name]


def installed() -> bool:
    """Whether this process imports ``torch_xla`` as xshard.compat."""
    return _FINDER in sys.meta_path


__all__ = ["ALIASES", "REPLACEMENTS", "TorchXlaFinder", "CompatModuleNotFoundError", "install",
           "uninstall", "installed"]
