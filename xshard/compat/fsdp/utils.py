"""``torch_xla.distributed.fsdp.utils``: activation checkpointing of a module."""

from xshard.fsdp import checkpoint_module  # noqa: F401


def apply_xla_patch_to_nn_linear(module, *args, **kwargs):
    """torch_xla's workaround for nn.Linear's backward under its FSDP; not needed here: returns
    ``module`` unchanged."""
    return module


__all__ = ["checkpoint_module", "apply_xla_patch_to_nn_linear"]
