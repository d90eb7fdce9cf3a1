"""Small reference models for the recipes, demos and model-parallel docs (docs/recipes.md,
examples/gpt.py, docs/model-parallel.md): a nanoGPT-style ``GPT`` (with ``GPT_PLAN``, its
tensor-parallel split, and ``sequential_gpt`` for pipelines) and a ResNet-18-shaped
``resnet18``. Plain ``nn.Module``s; every strategy prepares them as it would a user's model."""

from .gpt import GPT, GPT_PLAN, SEQUENTIAL_PLAN, Block, GPTConfig, param_groups, sequential_gpt
from .resnet import ResNet, resnet18

__all__ = [
    "GPT",
    "GPT_PLAN",
    "SEQUENTIAL_PLAN",
    "Block",
    "GPTConfig",
    "ResNet",
    "param_groups",
    "resnet18",
    "sequential_gpt",
]
