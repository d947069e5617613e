"""Every test runs on 8 virtual CPU devices: sharding, partitioning and collectives are real there."""

import os

os.environ.setdefault("XSHARD_CPU_DEVICES", "8")
os.environ.setdefault("PJRT_DEVICE", "CPU")

import xshard  # noqa: E402,F401  (configures JAX before any test imports it)



def pytest_sessionstart(session):
    """Test modules are imported by basename (there is no __init__.py): two modules of one name
    stop collection with an "import file mismatch", so say which ones before that."""
    import collections
    import pathlib

    import pytest
    names = collections.defaultdict(list)
    for path in sorted(pathlib.Path(__file__).parent.rglob("test_*.py")):
        names[path.name].append(str(path.relative_to(pathlib.Path(__file__).parent)))
    clashes = {name: paths for name, paths in names.items() if len(paths) > 1}
    if clashes:
        raise pytest.UsageError(f"test modules share a basename: {clashes}; rename all but one "
                                "(pytest imports test modules by basename)")
