"""One configuration's training step, built under ``compile_only()`` and analysed (or run)."""

from __future__ import annotations

import functools
import gc
import time

from xshard.experiments.memory.config import Config


def _mesh(cfg: Config):
    from xshard.mesh import Mesh

    n = cfg.devices
    ids = list(range(n))
    if cfg.strategy == "dp":
        return Mesh(ids, (n,), ("data",))
    if cfg.strategy.startswith("fsdp"):
        return Mesh(ids, (n,), ("fsdp",))
    if cfg.strategy == "2d":
        return Mesh(ids, (n // cfg.tp, cfg.tp), ("data", "model"))
    h, w = cfg.spatial
    return Mesh(ids, (n // (h * w), h, w), ("data", "h", "w"))


def _megatron_spec(name: str, ndim: int) -> tuple:
    """Megatron-style layout of a GPT parameter on a (data, model) mesh."""
    if name == "wte.weight":
        return ("model", None)                      # vocab-parallel embedding (and tied head)
    if name.endswith(("attn.qkv.weight", "mlp.fc.weight")):
        return ("model", None)                      # column parallel
    if name.endswith(("attn.qkv.bias", "mlp.fc.bias")):
        return ("model",)
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        return (None, "model")                      # row parallel
    return (None,) * ndim


def build(cfg: Config):
    """The model, optimizer, batch tensors and a step function for ``cfg`` (on the xshard device)."""
    import torch

    import xshard
    import xshard.spmd as xs
    from xshard.fsdp import FSDP, checkpoint_module, size_based_auto_wrap_policy
    from xshard.fsdp import transformer_auto_wrap_policy

    mesh = _mesh(cfg)
    dev = xshard.device()
    make = torch.device("cpu" if cfg.run else "meta")
    with make:
        if cfg.kind == "gpt":
            from xshard.models.gpt import GPT, Block, GPTConfig

            model = GPT(GPTConfig(vocab_size=cfg.vocab, block_size=cfg.seq, n_layer=cfg.layers,
                                  n_head=cfg.heads, n_embd=cfg.width))
            unit_cls = Block
            units = model.blocks
        else:
            from xshard.models.resnet import Bottleneck, ResNet, ResNetConfig

            model = ResNet(ResNetConfig(depths=cfg.depths, widths=cfg.widths,
                                        num_classes=cfg.classes))
            unit_cls = Bottleneck
            units = model.blocks
    if cfg.checkpoint:
        for block in units:
            checkpoint_module(block)

    def data(shape, dtype, high):
        if cfg.run:
            t = (torch.randint(0, high, shape) if dtype == torch.long else torch.randn(shape))
        else:
            t = torch.empty(shape, dtype=dtype, device="meta")
        return t.to(dev)

    if cfg.kind == "gpt":
        x = data((cfg.batch, cfg.seq), torch.long, cfg.vocab)
        y = data((cfg.batch, cfg.seq), torch.long, cfg.vocab)
        in_specs = [("data" if cfg.strategy in ("dp", "2d") else "fsdp", None)] * 2
    else:
        x = data((cfg.batch, 3, cfg.image, cfg.image), torch.float32, 0)
        y = data((cfg.batch,), torch.long, cfg.classes)
        batch_axis = "fsdp" if cfg.strategy.startswith("fsdp") else "data"
        x_spec = ((batch_axis, None, "h", "w") if cfg.strategy == "spatial"
                  else (batch_axis, None, None, None))
        in_specs = [x_spec, (batch_axis,)]
    for t, spec in zip((x, y), in_specs):
        xs.mark_sharding(t, mesh, spec)

    if cfg.strategy.startswith("fsdp"):
        if cfg.strategy == "fsdp-transformer":
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={unit_cls})
        else:
            policy = functools.partial(size_based_auto_wrap_policy, min_num_params=cfg.min_params)
        model = FSDP(model, mesh=mesh, auto_wrap_policy=policy)
        for b in model.buffers():       # FSDP leaves buffers unannotated: pin them to the mesh
            xs.mark_sharding(b, mesh, (None,) * b.dim())
    else:
        model = model.to(dev)
        for name, p in model.named_parameters():
            spec = _megatron_spec(name, p.dim()) if cfg.strategy == "2d" else (None,) * p.dim()
            xs.mark_sharding(p, mesh, spec)
        for b in model.buffers():
            xs.mark_sharding(b, mesh, (None,) * b.dim())

    params = list(model.parameters())
    if cfg.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4)
    else:
        opt = torch.optim.SGD(params, lr=1e-2)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()

    return model, opt, [x, y], step


def analyse(cfg: Config) -> dict:
    """The figures of one configuration: compiled (compile-only) or measured (``cfg.run``)."""
    import xshard
    from xshard import memory

    start = time.perf_counter()
    try:
        if cfg.run:
            model, opt, inputs, step = build(cfg)
            step()
            xshard.sync(wait=True)
            step()
            m = memory.analyze_step(model.parameters(), opt, inputs)
            xshard.sync(wait=True)
            r = memory.measure_step(step, n=2, warmup=1)
            out = m.as_dict()
            out.update(estimate="measured", step_seconds=r.seconds,
                       live_bytes=r.max_live_bytes)
        else:
            with xshard.compile_only():
                model, opt, inputs, step = build(cfg)
                step()
                memory.abstract_sync()       # the state a first step leaves: steady-state figures
                step()
                m = memory.analyze_step(model.parameters(), opt, inputs)
                out = m.as_dict()
                out.update(estimate="compiled")
    finally:
        model = opt = inputs = step = None  # noqa: F841  (drop every tensor of this config)
        gc.collect()
    out["params"] = cfg.num_params()
    out["wall_seconds"] = time.perf_counter() - start
    return out


LINEAR_FIGURES = ("argument_bytes", "parameter_bytes", "optimizer_bytes", "input_bytes",
           "other_argument_bytes", "output_bytes", "gradient_bytes", "temp_bytes", "alias_bytes",
           "peak_bytes", "xla_peak_bytes", "flops", "state_bytes")
