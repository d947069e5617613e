"""Autocast for the xshard device: ``torch.autocast("xshard", dtype=torch.bfloat16)`` as on CUDA.

PyTorch's autocast is a dispatch key per device type. Entering ``torch.autocast(device_type=...)``
adds that key (for xshard, PrivateUse1's ``AutocastPrivateUse1``) to the thread's included set, so
every op on a device tensor first reaches the kernel registered for that key; the kernel casts its
arguments by the op's policy and calls the op again with the key excluded. PyTorch registers such
kernels in C++ for CUDA, CPU, XPU... and none for PrivateUse1: there is not even a fallthrough, so
before this module any op under ``torch.autocast("xshard")`` failed with "Could not run ... with
arguments from the 'Autocastxshard' backend".

This module registers, with ``torch.library``, a fallthrough for every op (ops outside the lists run
unchanged) and a kernel for each op of PyTorch's CUDA lists, with CUDA's policies:

- ``lower_precision_fp``: matmuls, convolutions, linear, attention, the RNN cells: every eligible
  tensor cast to the autocast dtype (``torch.get_autocast_dtype("xshard")``);
- ``fp32``: ops that need range or precision (exp, log, pow, norms, losses, layer/group norm,
  upsampling...): eligible tensors cast to float32;
- ``fp32_set_opt_dtype``: ops with an output ``dtype`` argument (softmax, log_softmax, sum, prod,
  cumsum, vector/matrix norms): ``dtype=float32`` when the caller set none and the first argument is
  eligible;
- ``fp32_append_dtype``: ``norm`` overloads without a dtype run as the overload with
  ``dtype=float32``;
- ``promote``: ops mixing several inputs (addcmul, addcdiv, atan2, cross, dot, index_put,
  scatter_add...): all eligible tensors cast to the widest dtype among them;
- ``binary_cross_entropy`` is refused, as on CUDA.

A tensor is eligible, as in PyTorch's C++, when it is an xshard tensor of a floating dtype other
than float64; CPU 0-dim operands and float64 tensors are never cast. Casts are ordinary recorded ops
below the autocast key and above autograd, so backward casts gradients back to each input's dtype.

xshard adds ``aten::lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (both overloads) as
``lower_precision_fp``: CUDA casts those through cuDNN's ``_cudnn_rnn``, xshard runs them as
``xshard::rnn_layer`` scans (xshard/core/rnn.py).

Not reproduced: CUDA's cache of casted weights within one autocast region (on xshard a cast is a
lazy node; XLA merges repeated casts of one weight in the compiled program).

Example:
    >>> model = torch.nn.Linear(4, 4).to(xshard.device())
    >>> with torch.autocast("xshard", dtype=torch.bfloat16):
    ...     y = model(torch.randn(2, 4, device=xshard.device()))
    >>> y.dtype
    torch.bfloat16
"""

from __future__ import annotations

import torch

from xshard.core.backend import DEVICE_TYPE

aten = torch.ops.aten

# PyTorch's CUDA lists (aten/src/ATen/autocast_mode.cpp and autocast_mode.h, 2.13): the op
# names registered for AutocastCUDA, by policy. tests/core/test_autocast.py checks that these are
# exactly the ops registered for AutocastCUDA and that each gives the output dtype CUDA gives.
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "cudnn_convolution",
    "cudnn_convolution_transpose",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa", "rms_norm",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)
FP32_APPEND_DTYPE = {  # overload without dtype -> the overload it runs as, with dtype=float32
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
    "tensordot", "scatter_add", "vdot",
)
BANNED = ("binary_cross_entropy",)
# xshard's own: the recurrent layers, which CUDA autocasts through cuDNN's _cudnn_rnn.
XSHARD_LOWER_PRECISION_FP = (
    "lstm.input", "lstm.data", "gru.input", "gru.data", "rnn_tanh.input", "rnn_tanh.data",
    "rnn_relu.input", "rnn_relu.data",
)

_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_EXCLUDE = torch._C.DispatchKeySet(_KEY)


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")


def _eligible(x) -> bool:
    return (isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE
            and x.is_floating_point() and x.dtype != torch.float64)


def _cast(x, dtype):
    if _eligible(x):
        return x if x.dtype == dtype else x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _lower_precision_dtype():
    return torch.get_autocast_dtype(DEVICE_TYPE)


def _casting(op, dtype_of):
    """A kernel casting every eligible tensor argument to ``dtype_of(args, kwargs)``."""
    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            dtype = dtype_of(args, kwargs)
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})
    return kernel


def _promote_dtype(args, kwargs):
    """The widest dtype among the eligible tensors (float64 ignored), as CUDA's promote policy."""
    lower = _lower_precision_dtype()
    current = lower
    for x in list(args) + list(kwargs.values()):
        for t in (x if isinstance(x, (list, tuple)) else (x,)):
            if not _eligible(t):
                continue
            if current == torch.float32 or t.dtype == torch.float32:
                current = torch.float32
            elif t.dtype != lower:
                raise TypeError(
                    f"autocast to {lower} cannot promote a {t.dtype} operand; cast it to "
                    f"{lower} or float32 first.")
    return current


def _set_opt_dtype(op):
    names = [a.name for a in op._schema.arguments]
    dtype_index = names.index("dtype")
    positional = not op._schema.arguments[dtype_index].kwarg_only

    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if args and _eligible(args[0]):
                if positional and len(args) > dtype_index:
                    if args[dtype_index] is None:
                        args = args[:dtype_index] + (torch.float32,) + args[dtype_index + 1:]
                elif kwargs.get("dtype") is None:
                    kwargs = dict(kwargs, dtype=torch.float32)
            return op(*args, **kwargs)
    return kernel


def _append_dtype(op, target):
    # A Python kernel receives only the arguments the caller gave; the overload it runs as may
    # not default them (norm.Scalar's p=2 is a required p? in norm.ScalarOpt_dtype).
    defaults = [a.default_value if a.has_default_value() else None
                for a in op._schema.arguments if not a.kwarg_only]

    def kernel(keyset, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            out_type = torch.float32 if _eligible(args[0]) else args[0].dtype
            args = tuple(args) + tuple(defaults[len(args):])
            return target(*args, **kwargs, dtype=out_type)
    return kernel


def _banned(name):
    def kernel(keyset, *args, **kwargs):
        raise RuntimeError(
            f"aten::{name} is unsafe to autocast (its input is a probability computed in low "
            f"precision, usually by a sigmoid just before it). Fuse the two: use "
            f"torch.nn.functional.binary_cross_entropy_with_logits or nn.BCEWithLogitsLoss, "
            f"which autocast runs in float32; or compute this loss outside the autocast region.")
    return kernel


def _register():
    """Registers the kernels; they stay registered as long as the returned Library objects live."""
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")

    def impl(name, kernel):
        lib.impl(name, kernel, "AutocastPrivateUse1", with_keyset=True)

    for name in LOWER_PRECISION_FP + XSHARD_LOWER_PRECISION_FP:
        impl(name, _casting(_overload(name), lambda a, k: _lower_precision_dtype()))
    for name in FP32:
        impl(name, _casting(_overload(name), lambda a, k: torch.float32))
    for name in FP32_SET_OPT_DTYPE:
        impl(name, _set_opt_dtype(_overload(name)))
    for name, target in FP32_APPEND_DTYPE.items():
        impl(name, _append_dtype(_overload(name), _overload(target)))
    for name in PROMOTE:
        impl(name, _casting(_overload(name), _promote_dtype))
    for name in BANNED:
        impl(name, _banned(name))
    return fallback, lib


_FALLBACK, _LIB = _register()
