"""Reference models used by the examples, tests, benchmarks and memory experiments."""

from xshard.models.gpt import GPT, Block, GPTConfig  # noqa: F401
from xshard.models.resnet import Bottleneck, ResNet, ResNetConfig  # noqa: F401
