"""``python -m xshard.experiments.memory``."""

import sys

from xshard.experiments.memory.cli import main

sys.exit(main())
