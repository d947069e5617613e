"""OpInfo conformance: common ops against eager CPU PyTorch (harness: opinfo_harness.py).

The fast subset runs in CI; ``-m slow`` runs every OpInfo (the figures of the full run, with all
dtypes, are in docs/conformance.md, made by scripts/opinfo_conformance.py).
"""

import pytest
import torch

from opinfo_harness import check, full_name, op_by_name, supported, variants

# Common ops: elementwise, reductions, indexing, shape ops and nn ops.
FAST_OPS = [
    # elementwise
    "abs", "neg", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "erf",
    "reciprocal", "floor", "ceil", "round", "trunc", "sign", "clamp", "add", "sub", "mul",
    "div.no_rounding_mode", "div.floor_rounding", "true_divide", "pow", "remainder", "fmod",
    "maximum", "minimum", "eq", "ne", "lt", "ge", "where", "lerp", "addcmul", "addcdiv",
    "logical_and", "logical_not", "isnan", "nan_to_num", "atan2", "masked_fill",
    # reductions
    "sum", "mean", "prod", "amax", "amin", "argmax", "argmin", "max.reduction_with_dim",
    "min.reduction_with_dim", "var", "std", "any", "all", "logsumexp", "cumsum", "norm",
    "softmax", "log_softmax", "sort", "topk",
    # indexing
    "index_select", "gather", "scatter", "scatter_add", "index_add", "index_put", "index_fill",
    "take_along_dim", "__getitem__",
    # shape ops
    "cat", "stack", "reshape", "view", "permute", "transpose", "squeeze", "unsqueeze", "flatten",
    "expand", "repeat", "flip", "roll", "narrow", "split", "chunk", "tril", "triu",
    "diagonal", "t", "unbind",
    # nn ops and linear algebra
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear", "nn.functional.relu",
    "nn.functional.gelu", "nn.functional.silu", "nn.functional.layer_norm",
    "nn.functional.conv2d", "nn.functional.embedding", "nn.functional.cross_entropy",
    "nn.functional.mse_loss", "nn.functional.pad.constant", "nn.functional.avg_pool2d",
    "nn.functional.max_pool2d", "nn.functional.softplus",
]


# Checks that fail for a reason xshard cannot fix: the order of tied elements is unspecified.
KNOWN_FAILURES = {
    ("topk", "function", torch.int64): "ATen's CPU topk returns tied values in an unspecified "
                                        "order (its partial sort), XLA's top_k in index order",
}


def _cases(names, dtypes):
    """``names``: full OpInfo names (``name.variant_test_name``)."""
    cases = []
    for name in names:
        op = op_by_name(name)
        for dtype in supported(op, dtypes):
            for variant, _ in variants(op):
                reason = KNOWN_FAILURES.get((name, variant, dtype))
                marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
                cases.append(pytest.param(op, variant, dtype, marks=marks,
                                          id=f"{name}-{variant}-{str(dtype)[6:]}"))
    return cases


def _assert_passes(op, variant, dtype, n_samples):
    result = check(op, variant, dtype, n_samples=n_samples)
    if not result.applicable:
        pytest.skip("no sample is valid for this variant in eager PyTorch")
    assert result.fully_passes, f"{result.failed} samples failed; first: {result.error}"


@pytest.mark.parametrize("op,variant,dtype", _cases(FAST_OPS, (torch.float32, torch.int64)))
def test_common_op_matches_eager(op, variant, dtype):
    _assert_passes(op, variant, dtype, n_samples=2)


# Every OpInfo's float32 checks that fail, and why (docs/conformance.md lists them all). Strict:
# one that starts to pass is taken off this list.
_SPARSE = "sparse layouts: xshard tensors are dense (a clear error names the op)"
_SAVED_STATS = ("the saved mean/invstd of an eval-mode batch norm: ATen's CPU kernel returns them "
                "empty, its meta kernel (which xshard conforms to) with the channels' size")
KNOWN_FLOAT32_FAILURES = {
    "addbmm": "addbmm_ into an input that broadcasts: eager resizes the input, xshard refuses to "
              "change a tensor's shape in place",
    "chalf": "complex32 is not a supported dtype (the error names the supported ones)",
    "native_batch_norm": _SAVED_STATS,
    "_native_batch_norm_legit": _SAVED_STATS,
    "sparse.sampled_addmm": _SPARSE,
    "sparse.mm.reduce": _SPARSE,
    "to_sparse": _SPARSE,
}


def _every_opinfo():
    from torch.testing._internal.common_methods_invocations import op_db

    cases = []
    for op in op_db:
        reason = KNOWN_FLOAT32_FAILURES.get(full_name(op))
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        cases.append(pytest.param(op, id=full_name(op), marks=marks))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("op", _every_opinfo())
def test_every_opinfo_float32(op):
    """Every OpInfo, float32, function and in-place variants (see docs/conformance.md)."""
    if torch.float32 not in supported(op):
        pytest.skip("the OpInfo does not support float32 on CPU")
    failures = []
    for variant, _ in variants(op):
        result = check(op, variant, torch.float32)
        if result.applicable and not result.fully_passes:
            failures.append(f"{variant}: {result.error or result.excluded}")
    assert not failures, "; ".join(failures)
