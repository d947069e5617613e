"""Configurations of the memory study: models, strategies, meshes and batch sizes, validated."""

from __future__ import annotations

import dataclasses
import json



STRATEGIES = ("dp", "fsdp-transformer", "fsdp-size", "2d", "spatial")
SCHEMA = 1  # bump when the meaning of a cached figure changes

# name: (layers, width, heads, vocab, seq)
GPT_PRESETS = {
    "gpt-tiny": (2, 64, 2, 256, 32),
    "gpt2-small": (12, 768, 12, 50257, 1024),
    "gpt2-medium": (24, 1024, 16, 50257, 1024),
    "gpt2-large": (36, 1280, 20, 50257, 1024),
    "gpt2-xl": (48, 1600, 25, 50257, 1024),
    "gpt-2.7b": (32, 2560, 32, 50304, 2048),
    "gpt-6.7b": (32, 4096, 32, 50304, 2048),
    "gpt-13b": (40, 5120, 40, 50304, 2048),
    "gpt-20b": (44, 6144, 48, 50304, 2048),
    "gpt-30b": (48, 7168, 56, 50304, 2048),
    "gpt-40b": (48, 8192, 64, 50304, 2048),
    "gpt-66b": (64, 9216, 72, 50304, 2048),
    "gpt-100b": (80, 10240, 80, 50304, 2048),
    "gpt-175b": (96, 12288, 96, 50304, 2048),
    "gpt-250b": (100, 14336, 112, 50304, 2048),
    "gpt-350b": (112, 16384, 128, 50304, 2048),
    "gpt-530b": (105, 20480, 128, 50304, 2048),
    "gpt-1t": (128, 25600, 160, 50304, 2048),
}
# name: (depths, widths, image size, classes)
RESNET_PRESETS = {
    "resnet-tiny": ((1, 1), (8, 16), 32, 10),
    "resnet50": ((3, 4, 6, 3), (64, 128, 256, 512), 224, 1000),
}
MODELS = ("gpt", *GPT_PRESETS, *RESNET_PRESETS)


class UsageError(Exception):
    """Bad input to the command: printed as one line, exit code 2."""




@dataclasses.dataclass(frozen=True)
class Config:
    """One training step to analyse. ``key()`` identifies it in the result cache."""

    model: str
    strategy: str
    devices: int
    batch: int
    layers: int = 0
    width: int = 0
    heads: int = 0
    vocab: int = 0
    seq: int = 0
    image: int = 0
    depths: tuple = ()
    widths: tuple = ()
    classes: int = 0
    tp: int = 1
    spatial: tuple = (1, 1)
    min_params: int = 0
    optimizer: str = "adamw"
    checkpoint: bool = False
    run: bool = False

    @property
    def kind(self) -> str:
        return "resnet" if self.image else "gpt"

    def key(self) -> str:
        return json.dumps({"schema": SCHEMA, **dataclasses.asdict(self)}, sort_keys=True)

    def num_params(self) -> int:
        if self.kind == "gpt":
            from xshard.models.gpt import GPTConfig

            return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers,
                             n_head=self.heads, n_embd=self.width).num_params()
        from xshard.models.resnet import ResNetConfig, num_params

        return num_params(ResNetConfig(depths=self.depths, widths=self.widths,
                                       num_classes=self.classes))

    def data_degree(self) -> int:
        """How many ways the batch is split (the batch must be a multiple of it)."""
        if self.strategy == "2d":
            return self.devices // self.tp
        if self.strategy == "spatial":
            return self.devices // (self.spatial[0] * self.spatial[1])
        return self.devices

    def label(self) -> str:
        return f"{self.model}/{self.strategy}/N={self.devices}/B={self.batch}"


def make_config(args, model: str, strategy: str, devices: int, batch: int) -> Config:
    common = dict(model=model, strategy=strategy, devices=devices, batch=batch,
                  optimizer=args.optimizer, checkpoint=args.checkpoint, run=args.run)
    if model in RESNET_PRESETS:
        depths, widths, image, classes = RESNET_PRESETS[model]
        spatial = args.spatial if strategy == "spatial" else (1, 1)
        return Config(**common, image=args.image or image, depths=depths, widths=widths,
                      classes=classes, spatial=spatial,
                      min_params=args.min_params if strategy == "fsdp-size" else 0)
    layers, width, heads, vocab, seq = GPT_PRESETS.get(model, GPT_PRESETS["gpt2-small"])
    return Config(**common, layers=args.layers or layers, width=args.width or width,
                  heads=args.heads or heads, vocab=args.vocab or vocab, seq=args.seq or seq,
                  tp=min(args.tp, devices) if strategy == "2d" else 1,
                  min_params=args.min_params if strategy == "fsdp-size" else 0)


def check_config(cfg: Config) -> str | None:
    """Why ``cfg`` cannot be built (a skip reason), or None."""
    if cfg.strategy == "2d" and cfg.kind != "gpt":
        return "2d (Megatron-style specs) applies to GPT models"
    if cfg.strategy == "spatial" and cfg.kind != "resnet":
        return "spatial partitioning applies to conv nets (resnet models)"
    if cfg.strategy == "2d" and cfg.devices % cfg.tp:
        return f"--tp {cfg.tp} does not divide {cfg.devices} devices"
    if cfg.strategy == "spatial" and cfg.devices % (cfg.spatial[0] * cfg.spatial[1]):
        return f"--spatial {cfg.spatial[0]}x{cfg.spatial[1]} does not divide {cfg.devices} devices"
    if cfg.kind == "gpt" and cfg.width % cfg.heads:
        return f"width {cfg.width} is not divisible by heads {cfg.heads}"
    if cfg.batch % cfg.data_degree():
        return f"batch {cfg.batch} is not a multiple of the data-parallel degree {cfg.data_degree()}"
    return None
