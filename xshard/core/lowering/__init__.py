"""The lowering table: one rule per aten overload (and per xshard op), turning an IR node into
jax.lax / jax.numpy calls.

A rule is called while JAX traces the graph: tensor arguments arrive as ``jax.Array`` tracers,
dynamic Python scalars as weakly typed 0-d tracers (so they promote like PyTorch's wrapped numbers),
static arguments as the Python values of the call. Random ops get one extra keyword, ``_key``: raw
threefry key data for this op (see xshard.core.rng). A rule returns an array, or a tuple/list for
multi-output ops. The graph driver casts each result to the dtype PyTorch's meta kernel promised
(within its kind: see ``conform``), so rules need not restate PyTorch's type promotion where JAX's
agrees up to the final cast.

Rules are registered with ``@rule(aten.op.overload, ...)`` (an ``OpOverloadPacket`` registers all its
overloads not registered yet, so the order of the modules below matters). One module per op family:

=================  ==============================================================================
module             ops
=================  ==============================================================================
``promotion``      (helpers) PyTorch's type promotion
``elementwise``    unary and binary math, comparisons, clamps, where, casts, copies
``factories``      zeros, ones, full, arange, eye, linspace ...
``random``         random ops (each takes ``_key``)
``views``          view ops as values, and their scatters
``shape``          cat, stack, flip, roll, pad, gather/scatter, indexing, sorting
``reductions``     sums, means, variances, norms, min/max, cumulative ops, top-k, softmax
``linalg``         matmuls and decompositions
``nn``             convolution, pooling, normalisation, losses, embedding, interpolation
``attention``      fused scaled-dot-product attention and its backward
``rnn``            recurrent layers (``xshard::rnn_layer``: a scan per layer) and fused RNN cells
``foreach``        ``_foreach_*`` lists of tensors (torch.optim)
``xshard_ops``     xshard's own ops (shardings, barriers, partial sums, manual regions, RNG keys)
=================  ==============================================================================
"""

from xshard.core.lowering.table import (RULES, LoweringError, apply_rule, conform,  # noqa: F401
                                        has_rule, rule, thaw)
from xshard.core.lowering import (promotion, elementwise, factories, random, views,  # noqa: F401,E402
                                  shape, reductions, linalg, nn, attention, rnn, foreach,
                                  xshard_ops)
