"""Experiments run as commands: ``python -m xshard.experiments.memory`` (memory scaling studies)."""
