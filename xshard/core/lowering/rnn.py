"""Lowering rules of the recurrent ops: one ``jax.lax.scan`` per layer and direction, and the fused
cells that ``nn.LSTMCell`` / ``nn.GRUCell`` call on a PrivateUse1 device.

The layer ops, ``xshard::rnn_layer`` and its backward, are defined here with their shapes (Meta
kernels); xshard/core/rnn.py calls them from ``nn.LSTM``/``GRU``/``RNN``.

Forward of one layer: the input projection of every step is one matmul over the whole sequence;
the scan carries the state and does only the recurrent matmul and the cell. Backward needs no
per-step residuals beyond the layer's output (and, for an LSTM, its cell states): the state before
each step is the output of the step before (or the initial state), so both gate pre-activations
are recomputed for all steps at once with two matmuls; a reverse scan carries the state gradients
through the cell (``jax.vjp`` of the cell's elementwise part) and the recurrent matmul; the weight
gradients are then one matmul each over the whole sequence.

[Note: packed sequences in a scan]
A PackedSequence holds, for steps ``t = 0..T-1``, rows of the ``batch_sizes[t]`` sequences still
running (sorted by length), one after another. ``batch_sizes`` is static (a program per packing, as
the packed length is a shape anyway), so packing and padding are gathers with constant indices:
``pad`` lays the rows out as (T, B, features) with zeros where a sequence has ended, ``pack`` takes
them back. The scan runs over all T steps with a mask: where a sequence is not running, its state
is carried unchanged. That gives both directions exactly: forward, a finished sequence's state
stays its last one (which is ``h_n``); in reverse, a sequence's state stays the initial one until
the scan reaches its last step, where it starts. In backward the mask passes the state gradients
through the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.linalg import _mm_precision
from xshard.core.lowering.table import rule

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

aten = torch.ops.aten


class RNNArgumentError(ValueError):
    pass


# -- the layer ops -------------------------------------------------------------------------------

MODES = ("LSTM", "GRU", "RNN_TANH", "RNN_RELU")
GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}

_DEF = torch.library.Library("xshard", "FRAGMENT")
_DEF.define(
    "rnn_layer(Tensor input, Tensor h0, Tensor? c0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, "
    "Tensor? b_hh, Tensor? w_hr, str mode, bool reverse, int[]? batch_sizes) "
    "-> (Tensor output, Tensor hy, Tensor cy, Tensor cs)")
_DEF.define(
    "rnn_layer_backward(Tensor input, Tensor h0, Tensor? c0, Tensor w_ih, Tensor w_hh, "
    "Tensor? b_ih, Tensor? b_hh, Tensor? w_hr, Tensor output, Tensor cs, Tensor grad_output, "
    "Tensor grad_hy, Tensor? grad_cy, str mode, bool reverse, int[]? batch_sizes) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")

RNN_LAYER = torch.ops.xshard.rnn_layer.default
RNN_LAYER_BACKWARD = torch.ops.xshard.rnn_layer_backward.default


def _sizes(x, w_hh, w_hr, mode, batch_sizes):
    """(steps, batch, hidden, output features) of one layer call."""
    hidden = w_hh.shape[0] // GATES[mode]
    out_features = hidden if w_hr is None else w_hr.shape[0]
    if batch_sizes is None:
        return x.shape[0], x.shape[1], hidden, out_features
    return len(batch_sizes), batch_sizes[0], hidden, out_features


def _rnn_layer_meta(input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, mode, reverse, batch_sizes):
    steps, batch, hidden, out_features = _sizes(input, w_hh, w_hr, mode, batch_sizes)
    lead = (input.shape[0],) if batch_sizes is not None else (steps, batch)
    output = input.new_empty(lead + (out_features,))
    hy = input.new_empty((batch, out_features))
    if mode == "LSTM":
        return output, hy, input.new_empty((batch, hidden)), input.new_empty(lead + (hidden,))
    return output, hy, input.new_empty((0,)), input.new_empty((0,))


def _rnn_layer_backward_meta(input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, output, cs,
                             grad_output, grad_hy, grad_cy, mode, reverse, batch_sizes):
    def like(t):
        return input.new_empty((0,)) if t is None else input.new_empty(t.shape)

    return (input.new_empty(input.shape), h0.new_empty(h0.shape), like(c0), like(w_ih),
            like(w_hh), like(b_ih), like(b_hh), like(w_hr))


_DEF.impl("rnn_layer", _rnn_layer_meta, "Meta")
_DEF.impl("rnn_layer_backward", _rnn_layer_backward_meta, "Meta")


# -- the fused cells' shapes: PyTorch has meta kernels for the LSTM cell only ---------------------


def _gru_cell_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_gates.dim() != 2 or input_gates.shape != hidden_gates.shape or hx.dim() != 2 or \
            input_gates.shape[1] != 3 * hx.shape[1] or input_gates.shape[0] != hx.shape[0]:
        raise RNNArgumentError(
            f"_thnn_fused_gru_cell: gates must be (batch, 3 * hidden) and hx (batch, hidden); "
            f"got input_gates {tuple(input_gates.shape)}, hidden_gates "
            f"{tuple(hidden_gates.shape)}, hx {tuple(hx.shape)}.")
    batch, hidden = hx.shape
    return hx.new_empty((batch, hidden)), hx.new_empty((batch, 5 * hidden))


def _gru_cell_backward_meta(grad_hy, workspace, has_bias):
    batch, hidden = grad_hy.shape
    gates = grad_hy.new_empty((batch, 3 * hidden))
    bias = grad_hy.new_empty((3 * hidden,)) if has_bias else None
    return gates, grad_hy.new_empty((batch, 3 * hidden)), grad_hy.new_empty((batch, hidden)), \
        bias, bias if bias is None else grad_hy.new_empty((3 * hidden,))


def _lstm_cell_meta(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    if input_gates.dim() != 2 or input_gates.shape != hidden_gates.shape or cx.dim() != 2 or \
            input_gates.shape[1] != 4 * cx.shape[1] or input_gates.shape[0] != cx.shape[0]:
        raise RNNArgumentError(
            f"_thnn_fused_lstm_cell: gates must be (batch, 4 * hidden) and cx (batch, hidden); "
            f"got input_gates {tuple(input_gates.shape)}, hidden_gates "
            f"{tuple(hidden_gates.shape)}, cx {tuple(cx.shape)}.")
    return cx.new_empty(cx.shape), cx.new_empty(cx.shape), input_gates.new_empty(
        input_gates.shape)


def _lstm_cell_meta_takes_no_bias() -> bool:
    """Whether PyTorch's own meta kernel accepts ``nn.LSTMCell(bias=False)``'s call (in 2.13 it
    reads ``.device`` of the missing biases)."""
    gates = torch.empty(1, 4, device="meta")
    try:
        aten._thnn_fused_lstm_cell.default(gates, gates, torch.empty(1, 1, device="meta"))
    except AttributeError:
        return False
    return True


_META = torch.library.Library("aten", "IMPL")
for _op, _meta in (("_thnn_fused_gru_cell", _gru_cell_meta),
                   ("_thnn_fused_gru_cell_backward", _gru_cell_backward_meta)):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_op}", "Meta"):
        _META.impl(_op, _meta, "Meta")
if not _lstm_cell_meta_takes_no_bias():
    _META.impl("_thnn_fused_lstm_cell", _lstm_cell_meta, "Meta")


# -- lowering --------------------------------------------------------------------------------------


def _linear(x, w, b=None):
    y = jnp.einsum("...i,gi->...g", x, w, precision=_mm_precision())
    return y if b is None else y + b


def _matmul(a, b):
    return jnp.matmul(a, b, precision=_mm_precision())


# -- cells: (input gates, hidden gates, previous h, previous c) -> (new h before projection, new c)


def _lstm_cell(gi, gh, h, c):
    i, f, g, o = jnp.split(gi + gh, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def _gru_cell(gi, gh, h, c):
    i_r, i_z, i_n = jnp.split(gi, 3, axis=-1)
    h_r, h_z, h_n = jnp.split(gh, 3, axis=-1)
    r = jax.nn.sigmoid(i_r + h_r)
    z = jax.nn.sigmoid(i_z + h_z)
    n = jnp.tanh(i_n + r * h_n)
    return (h - n) * z + n, c


def _tanh_cell(gi, gh, h, c):
    return jnp.tanh(gi + gh), c


def _relu_cell(gi, gh, h, c):
    return jnp.maximum(gi + gh, jnp.zeros((), gi.dtype)), c


_CELLS = {"LSTM": _lstm_cell, "GRU": _gru_cell, "RNN_TANH": _tanh_cell, "RNN_RELU": _relu_cell}


# -- packed layout (see [Note: packed sequences in a scan]) ----------------------------------------


class _Packing:
    def __init__(self, batch_sizes):
        sizes = np.asarray(batch_sizes, dtype=np.int64)
        steps, batch = len(sizes), int(sizes[0])
        rows = int(sizes.sum())
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        b = np.arange(batch)
        self.mask = b[None, :] < sizes[:, None]                              # (T, B)
        self.rows = np.where(self.mask, offsets[:, None] + b[None, :], rows)  # (T, B) -> row
        self.positions = np.flatnonzero(self.mask.reshape(-1))               # (N,) in packed order
        self.shape = (steps, batch)

    def pad(self, x):
        """(N, F) packed rows -> (T, B, F), zeros where a sequence has ended."""
        x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])
        return x[self.rows]

    def pack(self, x):
        """(T, B, F) -> (N, F)."""
        return x.reshape((-1,) + x.shape[2:])[self.positions]


def _keep(mask, new, old):
    return new if mask is None else jnp.where(mask, new, old)


@rule(RNN_LAYER)
def _rnn_layer(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, mode, reverse, batch_sizes):
    lstm = mode == "LSTM"
    cell = _CELLS[mode]
    packing = None if batch_sizes is None else _Packing(batch_sizes)
    gi = _linear(x, w_ih, b_ih)  # every step's input projection, one matmul
    mask = None
    if packing is not None:
        gi = packing.pad(gi)
        mask = jnp.asarray(packing.mask)[..., None]
    dummy = jnp.zeros((), x.dtype)

    def step(carry, inputs):
        h, c = carry
        gi_t, m_t = inputs
        u, c_new = cell(gi_t, _linear(h, w_hh, b_hh), h, c)
        h_new = u if w_hr is None else _linear(u, w_hr)
        h_new = _keep(m_t, h_new, h)
        if lstm:
            c_new = _keep(m_t, c_new, c)
        return (h_new, c_new), (h_new, c_new if lstm else None)

    (hy, cy), (hs, cs) = lax.scan(step, (h0, c0 if lstm else dummy), (gi, mask), reverse=reverse)
    if packing is not None:
        hs = packing.pack(hs)
        cs = packing.pack(cs) if lstm else None
    if not lstm:
        empty = jnp.zeros((0,), x.dtype)
        return hs, hy, empty, empty
    return hs, hy, cy, cs


def _previous(seq, init, valid, reverse):
    """The state before each step: the step before's (in scan order), else the initial state."""
    init = init[None]
    if reverse:
        shifted = jnp.concatenate([seq[1:], init])
        before = None if valid is None else jnp.concatenate(
            [valid[1:], jnp.zeros_like(valid[:1])])
    else:
        shifted = jnp.concatenate([init, seq[:-1]])
        before = None if valid is None else jnp.concatenate(
            [jnp.zeros_like(valid[:1]), valid[:-1]])
    return shifted if before is None else jnp.where(before, shifted, init)


