"""torch.autocast on the xshard device follows PyTorch's CUDA lists.

Oracles: for the output dtype of each op, PyTorch's own CUDA autocast kernels, run on fake CUDA
tensors (FakeTensorMode needs no GPU); for values, eager CPU autocast (whose lists differ from
CUDA's: e.g. CPU runs softmax and exp in bfloat16 where CUDA runs them in float32), within bfloat16
tolerance."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import xshard
from core_testing import DEV, assert_same, counting
from xshard.core import autocast as xautocast

aten = torch.ops.aten
BF16 = torch.bfloat16


def _op(name):
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")


# One call per op of CUDA's lists: f(t, i) -> args, where t(*shape) makes a float tensor and
# i(shape, high) an int64 one.
def _conv_args(t, transposed=False):
    return (t(1, 2, 5, 5), t(3, 2, 3, 3), t(3), [1, 1], [0, 0], [1, 1], transposed, [0, 0], 1)


def _rnn_cell(t, gates):
    return (t(2, 3), t(2, 2), t(gates * 2, 3), t(gates * 2, 2), t(gates * 2), t(gates * 2))


SAMPLES = {
    # lower_precision_fp
    "_convolution.deprecated": lambda t, i: _conv_args(t) + (False, False, True),
    "_convolution": lambda t, i: _conv_args(t) + (False, False, True, True),
    "conv1d": lambda t, i: (t(1, 2, 5), t(3, 2, 3), t(3)),
    "conv2d": lambda t, i: (t(1, 2, 5, 5), t(3, 2, 3, 3), t(3)),
    "conv3d": lambda t, i: (t(1, 2, 4, 4, 4), t(3, 2, 3, 3, 3), t(3)),
    "conv_tbc": lambda t, i: (t(5, 1, 2), t(3, 2, 4), t(4), 1),
    "conv_transpose1d": lambda t, i: (t(1, 2, 5), t(2, 3, 3), t(3)),
    "conv_transpose2d.input": lambda t, i: (t(1, 2, 5, 5), t(2, 3, 3, 3), t(3)),
    "conv_transpose3d.input": lambda t, i: (t(1, 2, 4, 4, 4), t(2, 3, 3, 3, 3), t(3)),
    "convolution": lambda t, i: _conv_args(t),
    "prelu": lambda t, i: (t(2, 3), t(3)),
    "addmm": lambda t, i: (t(2, 3), t(2, 4), t(4, 3)),
    "addmv": lambda t, i: (t(2), t(2, 3), t(3)),
    "addr": lambda t, i: (t(2, 3), t(2), t(3)),
    "matmul": lambda t, i: (t(2, 3), t(3, 4)),
    "einsum": lambda t, i: ("ij,jk->ik", [t(2, 3), t(3, 4)]),
    "mm": lambda t, i: (t(2, 3), t(3, 4)),
    "mv": lambda t, i: (t(2, 3), t(3)),
    "linalg_vecdot": lambda t, i: (t(2, 3), t(2, 3)),
    "linear": lambda t, i: (t(2, 3), t(4, 3), t(4)),
    "addbmm": lambda t, i: (t(2, 4), t(3, 2, 5), t(3, 5, 4)),
    "baddbmm": lambda t, i: (t(3, 2, 4), t(3, 2, 5), t(3, 5, 4)),
    "bmm": lambda t, i: (t(3, 2, 5), t(3, 5, 4)),
    "chain_matmul": lambda t, i: ([t(2, 3), t(3, 4), t(4, 2)],),
    "linalg_multi_dot": lambda t, i: ([t(2, 3), t(3, 4), t(4, 2)],),
    "_thnn_fused_lstm_cell": lambda t, i: (t(2, 8), t(2, 8), t(2, 2), t(8), t(8)),
    "_thnn_fused_gru_cell": lambda t, i: (t(2, 6), t(2, 6), t(2, 2), t(6), t(6)),
    "lstm_cell": lambda t, i: (t(2, 3), [t(2, 2), t(2, 2)], t(8, 3), t(8, 2), t(8), t(8)),
    "gru_cell": lambda t, i: _rnn_cell(t, 3),
    "rnn_tanh_cell": lambda t, i: _rnn_cell(t, 1)[:2] + (t(2, 3), t(2, 2), t(2), t(2)),
    "rnn_relu_cell": lambda t, i: _rnn_cell(t, 1)[:2] + (t(2, 3), t(2, 2), t(2), t(2)),
    "scaled_dot_product_attention": lambda t, i: (t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)),
    # fp32
    **{name: (lambda t, i: (t(3),)) for name in (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "softplus")},
    "pow.Tensor_Scalar": lambda t, i: (t(3), 2.0),
    "pow.Tensor_Tensor": lambda t, i: (t(3), t(3)),
    "pow.Scalar": lambda t, i: (2.0, t(3)),
    "layer_norm": lambda t, i: (t(2, 4), [4], t(4), t(4)),
    "native_layer_norm": lambda t, i: (t(2, 4), [4], t(4), t(4), 1e-5),
    "group_norm": lambda t, i: (t(2, 4, 3), 2, t(4), t(4)),
    "frobenius_norm.dim": lambda t, i: (t(2, 3), [0, 1]),
    "nuclear_norm": lambda t, i: (t(3, 3),),
    "nuclear_norm.dim": lambda t, i: (t(3, 3), [0, 1]),
    "cosine_similarity": lambda t, i: (t(2, 3), t(2, 3)),
    "poisson_nll_loss": lambda t, i: (t(3), t(3), True, False, 1e-8, 1),
    "cosine_embedding_loss": lambda t, i: (t(2, 3), t(2, 3), t(2)),
    "nll_loss": lambda t, i: (t(2, 3), i((2,), 3)),
    "nll_loss2d": lambda t, i: (t(2, 3, 4, 4), i((2, 4, 4), 3)),
    **{name: (lambda t, i: (t(3), t(3))) for name in (
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "soft_margin_loss", "binary_cross_entropy_with_logits", "dist")},
    "margin_ranking_loss": lambda t, i: (t(3), t(3), t(3)),
    "multilabel_margin_loss": lambda t, i: (t(2, 3), i((2, 3), 3)),
    "triplet_margin_loss": lambda t, i: (t(2, 3), t(2, 3), t(2, 3)),
    "multi_margin_loss": lambda t, i: (t(2, 3), i((2,), 3)),
    "pdist": lambda t, i: (t(3, 2),),
    "cdist": lambda t, i: (t(2, 3), t(4, 3)),
    "renorm": lambda t, i: (t(2, 3), 2, 0, 1.0),
    "logsumexp": lambda t, i: (t(2, 3), [1]),
    "upsample_nearest1d": lambda t, i: (t(1, 2, 4), [8]),
    "_upsample_nearest_exact1d": lambda t, i: (t(1, 2, 4), [8]),
    "upsample_nearest2d": lambda t, i: (t(1, 2, 4, 4), [8, 8]),
    "_upsample_nearest_exact2d": lambda t, i: (t(1, 2, 4, 4), [8, 8]),
    "upsample_nearest3d": lambda t, i: (t(1, 2, 2, 2, 2), [4, 4, 4]),
    "_upsample_nearest_exact3d": lambda t, i: (t(1, 2, 2, 2, 2), [4, 4, 4]),
    "upsample_linear1d": lambda t, i: (t(1, 2, 4), [8], False),
    "upsample_bilinear2d": lambda t, i: (t(1, 2, 4, 4), [8, 8], False),
    "_upsample_bilinear2d_aa": lambda t, i: (t(1, 2, 4, 4), [8, 8], False),
    "upsample_trilinear3d": lambda t, i: (t(1, 2, 2, 2, 2), [4, 4, 4], False),
    "upsample_bicubic2d": lambda t, i: (t(1, 2, 4, 4), [8, 8], False),
    "_upsample_bicubic2d_aa": lambda t, i: (t(1, 2, 4, 4), [8, 8], False),
    "rms_norm": lambda t, i: (t(2, 4), [4], t(4)),
    # fp32_set_opt_dtype
    "prod": lambda t, i: (t(3),),
    "prod.dim_int": lambda t, i: (t(2, 3), 1),
    "softmax.int": lambda t, i: (t(2, 3), 1),
    "log_softmax.int": lambda t, i: (t(2, 3), 1),
    "cumprod": lambda t, i: (t(3), 0),
    "cumsum": lambda t, i: (t(3), 0),
    "linalg_vector_norm": lambda t, i: (t(3),),
    "linalg_matrix_norm": lambda t, i: (t(3, 3), 1),
    "linalg_matrix_norm.str_ord": lambda t, i: (t(3, 3),),
    "sum": lambda t, i: (t(3),),
    "sum.dim_IntList": lambda t, i: (t(2, 3), [1]),
    # fp32_append_dtype
    "norm.Scalar": lambda t, i: (t(3),),
    "norm.ScalarOpt_dim": lambda t, i: (t(2, 3), 2, [1]),
    # promote
    "addcdiv": lambda t, i: (t(3), t(3), t(3)),
    "addcmul": lambda t, i: (t(3), t(3), t(3)),
    "atan2": lambda t, i: (t(3), t(3)),
    "bilinear": lambda t, i: (t(2, 3), t(2, 4), t(5, 3, 4), t(5)),
    "cross": lambda t, i: (t(2, 3), t(2, 3)),
    "dot": lambda t, i: (t(3), t(3)),
    "vdot": lambda t, i: (t(3), t(3)),
    "grid_sampler": lambda t, i: (t(1, 2, 4, 4), t(1, 3, 3, 2), 0, 0, False),
    "index_put": lambda t, i: (t(4, 3), [i((2,), 4)], t(2, 3)),
    "tensordot": lambda t, i: (t(2, 3), t(3, 4), [1], [0]),
    "scatter_add": lambda t, i: (t(3, 4), 0, i((2, 4), 3), t(2, 4)),
    # refused
    "binary_cross_entropy": lambda t, i: (t(3), t(3)),
}
# CUDA kernels that only exist on CUDA: their policy is registered, their call is not sampled.
CUDA_ONLY = {"cudnn_convolution", "cudnn_convolution_transpose",
             "_scaled_dot_product_flash_attention"}


def _makers(device, dtypes):
    """Tensor makers for one call: the k-th float tensor gets dtypes[min(k, len - 1)]."""
    count = [0]

    def t(*shape):
        dtype = dtypes[min(count[0], len(dtypes) - 1)]
        count[0] += 1
        return torch.rand(shape, device=device).to(dtype) * 0.5 + 0.25

    def i(shape, high):
        return torch.randint(0, high, shape, device=device)

    return t, i


def _outcome(name, device, dtypes):
    """The output dtype(s) of op ``name`` under bfloat16 autocast on ``device``, or the error."""
    torch.manual_seed(0)
    try:
        args = SAMPLES[name](*_makers(device, dtypes))
        out = _op(name)(*args)
    except Exception as e:  # noqa: BLE001  (the outcome compared is "it raised")
        return f"raises {type(e).__name__}"
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(o.dtype for o in outs if isinstance(o, torch.Tensor))


def _promoted(dtypes):
    return (torch.float32,) if torch.float32 in dtypes else (BF16,)


# Calls PyTorch's fake CUDA tensors cannot run (grid_sampler's decomposition asks for a real CUDA
# device): the outcome CUDA's policy for the op prescribes.
CUDA_POLICY_BY_HAND = {"grid_sampler": _promoted}


def _fake_outcome(device, name, dtypes):
    """``name``'s outcome under bfloat16 autocast for ``device``, on fake tensors of that device
    (only shapes and dtypes; PyTorch's fake CUDA tensors need no GPU)."""
    if device == "cuda" and name in CUDA_POLICY_BY_HAND:
        return CUDA_POLICY_BY_HAND[name](dtypes)
    prev = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, BF16)
    try:
        with FakeTensorMode():
            return _outcome(name, device, dtypes)
    finally:
        torch.set_autocast_enabled(device, prev[0])
        torch.set_autocast_dtype(device, prev[1])


