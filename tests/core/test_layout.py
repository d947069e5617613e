"""The package's shape: imports point one way, and the IR lists exactly the ops that have rules."""

from __future__ import annotations

import ast
import pathlib

import torch

import xshard
from xshard.core import ir
from xshard.core.lowering import RULES

ROOT = pathlib.Path(xshard.__file__).parent

# Core modules from the bottom up (xshard/core/__init__.py): each imports only modules before it.
CORE_ORDER = ["runtime", "distributed", "dtypes", "metrics", "trace", "ir", "padding", "cells",
              "lowering", "graph", "divergence", "arrays", "placement", "compiler", "capture",
              "execute", "rng", "backend", "decompositions", "ops", "record", "transfer", "fallback",
              "tensor", "device", "barrier", "attention", "rnn", "autocast", "debug", "api"]
# Packages from the bottom up: each imports only packages before it.
PACKAGE_ORDER = ["core", "mesh", "spmd", "fsdp", "checkpoint"]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set:
    """Every xshard module ``path`` imports, at module level or inside functions."""
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else \
        _module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("xshard"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if not base.startswith("xshard"):
                continue
            for a in node.names:
                # ``from xshard.core import ir`` imports a module; ``from x.y import name`` x.y.
                candidate = f"{base}.{a.name}"
                found.add(candidate if _is_module(candidate) else base)
    return found


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _graph() -> dict:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {i for i in _imports(p) if i in modules and i != name}
            for name, p in modules.items()}


def _core_rank(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "core":
        return None
    return CORE_ORDER.index(parts[2]) if parts[2] in CORE_ORDER else None


def test_no_import_cycles():
    graph = _graph()
    state: dict = {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if dep.startswith(node + ".") or node.startswith(dep + "."):
                continue  # a package and its own modules
            if state.get(dep) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(path + [dep])}")
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_core_imports_point_down():
    every_core = {m.split(".")[2] for m in _graph() if m.startswith("xshard.core.")}
    assert every_core <= set(CORE_ORDER), f"modules missing from CORE_ORDER: " \
                                          f"{every_core - set(CORE_ORDER)}"
    for module, deps in _graph().items():
        rank = _core_rank(module)
        if rank is None:
            continue
        for dep in deps:
            if dep == "xshard.core" or dep.startswith(f"xshard.core.{CORE_ORDER[rank]}"):
                continue
            dep_rank = _core_rank(dep)
            assert dep_rank is not None and dep_rank < rank, \
                f"{module} imports {dep}, which is not below it in xshard.core's order"


def test_packages_import_down_only():
    for module, deps in _graph().items():
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in PACKAGE_ORDER:
            continue
        rank = PACKAGE_ORDER.index(parts[1])
        for dep in deps:
            dep_parts = dep.split(".")
            if len(dep_parts) < 2:
                raise AssertionError(f"{module} imports the top-level xshard package")
            assert dep_parts[1] in PACKAGE_ORDER[:rank + 1], \
                f"{module} imports {dep}: {parts[1]} may only import {PACKAGE_ORDER[:rank + 1]}"


def test_ir_lists_every_op_that_has_a_rule_and_vice_versa():
    xshard_rules = {op for op in RULES if isinstance(op, str)}
    assert xshard_rules == set(ir.XSHARD_OPS)
    for op in ir.STRUCTURAL:
        assert op not in RULES  # the interpreter handles these itself
    assert all(isinstance(op, torch._ops.OpOverload) for op in RULES if not isinstance(op, str))


def test_layers_reach_no_private_tensor_state():
    private = ("._cell", "._chain", "._value()", "._assign(", "._cache")
    for path in ROOT.rglob("*.py"):
        if "core" in path.relative_to(ROOT).parts:
            continue
        text = path.read_text()
        for name in private:
            assert name not in text, f"{path.relative_to(ROOT)} reads {name}: use xshard.core.api"
