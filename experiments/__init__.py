"""pipeshard experiments: Hydra configuration, reference models, data, W&B tracking, entry points.

Importing this package is light (no hydra, wandb, transformers or DeepSpeed at import time);
the submodules import what they need.

Example:
    >>> from experiments.models import build_model
    >>> from experiments.data import make_dataset
"""

__all__ = ["config", "data", "models", "tracking"]