@rule(RNN_LAYER_BACKWARD)
def _rnn_layer_backward(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, output, cs, grad_output,
                        grad_hy, grad_cy, mode, reverse, batch_sizes):
    lstm = mode == "LSTM"
    cell = _CELLS[mode]
    packing = None if batch_sizes is None else _Packing(batch_sizes)
    mask = None
    if packing is not None:
        x, output, grad_output = packing.pad(x), packing.pad(output), packing.pad(grad_output)
        cs = packing.pad(cs) if lstm else cs
        mask = jnp.asarray(packing.mask)[..., None]
    dummy = jnp.zeros((), x.dtype)
    h_prev = _previous(output, h0, mask, reverse)
    c_prev = _previous(cs, c0, mask, reverse) if lstm else None
    gi = _linear(x, w_ih, b_ih)
    gh = _linear(h_prev, w_hh, b_hh)

    def step(carry, inputs):
        dh, dc = carry
        gi_t, gh_t, hp_t, cp_t, dy_t, m_t = inputs
        dh = dh + dy_t
        (u, _), cell_vjp = jax.vjp(cell, gi_t, gh_t, hp_t, cp_t if lstm else dummy)
        du = dh if w_hr is None else _matmul(dh, w_hr)
        dgi, dgh, dhp, dcp = cell_vjp((du, dc))
        dhp = dhp + _matmul(dgh, w_hh)
        if m_t is not None:
            zero = jnp.zeros((), dgi.dtype)
            dgi, dgh = jnp.where(m_t, dgi, zero), jnp.where(m_t, dgh, zero)
            dhp = jnp.where(m_t, dhp, dh)
            if lstm:
                dcp = jnp.where(m_t, dcp, dc)
            dh = jnp.where(m_t, dh, jnp.zeros((), dh.dtype))
        extra = (dh, u) if w_hr is not None else (None, None)
        return (dhp, dcp if lstm else dc), (dgi, dgh) + extra

    carry0 = (grad_hy, grad_cy if lstm else dummy)
    inputs = (gi, gh, h_prev, c_prev, grad_output, mask)
    (dh0, dc0), (dgi, dgh, dhs, us) = lax.scan(step, carry0, inputs, reverse=not reverse)
    dx = _matmul(dgi, w_ih)
    if packing is not None:
        dx = packing.pack(dx)
    empty = jnp.zeros((0,), x.dtype)
    dw_ih = jnp.einsum("tbg,tbi->gi", dgi, x, precision=_mm_precision())
    dw_hh = jnp.einsum("tbg,tbh->gh", dgh, h_prev, precision=_mm_precision())
    db_ih = empty if b_ih is None else dgi.sum((0, 1))
    db_hh = empty if b_hh is None else dgh.sum((0, 1))
    dw_hr = empty if w_hr is None else jnp.einsum("tbo,tbh->oh", dhs, us,
                                                   precision=_mm_precision())
    return dx, dh0, dc0 if lstm else empty, dw_ih, dw_hh, db_ih, db_hh, dw_hr


