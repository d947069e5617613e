"""Fixtures for the mesh tests: a fake 8-device, single-host runtime.

xshard.mesh reaches the runtime only through ``_global_device_count`` (and,
for HybridMesh, ``_device_granules``), so the tests patch those and need
neither xshard.core nor JAX set up with 8 devices.
"""

import pytest

import xshard.mesh.global_mesh
import xshard.mesh.hybrid
import xshard.mesh.mesh

NUM_DEVICES = 8


@pytest.fixture(autouse=True)
def fake_runtime(monkeypatch):
    monkeypatch.setattr(xshard.mesh.mesh, "_global_device_count", lambda: NUM_DEVICES)
    monkeypatch.setattr(
        xshard.mesh.hybrid, "_device_granules", lambda: [list(range(NUM_DEVICES))]
    )
    # Each test starts with no global mesh, and leaves none behind.
    monkeypatch.setattr(xshard.mesh.global_mesh, "_global_mesh", None)
