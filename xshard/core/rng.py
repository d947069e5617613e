"""The device's random stream: a threefry key held as device data and threaded through the graph.

Each random op takes a fresh subkey and advances the stream, both as graph nodes, so a training step
with dropout draws a new mask every step from the same executable (the key is an input, not a
constant). ``torch.manual_seed(s)`` resets the stream, which makes runs reproducible.
"""

from __future__ import annotations

import torch

from xshard.core import ir, runtime

_STATE = {"cell": None, "seed": None}
_KEY_SHAPE = (2,)

NEXT = "xshard.rng_next"
SUBKEY = "xshard.rng_subkey"


def _key_data(seed: int):
    jax = runtime.jax_module()
    from xshard.core import graph

    # PRNGKey takes an int64; torch seeds are any uint64 (torch.initial_seed() often is >= 2**63).
    key = jax.random.key_data(jax.random.PRNGKey(seed & 0x7FFFFFFFFFFFFFFF))
    return jax.device_put(key, graph.default_sharding())


def manual_seed(seed: int) -> None:
    """Resets the device stream to ``seed`` (also called by ``torch.manual_seed``)."""
    from xshard.core.tensor import Cell

    array = _key_data(int(seed))
    node = ir.data_node(array, _KEY_SHAPE, torch.uint32, array.sharding)
    if _STATE["cell"] is None:
        _STATE["cell"] = Cell(node)
    else:
        _STATE["cell"].write(node)
    _STATE["seed"] = int(seed)


def next_key() -> ir.Node:
    """A fresh subkey node for one random op; advances the stream."""
    if _STATE["cell"] is None:
        manual_seed(torch.initial_seed())
    cell = _STATE["cell"]
    key = cell.value
    cell.write(ir.Node(NEXT, (key,), ((ir.Slot(0),), ()), _KEY_SHAPE, torch.uint32))
    return ir.Node(SUBKEY, (key,), ((ir.Slot(0),), ()), _KEY_SHAPE, torch.uint32)


def get_state() -> torch.Tensor:
    """The stream's current key as a CPU ``uint8`` tensor (``torch.xshard.get_rng_state()``)."""
    import numpy as np

    from xshard.core import graph

    if _STATE["cell"] is None:
        manual_seed(torch.initial_seed())
    node = _STATE["cell"].value
    array = node.payload if node.is_data else graph.evaluate([node])[0]
    return torch.from_numpy(np.asarray(array, np.uint32).view(np.uint8).copy())


def set_state(state: torch.Tensor) -> None:
    """Restores a key returned by ``get_state`` (``torch.xshard.set_rng_state(state)``)."""
    import numpy as np

    from xshard.core import graph
    from xshard.core.tensor import Cell

    jax = runtime.jax_module()
    key = np.frombuffer(state.cpu().numpy().astype(np.uint8).tobytes(), np.uint32)
    if key.shape != _KEY_SHAPE:
        raise ValueError(f"an xshard RNG state is {_KEY_SHAPE[0] * 4} bytes (a threefry key), "
                         f"got {state.numel()}; pass a tensor from torch.xshard.get_rng_state().")
    array = jax.device_put(key, graph.default_sharding())
    node = ir.data_node(array, _KEY_SHAPE, torch.uint32, array.sharding)
    if _STATE["cell"] is None:
        _STATE["cell"] = Cell(node)
    else:
        _STATE["cell"].write(node)


def initial_seed() -> int:
    if _STATE["seed"] is None:
        manual_seed(torch.initial_seed())
    return _STATE["seed"]


def _register_rules():
    from xshard.core.lowering import RULES

    jax = runtime.jax_module()

    def split(raw, index):
        key = jax.random.wrap_key_data(raw, impl="threefry2x32")
        return jax.random.key_data(jax.random.split(key)[index])

    RULES[NEXT] = lambda raw: split(raw, 0)
    RULES[SUBKEY] = lambda raw: split(raw, 1)


_register_rules()