INPUTS = {"float32": (torch.float32,), "bfloat16": (BF16,),
          "mixed": (torch.float32, BF16), "mixed_bf16_first": (BF16, torch.float32)}


def test_lists_are_cudas():
    """xshard registers exactly the ops PyTorch registers for AutocastCUDA (plus its RNNs)."""
    cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    ours = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastPrivateUse1"))
    extra = {f"aten::{n}" for n in xautocast.XSHARD_LOWER_PRECISION_FP}
    assert ours - extra == cuda
    assert set(SAMPLES) | CUDA_ONLY == {n.removeprefix("aten::") for n in cuda}


@pytest.mark.parametrize("inputs", list(INPUTS))
def test_output_dtypes_match_cuda(inputs):
    """Each op of the lists gives, under bfloat16 autocast, the dtypes CUDA's kernel gives, for
    float32, bfloat16 and mixed inputs (both on fake tensors: the policies, not the kernels)."""
    dtypes = INPUTS[inputs]
    mismatches = {}
    for name in sorted(SAMPLES):
        ours, cuda = _fake_outcome("xshard", name, dtypes), _fake_outcome("cuda", name, dtypes)
        if ours != cuda:
            mismatches[name] = (ours, cuda)
    assert mismatches == {}


@pytest.mark.parametrize("name", ["mm", "linear", "softmax.int", "layer_norm", "sum", "norm.Scalar",
                                  "norm.ScalarOpt_dim", "addcmul", "exp", "mse_loss",
                                  "_thnn_fused_gru_cell"])
