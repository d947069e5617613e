"""The torch_xla import hook: every alias, its scope (only processes started through
``python -m xshard.compat``), an installed torch_xla left alone, and the runner's command line."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from xshard.compat import hook
from tests.multihost.conftest import clean_env


@pytest.fixture
def hooked():
    hook.install()
    try:
        yield
    finally:
        hook.uninstall()


def test_every_alias_is_the_compat_module(hooked):
    assert hook.installed()
    for name, target in hook.ALIASES.items():
        assert importlib.import_module(name) is importlib.import_module(target), name
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl  # noqa: F401
    import torch_xla.distributed.spmd as xs
    import torch_xla.distributed.xla_multiprocessing as xmp  # noqa: F401
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel  # noqa: F401
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy  # noqa: F401
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: F401
        SpmdFullyShardedDataParallel)

    import xshard.spmd
    from xshard.compat import xla_model

    assert xm is xla_model and torch_xla.core.xla_model is xm
    assert torch_xla.runtime is xr and xs.mark_sharding is xshard.spmd.mark_sharding
    assert xs.Mesh is xshard.spmd.Mesh and xs.ShardingSpec is xshard.spmd.ShardingSpec


def test_missing_modules_name_the_replacement(hooked):
    with pytest.raises(ModuleNotFoundError, match="xla_backend is not provided by xshard.compat"
                       ".*xm.optimizer_step"):
        import torch_xla.distributed.xla_backend  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match=r"torch_xla.utils.utils is not provided by "
                       r"xshard.compat: torch_xla's internal helpers"):
        import torch_xla.utils.utils  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match=r"torch_xla.distributed.spmd.api is not "
                       r"provided .*Provided: torch_xla, torch_xla.amp"):
        import torch_xla.distributed.spmd.api  # noqa: F401


def test_modules_under_an_aliased_module(hooked):
    """torch_xla.distributed.spmd stands for a plain module; the modules torch_xla has under it
    are aliases too (they failed with "'torch_xla.distributed.spmd' is not a package")."""
    import torch
    import torch_xla.distributed.spmd as xs
    import torch_xla.distributed.spmd.xla_sharding as xla_sharding
    from torch_xla.amp import syncfree
    from torch_xla.distributed.spmd.debugging import visualize_tensor_sharding
    from torch_xla.utils.checkpoint import checkpoint

    import xshard.spmd

    assert xla_sharding.mark_sharding is xs.mark_sharding is xshard.spmd.mark_sharding
    assert visualize_tensor_sharding is xshard.spmd.visualize_tensor_sharding
    assert checkpoint is torch.utils.checkpoint.checkpoint
    assert syncfree.AdamW is torch.optim.AdamW


def test_autocast_xla_means_xshard(hooked):
    """Under the hook torch.autocast("xla") (torch_xla's documented form) autocasts xshard
    tensors; PyTorch accepts "xla" without torch_xla and left them in float32, silently."""
    import torch
    from torch_xla.amp import GradScaler, autocast

    import xshard

    model = torch.nn.Linear(4, 3).to(xshard.device())
    x = torch.randn(2, 4).to(xshard.device())
    with torch.autocast("xla", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16
    with torch.autocast(device_type="xla", dtype=torch.bfloat16, enabled=False):
        assert model(x).dtype == torch.float32
    with autocast(xshard.device()):
        assert model(x).dtype == torch.bfloat16
    scaler = GradScaler(init_scale=4.0, use_zero_grad=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().cpu()
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0 and not torch.equal(model.weight.detach().cpu(), before)
    hook.uninstall()
    with torch.autocast("xla", dtype=torch.bfloat16):
        assert model(x).dtype == torch.float32  # PyTorch's own again


def test_uninstalled_forgets_the_aliases(hooked):
    import torch_xla  # noqa: F401

    hook.uninstall()
    assert not hook.installed() and "torch_xla" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        import torch_xla  # noqa: F401,F811


FAKE = '''"""a stand-in for an installed torch_xla"""
REAL = True
'''
PROBE = '''import sys
import torch_xla
import xshard.compat
print("PROBE", getattr(torch_xla, "REAL", False), torch_xla.__name__, sys.argv[1:])
'''


def test_scoped_to_the_runner_and_an_installed_torch_xla_is_untouched(tmp_path):
    site = tmp_path / "site"
    (site / "torch_xla").mkdir(parents=True)
    (site / "torch_xla" / "__init__.py").write_text(FAKE)
    (tmp_path / "probe.py").write_text(PROBE)
    env = clean_env()
    # A process of its own: no torch_xla at all (none is installed here)...
    plain = subprocess.run([sys.executable, "probe.py"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and "No module named 'torch_xla'" in plain.stderr
    # ...the installed one when there is one, even after importing xshard.compat...
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    plain = subprocess.run([sys.executable, "probe.py", "a"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert plain.stdout.strip() == "PROBE True torch_xla ['a']", plain.stderr
    # ...and xshard's under the runner (here as -m module; scripts in test_script.py).
    run = subprocess.run([sys.executable, "-m", "xshard.compat", "-m", "probe", "b", "--c"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "PROBE False xshard.compat ['b', '--c']", run.stderr


def test_runner_command_line():
    missing = subprocess.run([sys.executable, "-m", "xshard.compat", "nowhere.py"],
                             env=clean_env(), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "script 'nowhere.py' does not exist" in missing.stderr
