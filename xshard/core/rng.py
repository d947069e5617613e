"""The device's random stream: a seed and a counter on the host, folded into a key in the graph.

[Note: the random stream]
Like CUDA's Philox generator (a seed and an offset), the stream's state is two host integers: the
seed and the number of random ops drawn since seeding. Each random op gets a ``RNG_KEY`` node whose
inputs are that seed and that count as scalar graph inputs; its lowering hashes them into a threefry
key. So

- a training step with dropout draws a new mask every step from the same executable (the counter
  is an input, not a constant);
- ``torch.manual_seed(s)`` only sets two integers: it never touches the devices, so seeding is lazy
  and a forked DataLoader worker that seeds itself never calls into JAX;
- ``get_rng_state()`` needs no device read, and restoring it replays the same draws: activation
  checkpointing recomputes with the forward's masks (PyTorch saves and restores the device state
  around the recomputation);
- processes of a multi-process run that agree on the seed agree on every key.
"""

from __future__ import annotations

import struct

import torch

from xshard.core import distributed, ir

_KEY_SHAPE = (2,)
_STATE = {"seed": None, "counter": 0}
MASK = (1 << 64) - 1  # seed and counter are uint64s: the counter wraps


def _ensure_seeded() -> None:
    if _STATE["seed"] is None:
        agreed = distributed.agreed_seed()  # multi-process: process 0's, the same everywhere
        _STATE["seed"] = (torch.initial_seed() if agreed is None else agreed) & MASK
        _STATE["counter"] = 0


def manual_seed(seed: int) -> None:
    """Resets the device stream to ``seed`` (also called by ``torch.manual_seed``)."""
    _STATE["seed"] = int(seed) & MASK
    _STATE["counter"] = 0


def next_key() -> ir.Node:
    """Key data (uint32[2]) for one random op, as a node; advances the stream."""
    _ensure_seeded()
    counter = _STATE["counter"]
    _STATE["counter"] = (counter + 1) & MASK  # a uint64: it wraps
    seed = ir.scalar_node(_STATE["seed"], torch.uint64)
    count = ir.scalar_node(counter, torch.uint64)
    return ir.Node(ir.RNG_KEY, (seed, count), ((ir.slot(0), ir.slot(1)), ()), _KEY_SHAPE,
                   torch.uint32)


def position() -> tuple[int, int]:
    """The stream's state as ``(seed, counter)``: the next random op draws at ``counter``."""
    _ensure_seeded()
    return _STATE["seed"], _STATE["counter"]


def advance(n: int) -> tuple[int, int]:
    """Takes the next ``n`` draws at once (a compiled step's, see xshard.step): returns
    ``(seed, counter)`` before them; the k-th draw is at ``counter + k``."""
    if _STATE["seed"] is None:
        _ensure_seeded()
    counter = _STATE["counter"]
    _STATE["counter"] = (counter + n) & MASK
    return _STATE["seed"], counter


def set_position(seed: int, counter: int) -> None:
    """Sets the stream's state to ``(seed, counter)`` (as ``position`` returns it)."""
    _STATE["seed"], _STATE["counter"] = int(seed) & MASK, int(counter) & MASK


def get_state() -> torch.Tensor:
    """The stream's state as a CPU ``uint8`` tensor of 16 bytes (seed and counter)."""
    _ensure_seeded()
    raw = struct.pack("<QQ", _STATE["seed"], _STATE["counter"] & MASK)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def set_state(state: torch.Tensor) -> None:
    """Restores a state returned by ``get_state``."""
    if not isinstance(state, torch.Tensor) or state.numel() != 16 or state.dtype != torch.uint8:
        raise ValueError(
            f"an xshard RNG state is a uint8 tensor of 16 bytes (seed and counter), got "
            f"{getattr(state, 'dtype', type(state).__name__)} with "
            f"{getattr(state, 'numel', lambda: '?')()} elements; pass a tensor from "
            f"torch.xshard.get_rng_state().")
    seed, counter = struct.unpack("<QQ", bytes(state.cpu().contiguous().tolist()))
    _STATE["seed"], _STATE["counter"] = seed, counter


def initial_seed() -> int:
    _ensure_seeded()
    return _STATE["seed"]