def test_output_dtypes_on_device_tensors(name):
    for dtypes in INPUTS.values():
        with torch.autocast("xshard", dtype=BF16):
            assert _outcome(name, DEV, dtypes) == _fake_outcome("cuda", name, dtypes), dtypes


def test_binary_cross_entropy_is_refused():
    x = torch.rand(3, device=DEV)
    with torch.autocast("xshard", dtype=BF16):
        with pytest.raises(RuntimeError, match="unsafe to autocast.*_cross_entropy_with_logits"):
            F.binary_cross_entropy(x, x)


def test_ops_outside_the_lists_run_unchanged():
    x = torch.randn(4, device=DEV)
    h = x.to(BF16)
    with torch.autocast("xshard", dtype=BF16):
        assert (x + 1).dtype == torch.float32 and (h * x).dtype == torch.float32
        assert torch.cat([x, h]).dtype == torch.float32  # cat promotes by itself (not listed)
        assert x.double().exp().dtype == torch.float64  # float64 is never cast
        assert torch.mm(x.double()[None], x.double()[:, None]).dtype == torch.float64
        with torch.autocast("xshard", enabled=False):
            assert torch.mm(x[None], x[:, None]).dtype == torch.float32
    assert torch.mm(x[None], x[:, None]).dtype == torch.float32


