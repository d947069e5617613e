"""The errors a checkpoint raises; each names the key, what the state expects and what was found."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint does not fit the state it is loaded into, or cannot be written or read.

    Raised before anything is written into the state, so a failed load leaves it unchanged.

    Attributes:
        key: the flattened state-dict key at fault (e.g. ``'model.blocks.0.mlp.fc.weight'``), or
            None when the fault is the checkpoint as a whole.
        expected: what the state to load into holds there (shape and dtype, or a type name).
        found: what the checkpoint holds there (None when the key is missing).
    """

    def __init__(self, message: str, *, key: str | None = None, expected=None, found=None):
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.found = found


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint at the path: missing, or a save that did not finish."""
