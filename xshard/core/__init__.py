"""The lazy core: device, tensor, tracing, IR, lowering, graph execution (see DESIGN.md)."""

from xshard.core import runtime  # noqa: F401  (configures JAX before anything imports it)
