"""The package version, in a leaf module: modules that record it (checkpoints) import this,
not the ``rankwise`` facade, which names every module (an import circle otherwise)."""

__version__ = "0.1.0"