def test_float16():
    x = torch.randn(2, 3, device=DEV)
    with torch.autocast("xshard", dtype=torch.float16):
        y = x @ x.t()
        assert y.dtype == torch.float16
        assert torch.softmax(y, -1).dtype == torch.float32


class Block(nn.Module):
    """A pre-norm transformer block and an MLP head: linear, layer_norm, softmax attention,
    gelu, residual adds, a cross-entropy loss."""

    def __init__(self, d=16, heads=2, classes=5):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (z.reshape(b, s, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        x = x + self.mlp(self.ln2(x))
        return self.head(x.mean(1))


class _OpDtypes(TorchDispatchMode):
    """Records, per aten op packet, the output dtypes of the ops that reach the dispatch modes."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        _note(self.seen, func, out)
        return out


def _note(seen, func, out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    dtypes = {o.dtype for o in outs if isinstance(o, torch.Tensor)}
    seen.setdefault(func.overloadpacket.__name__, set()).update(dtypes)


def _xshard_op_dtypes(fn):
    """Per aten op packet, the output dtypes of what ``fn`` records on xshard."""
    from xshard.core import tensor as xt

    seen = {}
    inner = xt.dispatch

    def spy(func, args, kwargs):
        out = inner(func, args, kwargs)
        _note(seen, func, out)
        return out

    xt.dispatch = spy
    try:
        fn()
    finally:
        xt.dispatch = inner
    return seen


def _forward(model, x, y, device):
    with torch.autocast(device, dtype=BF16):
        logits = model(x)
        return logits, F.cross_entropy(logits, y)


def _step(model, x, y, device):
    logits, loss = _forward(model, x, y, device)
    loss.backward()
    return logits, loss


def _fake_cuda_op_dtypes(make_model, x_shape):
    """Per aten op packet, the output dtypes of a forward on fake CUDA tensors, CUDA autocast."""
    with torch.device("meta"):
        model = make_model()
    with FakeTensorMode(allow_non_fake_inputs=True):  # shapes and dtypes only: no CUDA RNG
        model = model.to_empty(device="cuda").requires_grad_(False)
        x = torch.empty(x_shape, device="cuda")
        y = torch.zeros(x_shape[:1], dtype=torch.int64, device="cuda")
        # No autograd (its nodes want a real CUDA device); autocast does not depend on it.
        with _OpDtypes() as record, torch.no_grad():
            prev = torch.get_autocast_dtype("cuda")
            torch.set_autocast_dtype("cuda", BF16)
            torch.set_autocast_enabled("cuda", True)  # torch.autocast refuses without a GPU
            try:
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            finally:
                torch.set_autocast_enabled("cuda", False)
                torch.set_autocast_dtype("cuda", prev)
    return record.seen


def test_transformer_block_trains_like_cpu_autocast():
    """Forward and backward under bfloat16 autocast equal eager CPU autocast within bfloat16
    tolerance; every recorded op gives the dtypes CUDA autocast gives (fake CUDA tensors), where
    CPU's lists differ (softmax runs in bfloat16 on CPU); gradients are float32 like
    the weights; a steady step compiles once."""
    torch.manual_seed(0)
    ref = Block()
    model = copy.deepcopy(ref).to(DEV)
    x = torch.randn(4, 6, 16)
    y = torch.randint(0, 5, (4,))
    cuda = _fake_cuda_op_dtypes(Block, x.shape)
    with _OpDtypes() as record:
        _forward(ref, x, y, "cpu")
    cpu = record.seen
    logits_ref, loss_ref = _step(ref, x, y, "cpu")
    assert logits_ref.dtype == BF16 and loss_ref.dtype == torch.float32

    xd, yd = x.to(DEV), y.to(DEV)
    with counting() as first:
        ours = _xshard_op_dtypes(lambda: _forward(model, xd, yd, "xshard"))
        xshard.sync()
    assert first["cpu_fallbacks"] == {}
    common = set(ours) & set(cuda)
    assert {"addmm", "bmm", "native_layer_norm", "_softmax", "_log_softmax",
            "nll_loss_forward", "gelu", "_to_copy"} <= common
    assert {op: ours[op] for op in common} == {op: cuda[op] for op in common}
    assert ours["addmm"] == {BF16} and ours["_softmax"] == {torch.float32}
    assert cpu["_softmax"] == {BF16}  # CPU autocast does not list softmax; CUDA runs it in fp32

    logits, loss = _step(model, xd, yd, "xshard")
    assert logits.dtype == BF16 and loss.dtype == torch.float32
    tol = dict(rtol=2e-2, atol=2e-2)
    assert_same(logits, logits_ref.detach(), **tol)
    assert_same(loss, loss_ref.detach(), **tol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert_same(p.grad, q.grad, **tol)
    for _ in range(2):  # the first also compiles: this step's graph reads no logits
        with counting() as steady:
            model.zero_grad()
            _step(model, xd, yd, "xshard")
            xshard.sync()
    assert steady["compiles"] == 0 and steady["cpu_fallbacks"] == {}


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_recurrent_layers_under_autocast(kind):
    """The layers run in bfloat16 (as CUDA's cuDNN path does in float16 or bfloat16), gradients
    reach the float32 weights; values within bfloat16 tolerance of float32 eager."""
    torch.manual_seed(1)
    ref = getattr(nn, kind)(4, 8, num_layers=2, bidirectional=True)
    model = copy.deepcopy(ref).to(DEV)
    x = torch.randn(5, 3, 4)
    out_ref, _ = ref(x)
    out_ref.sum().backward()
    with counting() as delta:
        with torch.autocast("xshard", dtype=BF16):
            out, h = model(x.to(DEV))
        out.float().sum().backward()
        xshard.sync()
    assert delta["cpu_fallbacks"] == {}
    assert out.dtype == BF16
    assert_same(out, out_ref.detach().to(BF16), rtol=3e-2, atol=3e-2)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        assert_same(p.grad, q.grad, rtol=5e-2, atol=5e-2)


# -- GradScaler's ops ---------------------------------------------------------------------------


def _grads(dtype, poison):
    torch.manual_seed(3)
    grads = [torch.randn(5, 3).to(dtype), torch.randn(()).to(dtype), torch.randn(7).to(dtype)]
    if poison is not None:
        grads[2][4] = poison
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16, torch.float64])
@pytest.mark.parametrize("poison", [None, float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("found_shape", [(), (1,)])
def test_unscale_matches_eager_on_the_device(dtype, poison, found_shape):
    """``_amp_foreach_non_finite_check_and_unscale_`` (GradScaler.unscale_) runs on the device,
    no CPU fallback (it read every gradient to the host), with eager's values and found_inf."""
    for found in (0.0, 1.0):
        grads = _grads(dtype, poison)
        found_inf, inv = torch.full(found_shape, found), torch.full(found_shape, 1 / 1024)
        ours = [g.to(DEV) for g in grads]
        found_d = found_inf.to(DEV)
        with counting() as delta:
            torch._amp_foreach_non_finite_check_and_unscale_(ours, found_d, inv.to(DEV))
            xshard.sync()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        assert delta["cpu_fallbacks"] == {}
        assert_same(ours, grads, rtol=0, atol=0)
        assert_same(found_d, found_inf, rtol=0, atol=0)


def test_unscale_of_no_gradients_and_its_errors():
    found = torch.zeros((), device=DEV)
    torch._amp_foreach_non_finite_check_and_unscale_([], found, torch.ones((), device=DEV))
    assert found.item() == 0.0
    grads = [torch.ones(2, device=DEV)]
    with pytest.raises(RuntimeError, match="found_inf must be a float tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, torch.zeros((), dtype=torch.float64, device=DEV), torch.ones((), device=DEV))
    with pytest.raises(RuntimeError, match="inv_scale must be a 1-element tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones(2, device=DEV))
    with pytest.raises(NotImplementedError, match="must be floating point"):
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(2, dtype=torch.int64, device=DEV)], found, torch.ones((), device=DEV))


@pytest.mark.parametrize("growth, backoff, scale", [(2.0, 0.5, 1024.0), (1.1, 0.3, 1000.0),
                                                    (2.0, 0.5, 3e38)])
def test_update_scale_matches_eager_on_the_device(growth, backoff, scale):
    """``_amp_update_scale_`` (GradScaler.update): backoff after an overflow, growth after
    ``growth_interval`` good steps (kept when the grown scale overflows: 3e38 * 2), products
    rounded from float64 as ATen's kernel does (1.1, 0.3), and it returns the scale tensor."""
    s, tracker = torch.tensor(scale), torch.tensor(0, dtype=torch.int32)
    s_d, tracker_d = s.to(DEV), tracker.to(DEV)
    for found in [0, 0, 0, 1, 0, 0, 0, 0, float("nan"), 0, 0, 0]:
        found_inf = torch.tensor(float(found))
        with counting() as delta:
            out = torch._amp_update_scale_(s_d, tracker_d, found_inf.to(DEV), growth, backoff, 3)
            xshard.sync()
        torch._amp_update_scale_(s, tracker, found_inf, growth, backoff, 3)
        assert out is s_d and delta["cpu_fallbacks"] == {}
        assert_same(s_d, s, rtol=0, atol=0)
        assert_same(tracker_d, tracker, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="growth_tracker must be an int tensor"):
        torch._amp_update_scale_(s_d, tracker_d.long(), found_inf.to(DEV), 2.0, 0.5, 3)


def test_grad_scaler_loop_matches_eager():
    """A float16 GradScaler loop, with a step whose gradients overflow (skipped, scale backed
    off) and a growth interval reached: parameters and scale equal eager's on the CPU, with no
    CPU fallback (the only host read is GradScaler's own found_inf.item())."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = copy.deepcopy(ref).to(DEV)
    scalers = {"cpu": torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2),
               "xshard": torch.amp.GradScaler("xshard", init_scale=2.0 ** 10, growth_interval=2)}
    opts = {"cpu": torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
            "xshard": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}
    batches = [(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(6)]
    scales = []
    for i, (x, y) in enumerate(batches):
        blow_up = 1e38 if i == 2 else 1.0  # gradients overflow float32 once scaled
        for kind, m in (("cpu", ref), ("xshard", model)):
            dev = "cpu" if kind == "cpu" else DEV
            with counting() as delta:
                loss = F.mse_loss(m(x.to(dev)), y.to(dev)) * blow_up
                scalers[kind].scale(loss).backward()
                scalers[kind].step(opts[kind])
                scalers[kind].update()
                opts[kind].zero_grad()
            assert delta["cpu_fallbacks"] == {}
        assert scalers["xshard"].get_scale() == scalers["cpu"].get_scale(), i
        scales.append(scalers["cpu"].get_scale())
    # grown after two good steps, backed off at the overflow, grown again two steps later
    assert scales == [2.0 ** 10, 2.0 ** 11, 2.0 ** 10, 2.0 ** 10, 2.0 ** 11, 2.0 ** 11]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
