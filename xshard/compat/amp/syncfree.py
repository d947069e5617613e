"""``torch_xla.amp.syncfree``: PyTorch's ``SGD``, ``Adam`` and ``AdamW``.

torch_xla's versions take a ``found_inf`` tensor from its GradScaler so that a step skipped for an
overflow needs no host read. On xshard, ``GradScaler.step`` reads whether gradients overflowed and
calls PyTorch's optimizer only when they did not: the same updates, one small read per step.
"""

from torch.optim import SGD, Adam, AdamW

__all__ = ["SGD", "Adam", "AdamW"]