# -- the fused cells (nn.LSTMCell, nn.GRUCell) --------------------------------------------------
# The workspace a forward hands its backward is private to the pair: xshard keeps the
# pre-activation values and differentiates the cell with jax.vjp.


def _with_biases(ig, hg, ib, hb):
    if ib is not None:
        ig = ig + ib
    if hb is not None:
        hg = hg + hb
    return ig, hg


@rule(aten._thnn_fused_lstm_cell.default)
def _fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    ig, hg = _with_biases(input_gates, hidden_gates, input_bias, hidden_bias)
    gates = ig + hg
    hy, cy = _lstm_cell(gates, jnp.zeros((), gates.dtype), None, cx)
    return hy, cy, gates


@rule(aten._thnn_fused_lstm_cell_backward_impl.default)
def _fused_lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    if grad_hy is None and grad_cy is None:
        return None, None, None
    zero = jnp.zeros((), workspace.dtype)
    (hy, _), cell_vjp = jax.vjp(lambda g, c: _lstm_cell(g, zero, None, c), workspace, cx)
    grad_hy = jnp.zeros_like(hy) if grad_hy is None else grad_hy
    grad_cy = jnp.zeros_like(cx) if grad_cy is None else grad_cy
    grad_gates, grad_cx = cell_vjp((grad_hy, grad_cy))
    return grad_gates, grad_cx, grad_gates.sum(0) if has_bias else None


