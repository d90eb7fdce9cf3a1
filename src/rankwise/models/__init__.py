"""Small reference models for the recipes and demos (docs/recipes.md, examples/gpt.py):
a nanoGPT-style ``GPT`` and a ResNet-18-shaped ``resnet18``. Plain ``nn.Module``s that know
nothing of rankwise; every strategy prepares them as it would a user's model."""

from .gpt import GPT, Block, GPTConfig, param_groups
from .resnet import ResNet, resnet18

__all__ = ["GPT", "Block", "GPTConfig", "ResNet", "param_groups", "resnet18"]
