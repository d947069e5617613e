"""Memory scaling studies (the ``xshard-memory`` command): per-device memory of a training step by
strategy, model and device count.

Modules: ``config`` (models, strategies, configurations), ``step`` (one configuration's step, built
and analysed), ``search`` (the cache, sweeps and searches), ``report`` (tables, CSV, plots), ``cli``
(the command; its docstring is the manual).
"""

from xshard.experiments.memory.cli import main, parser  # noqa: F401
from xshard.experiments.memory.config import MODELS, STRATEGIES, Config, UsageError  # noqa: F401

__all__ = ["main", "parser", "Config", "MODELS", "STRATEGIES", "UsageError"]
