"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) as one scan per layer and direction.

Left alone, ``aten::lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` are composite: PyTorch's C++ loop
unrolls the sequence, and for a PrivateUse1 device each step calls the fused CUDA cell kernels
(``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``), so a program grows with the sequence length
(and, before xshard had rules for those kernels, fell back to a CPU kernel that does not exist).
xshard implements these ops at its autograd key instead, as cuDNN does for CUDA: each layer and
direction is one op, ``xshard::rnn_layer``, lowered to a ``jax.lax.scan`` over time, with its own
backward op, ``xshard::rnn_layer_backward`` (a reverse scan); dropout between layers is an ordinary
``torch.dropout`` on the device, drawn from the device's random stream. A program's size then grows
with the number of layers, not with the sequence length. See xshard/core/lowering/rnn.py for the
lowering and [Note: packed sequences in a scan] there.

What is recorded, per module (forward; backward in brackets):

- ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: ``xshard::rnn_layer`` per layer and direction, ``cat`` of
  the two directions, ``dropout`` between layers, ``stack`` of the final states
  [``xshard::rnn_layer_backward`` per layer and direction];
- ``pack_padded_sequence``: ``_pack_padded_sequence`` as slices and a ``cat`` (below);
  ``pad_packed_sequence``: PyTorch's composite (slices and copies);
- ``nn.LSTMCell`` / ``nn.GRUCell``: two ``mm`` and ``_thnn_fused_lstm_cell`` /
  ``_thnn_fused_gru_cell`` [``_thnn_fused_lstm_cell_backward_impl`` /
  ``_thnn_fused_gru_cell_backward``, and ``mm`` for the weights and input];
- ``nn.RNNCell``: ``addmm`` and ``tanh``/``relu`` (PyTorch's composite, no fused kernel).

The layer ops have no derivative of their own: backward of backward (``create_graph=True``) raises,
as cuDNN's RNN does.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from xshard.core import ops
from xshard.core.lowering.rnn import RNN_LAYER, RNN_LAYER_BACKWARD, RNNArgumentError

aten = torch.ops.aten


class _Layer(torch.autograd.Function):
    """One layer, one direction: ``xshard::rnn_layer`` forward, its backward op in backward."""

    @staticmethod
    def forward(ctx, x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, mode, reverse, batch_sizes):
        output, hy, cy, cs = RNN_LAYER(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, mode, reverse,
                                       batch_sizes)
        ctx.save_for_backward(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, output, cs)
        ctx.static = (mode, reverse, batch_sizes)
        if mode == "LSTM":
            return output, hy, cy
        return output, hy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output, grad_hy, grad_cy=None):
        x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, output, cs = ctx.saved_tensors
        mode, reverse, batch_sizes = ctx.static
        grads = RNN_LAYER_BACKWARD(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, output, cs,
                                   grad_output, grad_hy, grad_cy, mode, reverse, batch_sizes)
        dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh, dw_hr = grads
        return (dx, dh0, dc0 if c0 is not None else None, dw_ih, dw_hh,
                db_ih if b_ih is not None else None, db_hh if b_hh is not None else None,
                dw_hr if w_hr is not None else None, None, None, None)


def _layer_params(params, has_biases, num_layers, directions, mode, op_name):
    """The flat parameter list as (w_ih, w_hh, b_ih, b_hh, w_hr) per layer and direction."""
    units = num_layers * directions
    per, rest = divmod(len(params), units) if units else (0, 1)
    allowed = (4, 5) if has_biases else (2, 3)
    if rest or per not in allowed or (per == allowed[1] and mode != "LSTM"):
        raise RNNArgumentError(
            f"{op_name}: got {len(params)} parameter tensors for num_layers={num_layers}, "
            f"bidirectional={directions == 2}, has_biases={has_biases}; expected "
            f"{allowed[0]} per layer and direction ({allowed[1]} for an LSTM with proj_size), "
            f"in nn.{mode.split('_')[0].upper()}'s _flat_weights order.")
    out = []
    for unit in range(units):
        w = list(params[unit * per:(unit + 1) * per])
        w_ih, w_hh = w[0], w[1]
        b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
        w_hr = w[-1] if per == allowed[1] else None
        out.append((w_ih, w_hh, b_ih, b_hh, w_hr))
    return out


def _check(op_name, x, states, weights, batch_sizes):
    for name, t in [("input", x)] + states + weights:
        if t is None:
            continue
        if t.dtype != x.dtype or not t.dtype.is_floating_point:
            raise RNNArgumentError(
                f"{op_name}: {name} has dtype {t.dtype} but input has {x.dtype}; an RNN's "
                f"input, states and weights must share one floating dtype. Cast them with "
                f".to({x.dtype}) (or run under torch.autocast).")
        if t.device != x.device:
            raise RNNArgumentError(
                f"{op_name}: {name} is on {t.device} but input is on {x.device}; move the "
                f"module and its states with .to({str(x.device)!r}).")
    if batch_sizes is not None:
        sizes = list(batch_sizes)
        if not sizes or sizes[-1] < 1 or any(a < b for a, b in zip(sizes, sizes[1:])) or \
                sum(sizes) != x.shape[0]:
            raise RNNArgumentError(
                f"{op_name}: batch_sizes {sizes} must be positive, non-increasing and sum to the "
                f"packed data's length {x.shape[0]}; build packed input with "
                f"torch.nn.utils.rnn.pack_padded_sequence or pack_sequence.")


def _check_shapes(op_name, x, h0, c0, layers, directions, packed, batch_first, batch_sizes):
    """Shapes are checked here, not at the sync that would run a malformed scan."""
    w_ih, w_hh, _, _, w_hr = layers[0]
    hidden = w_hh.shape[1] if w_hr is None else w_hr.shape[1]
    out_features = w_hh.shape[1]
    if packed:
        batch = batch_sizes[0]
    else:
        batch = x.shape[0] if batch_first else x.shape[1]
    want_h = (len(layers), batch, out_features)
    problems = []
    if x.shape[-1] != w_ih.shape[1]:
        problems.append(f"input has {x.shape[-1]} features but params[0] (weight_ih_l0) "
                        f"expects {w_ih.shape[1]}")
    if tuple(h0.shape) != want_h:
        problems.append(f"hx{'[0]' if c0 is not None else ''} has shape {tuple(h0.shape)}, "
                        f"expected {want_h}")
    if c0 is not None and tuple(c0.shape) != (len(layers), batch, hidden):
        problems.append(f"hx[1] has shape {tuple(c0.shape)}, expected "
                        f"{(len(layers), batch, hidden)}")
    for unit, weights in enumerate(layers[directions:], directions):
        if weights[0].shape[1] != out_features * directions:
            problems.append(f"layer {unit // directions}'s weight_ih has "
                            f"{weights[0].shape[1]} input features, expected "
                            f"{out_features * directions}")
            break
    if problems:
        raise RNNArgumentError(f"{op_name}: " + "; ".join(problems) + ".")


def _run(mode, op_name, x, batch_sizes, h0, c0, params, has_biases, num_layers, dropout, train,
         bidirectional, batch_first):
    directions = 2 if bidirectional else 1
    packed = batch_sizes is not None
    want_dim = 2 if packed else 3
    if x.dim() != want_dim:
        raise RNNArgumentError(
            f"{op_name}: input must have {want_dim} dimensions "
            f"({'packed data (sum(batch_sizes), features)' if packed else '(seq, batch, features)'}"
            f"), got shape {tuple(x.shape)}.")
    layers = _layer_params(params, has_biases, num_layers, directions, mode, op_name)
    weights = [(f"params[{i}]", w) for i, unit in enumerate(layers) for w in unit]
    states = [("hx[0]" if c0 is not None else "hx", h0)] + (
        [("hx[1]", c0)] if c0 is not None else [])
    _check(op_name, x, states, weights, batch_sizes)
    _check_shapes(op_name, x, h0, c0, layers, directions, packed, batch_first, batch_sizes)
    if packed:
        batch_sizes = tuple(int(b) for b in batch_sizes)
    elif batch_first:
        x = x.transpose(0, 1)
    layer_input = x
    hys, cys = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            unit = layer * directions + direction
            w_ih, w_hh, b_ih, b_hh, w_hr = layers[unit]
            outs = _Layer.apply(layer_input, h0[unit], None if c0 is None else c0[unit], w_ih,
                                w_hh, b_ih, b_hh, w_hr, mode, direction == 1, batch_sizes)
            outputs.append(outs[0])
            hys.append(outs[1])
            if c0 is not None:
                cys.append(outs[2])
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout, train)
    output = layer_input
    if batch_first and not packed:
        output = output.transpose(0, 1)
    hy = torch.stack(hys)
    return (output, hy, torch.stack(cys)) if c0 is not None else (output, hy)


def _batch_sizes(t: torch.Tensor) -> tuple:
    if t.device.type != "cpu" or t.dim() != 1:
        raise RNNArgumentError(
            f"batch_sizes must be a 1-D CPU tensor (as PackedSequence holds it), got shape "
            f"{tuple(t.shape)} on {t.device}.")
    return tuple(int(v) for v in t.tolist())


def _lstm_input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                batch_first):
    return _run("LSTM", "lstm", input, None, hx[0], hx[1], params, has_biases, num_layers,
                dropout, train, bidirectional, batch_first)


def _lstm_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
               bidirectional):
    return _run("LSTM", "lstm", data, _batch_sizes(batch_sizes), hx[0], hx[1], params,
                has_biases, num_layers, dropout, train, bidirectional, False)


def _single_state(mode, op_name):
    def on_input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                 batch_first):
        return _run(mode, op_name, input, None, hx, None, params, has_biases, num_layers,
                    dropout, train, bidirectional, batch_first)

    def on_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                bidirectional):
        return _run(mode, op_name, data, _batch_sizes(batch_sizes), hx, None, params,
                    has_biases, num_layers, dropout, train, bidirectional, False)

    return on_input, on_data


def _pack_padded_sequence(input, lengths, batch_first):
    """``aten::_pack_padded_sequence`` for device input: the rows of each step still running.

    PyTorch's kernel reads ``lengths`` on the host and concatenates slices of the input; xshard does
    the same with recorded ops (one slice per run of equal batch size), so autograd differentiates
    it and the packed data stays on the device. ``batch_sizes`` is a CPU tensor, as PyTorch makes.
    """
    if lengths.device.type != "cpu" or lengths.dim() != 1 or lengths.dtype != torch.int64:
        raise RNNArgumentError(
            f"'lengths' argument should be a 1D CPU int64 tensor, but got {lengths.dim()}D "
            f"{lengths.device} {lengths.dtype} tensor; pass lengths as a CPU tensor or list.")
    x = input.transpose(0, 1) if batch_first else input
    sizes = lengths.tolist()
    if len(sizes) != x.shape[1]:
        raise RNNArgumentError(
            f"Expected `len(lengths)` to be equal to batch_size, but got {len(sizes)} (batch_size"
            f"={x.shape[1]})")
    if not sizes or sizes[-1] <= 0:
        raise RNNArgumentError(
            "Length of all samples has to be greater than 0, but found an element in 'lengths' "
            "that is <= 0")
    if any(a < b for a, b in zip(sizes, sizes[1:])):
        raise RNNArgumentError(
            f"`lengths` array must be sorted in decreasing order (got {sizes}); pack with "
            f"enforce_sorted=False to have the sequences sorted for you.")
    if sizes[0] > x.shape[0]:
        raise RNNArgumentError(
            f"The longest length {sizes[0]} is longer than the input's {x.shape[0]} steps; "
            f"lengths must not exceed the padded sequence length.")
    steps = []
    batch_sizes = []
    start = 0
    for i in range(len(sizes) - 1, -1, -1):  # shortest first: each run of steps has one size
        end = sizes[i]
        if end > start:
            running = i + 1
            block = x[start:end, :running]
            steps.append(block.reshape((-1,) + tuple(x.shape[2:])))
            batch_sizes += [running] * (end - start)
            start = end
    data = steps[0] if len(steps) == 1 else torch.cat(steps)
    return data, torch.tensor(batch_sizes, dtype=torch.int64)


# PyTorch runs these composites' C++ loop at the autograd key; xshard takes them over there, as
# it does scaled_dot_product_attention (xshard/core/attention.py).
# Under torch.inference_mode the autograd key is skipped and the composites reach xshard's
# recorder, which runs the same definitions (ops.COMPOSITES).
_LIB = torch.library.Library("aten", "IMPL")
_LIB.impl("_pack_padded_sequence", _pack_padded_sequence, "AutogradPrivateUse1")
_OWN = {aten.lstm.input: _lstm_input, aten.lstm.data: _lstm_data}
for _mode, _name in (("GRU", "gru"), ("RNN_TANH", "rnn_tanh"), ("RNN_RELU", "rnn_relu")):
    _OWN[getattr(aten, _name).input], _OWN[getattr(aten, _name).data] = _single_state(_mode,
                                                                                      _name)
for _op, _kernel in _OWN.items():
    _LIB.impl(_op.name().removeprefix("aten::"), _kernel, "AutogradPrivateUse1")
for _op, _kernel in _OWN.items():
    ops.COMPOSITES[id(_op)] = _kernel