def _gru_from_workspace(r, z, i_n, h_n, hx):
    n = jnp.tanh(i_n + jax.nn.sigmoid(r) * h_n)
    return (hx - n) * jax.nn.sigmoid(z) + n


@rule(aten._thnn_fused_gru_cell.default)
def _fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ig, hg = _with_biases(input_gates, hidden_gates, input_bias, hidden_bias)
    i_r, i_z, i_n = jnp.split(ig, 3, axis=-1)
    h_r, h_z, h_n = jnp.split(hg, 3, axis=-1)
    # workspace (batch, 5 * hidden): r and z pre-activations, both halves of n, and hx.
    parts = (i_r + h_r, i_z + h_z, i_n, h_n, hx)
    return _gru_from_workspace(*parts), jnp.concatenate(parts, axis=-1)


@rule(aten._thnn_fused_gru_cell_backward.default)
def _fused_gru_cell_backward(grad_hy, workspace, has_bias):
    parts = jnp.split(workspace, 5, axis=-1)
    _, cell_vjp = jax.vjp(_gru_from_workspace, *parts)
    d_r, d_z, d_in, d_hn, d_hx = cell_vjp(grad_hy)
    grad_input = jnp.concatenate([d_r, d_z, d_in], axis=-1)
    grad_hidden = jnp.concatenate([d_r, d_z, d_hn], axis=-1)
    if not has_bias:
        return grad_input, grad_hidden, d_hx, None, None
    return grad_input, grad_hidden, d_hx, grad_input.sum(0), grad_hidden.sum(0)
