"""Shared by the multi-process test scripts: start-up and the one JSON line each process prints."""

import json
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")

import xshard  # noqa: E402


def start():
    """Joins the run (a no-op in one process); returns (rank, world)."""
    xshard.initialize()
    return xshard.process_index(), xshard.process_count()


def report(**values):
    """Prints this process's results as one line the test reads: ``RESULT {json}``."""
    sys.stdout.write("RESULT " + json.dumps(values) + "\n")
    sys.stdout.flush()
