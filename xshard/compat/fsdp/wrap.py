"""``torch_xla.distributed.fsdp.wrap``: the auto-wrap policies (xshard.fsdp's, same signatures)."""

from xshard.fsdp.wrap import (always_wrap_policy, lambda_auto_wrap_policy,  # noqa: F401
                              size_based_auto_wrap_policy, transformer_auto_wrap_policy)


def recursive_wrap(*args, **kwargs):
    raise NotImplementedError("recursive_wrap: pass the policy to XlaFullyShardedDataParallel("
                              "module, auto_wrap_policy=policy), which chooses the units.")


__all__ = ["always_wrap_policy", "lambda_auto_wrap_policy", "size_based_auto_wrap_policy",
           "transformer_auto_wrap_policy", "recursive_wrap"]
