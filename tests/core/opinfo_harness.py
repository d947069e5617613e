"""Conformance with PyTorch's OpInfo database: OpInfo samples on xshard, eager CPU the oracle.

One check is an OpInfo, a variant (``"function"``: ``op.op``; ``"inplace"``: ``op.inplace_variant``)
and a dtype. For each of the first ``n_samples`` of ``op.sample_inputs('cpu', dtype)``:

1. the sample runs eagerly on CPU (on a clone, since an in-place variant writes its input). If that
   raises, the sample is not valid for this variant (an in-place op whose result dtype cannot be
   written back into its input, for example) and is counted in ``skipped``, not as a failure;
2. the same call runs on copies of the tensors on ``xshard.device()``, then ``xshard.sync()``;
3. the results (and, for an in-place variant, the mutated input) are compared with
   ``torch.testing.assert_close`` (``equal_nan=True``, ``check_stride=False``,
   ``check_dtype=True``).

A check *fully passes* when every valid sample passes; an exception on the xshard side is a failure.
A check whose every sample is invalid in eager is *not applicable* (excluded from the totals). An op
that runs through the CPU fallback passes when its values match; the fallback is recorded.

[Note: what the checks compare]
- Random ops (``_RANDOM``, and the samples of ``_RANDOM_SAMPLE`` with dropout) and ops returning
  uninitialised memory (``_UNINITIALISED``) have no reproducible values; for them only shapes and
  dtypes are compared.
- Tolerances: ``assert_close``'s defaults for the dtype, widened for float32 to
  ``rtol=1e-4, atol=1e-5`` (XLA's CPU transcendental functions and reduction orders differ from
  ATen's in the last few bits).

[Note: the skip list]
``SKIP`` would name OpInfos too slow or too large to run, each with its reason. A skipped check
counts as a failure (see ``skip_result``), so skipping hides nothing. It is empty: every OpInfo,
LAPACK-backed linear algebra and sparse ones included, runs in seconds (what xshard cannot lower
runs through the CPU fallback or fails). Checks that do not apply are not skipped but left out:
dtypes an OpInfo does not support on CPU (so complex-only OpInfos have no float32/int64/bool
checks), and checks whose every sample eager PyTorch rejects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings

import torch
from torch.testing._internal import common_utils
from torch.utils import _pytree as pytree

import xshard
from xshard import metrics

DEFAULT_SAMPLES = 5
DTYPES = (torch.float32, torch.int64, torch.bool)

# OpInfo full name -> why it is not run; each counts as a failure (see [Note: the skip list]).
SKIP: dict = {}

# Ops whose outputs are random: only shape, dtype and device are compared.
_RANDOM = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "normal.in_place", "normal.number_mean", "rand_like", "randint", "randint_like", "randn",
    "randn_like", "uniform", "nn.functional.alpha_dropout", "nn.functional.dropout",
    "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "nn.functional.rrelu",
}
# Ops with dropout: their samples with a dropout probability > 0 are random.
_RANDOM_SAMPLE = {
    "nn.functional.scaled_dot_product_attention": lambda s: s.kwargs.get("dropout_p", 0) > 0,
    "nn.functional.multi_head_attention_forward": lambda s: s.kwargs.get("training") and
    s.args[3] > 0,
}
# Ops that return uninitialised memory: only shape, dtype and device are compared.
_UNINITIALISED = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty",
                  "new_empty_strided"}

# Ops whose index arguments must be CPU tensors on any device (PyTorch checks it): only their input
# moves to the device, as in PyTorch's own device tests.
_HOST_ARGS = {"tensor_split"}

_FLOAT32_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@dataclasses.dataclass
class Result:
    """The outcome of one (op, variant, dtype) check."""

    op: str
    variant: str  # "function" | "inplace"
    dtype: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0  # samples whose eager run raised (not valid for this variant)
    fallbacks: tuple = ()  # aten ops that ran through the CPU fallback
    error: str = ""  # the first failure, one line
    excluded: str = ""  # why the check was not run (skip list), if it was not
    seconds: float = 0.0

    @property
    def applicable(self) -> bool:
        return bool(self.excluded) or self.passed + self.failed > 0

    @property
    def fully_passes(self) -> bool:
        return not self.excluded and self.failed == 0 and self.passed > 0


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def variants(op):
    """The (name, callable) variants of an OpInfo that the harness checks."""
    out = [("function", op.op)]
    if op.inplace_variant is not None:
        out.append(("inplace", op.inplace_variant))
    return out


def supported(op, dtypes=DTYPES):
    return [d for d in dtypes if d in op.supported_dtypes("cpu")]


def skip_result(op, variant, dtype) -> Result:
    return Result(full_name(op), variant, dtype_name(dtype), excluded=SKIP[full_name(op)])


def check(op, variant: str, dtype, n_samples: int = DEFAULT_SAMPLES) -> Result:
    """Runs one check; see the module docstring for what is compared."""
    if full_name(op) in SKIP:
        return skip_result(op, variant, dtype)
    fn = dict(variants(op))[variant]
    result = Result(full_name(op), variant, dtype_name(dtype))
    start = time.perf_counter()
    fallbacks = set()
    torch.manual_seed(0)
    try:
        with _untracked_samples():
            samples = list(_first(op.sample_inputs("cpu", dtype), n_samples))
    except Exception as e:  # noqa: BLE001 - a broken sample generator is not our failure
        result.excluded = f"sample generation failed: {_one_line(e)}"
        return result
    for sample in samples:
        outcome = _check_sample(op, fn, variant == "inplace", sample)
        if outcome is None:
            result.skipped += 1
            continue
        error, used = outcome
        fallbacks |= used
        if error is None:
            result.passed += 1
        else:
            result.failed += 1
            result.error = result.error or error
    result.fallbacks = tuple(sorted(fallbacks))
    result.seconds = time.perf_counter() - start
    return result


@contextlib.contextmanager
def _untracked_samples():
    """Sample iterators look for a unittest frame on the stack for debugging (``inspect.stack()``,
    most of the harness's time under pytest); there is none here, so skip the search."""
    from torch.testing._internal.opinfo import core

    # opinfo.core imported the function by name: patch it there (common_utils' is not called).
    saved = common_utils.extract_test_fn, core.extract_test_fn
    common_utils.extract_test_fn = core.extract_test_fn = lambda: None
    try:
        yield
    finally:
        common_utils.extract_test_fn, core.extract_test_fn = saved


def _first(iterable, n):
    for i, x in enumerate(iterable):
        if i >= n:
            return
        yield x


def _check_sample(op, fn, inplace, sample):
    """None if the sample is invalid in eager; else (error message or None, fallback op names)."""
    args = (sample.input, *sample.args)
    cpu_args, cpu_kwargs = _clone((args, sample.kwargs))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = fn(*cpu_args, **cpu_kwargs)
    except Exception:  # noqa: BLE001 - the sample is not valid for this variant
        return None
    expected_input = cpu_args[0] if inplace else None
    before = dict(metrics.snapshot()["cpu_fallbacks"])
    try:
        if full_name(op) in _HOST_ARGS:
            dev_args, dev_kwargs = (_to_device(args[0]), *args[1:]), sample.kwargs
        else:
            dev_args, dev_kwargs = _to_device((args, sample.kwargs))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            actual = fn(*dev_args, **dev_kwargs)
            xshard.sync()
            actual = _to_cpu(actual)
            actual_input = _to_cpu(dev_args[0]) if inplace else None
    except Exception as e:  # noqa: BLE001 - any xshard error is a failure of this sample
        return f"{type(e).__name__}: {_one_line(e)}", _new_fallbacks(before)
    used = _new_fallbacks(before)
    name = full_name(op)
    values = not (name in _RANDOM or name in _UNINITIALISED or (
        name in _RANDOM_SAMPLE and _RANDOM_SAMPLE[name](sample)))
    try:
        _compare(actual, expected, values)
        if inplace:
            _compare(actual_input, expected_input, values)
    except Exception as e:  # noqa: BLE001
        return f"mismatch: {_one_line(e)}", used
    return None, used


def _new_fallbacks(before):
    after = metrics.snapshot()["cpu_fallbacks"]
    return {op for op, n in after.items() if n > before.get(op, 0)}


def _clone(tree):
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _to_device(tree):
    dev = xshard.device()

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone().to(dev).requires_grad_(x.requires_grad)
        if isinstance(x, torch.device) and x.type == "cpu":
            return dev
        if isinstance(x, str) and x == "cpu":
            return dev
        return x
    return pytree.tree_map(move, tree)


def _to_cpu(tree):
    def move(x):
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                return x.detach().cpu()
            return x.detach()
        return x
    return _normalise(pytree.tree_map(move, _normalise(tree)))


def _normalise(x):
    """Named tuples (torch.return_types) and lists compare as plain lists."""
    if isinstance(x, (list, tuple)):
        return [_normalise(v) for v in x]
    return x


def _compare(actual, expected, values=True):
    expected = _normalise(pytree.tree_map(
        lambda x: x.detach() if isinstance(x, torch.Tensor) else x, _normalise(expected)))
    if not values:
        return _compare_metadata(actual, expected)
    tol = _tolerance(expected)
    torch.testing.assert_close(actual, expected, equal_nan=True, check_stride=False,
                               check_dtype=True, check_device=False, **tol)


def _tolerance(expected):
    leaves = [x for x in pytree.tree_leaves(expected) if isinstance(x, torch.Tensor)]
    if any(x.dtype == torch.float32 for x in leaves):
        return _FLOAT32_TOLERANCE
    return {}


def _compare_metadata(actual, expected):
    a_leaves, e_leaves = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        raise AssertionError(f"{len(a_leaves)} outputs, expected {len(e_leaves)}")
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
                raise AssertionError(f"got {_meta(a)}, expected {_meta(e)}")


def _meta(x):
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__


def _one_line(e, limit=160) -> str:
    text = " ".join(str(e).split())
    return text[:limit] + ("..." if len(text) > limit else "")


def op_by_name(name: str):
    """The OpInfo whose full name (``name.variant_test_name``) is ``name``."""
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if full_name(op) == name:
            return op
    raise KeyError(f"no OpInfo named {name!r}")


def full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
