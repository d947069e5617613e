"""Every test runs on 8 virtual CPU devices: sharding, partitioning and collectives are real there."""

import os

os.environ.setdefault("XSHARD_CPU_DEVICES", "8")
os.environ.setdefault("PJRT_DEVICE", "CPU")

import xshard  # noqa: E402,F401  (configures JAX before any test imports it)
