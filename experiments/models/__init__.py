"""Reference models as pipeshard layer lists, and the registry `build_model`.

Example:
    >>> from experiments.models import build_model
    >>> spec = build_model({"name": "mlp", "depth": 3, "dim": 16, "width": 8, "in_dim": 4, "classes": 3})
    >>> spec.name
    'mlp-3x16'
"""

from __future__ import annotations

from typing import Any, Callable

from experiments.models.spec import ModelSpec, compose, count_params

__all__ = ["ModelSpec", "build_model", "compose", "count_params", "MODEL_BUILDERS"]


def _gpt(cfg: Any) -> ModelSpec:
    from experiments.models.gpt import build_gpt

    return build_gpt(cfg)


def _mlp(cfg: Any) -> ModelSpec:
    from experiments.models.mlp import build_mlp

    return build_mlp(cfg)


def _hf(cfg: Any) -> ModelSpec:
    from experiments.models.hf_build import build_hf

    return build_hf(cfg)


MODEL_BUILDERS: dict[str, Callable[[Any], ModelSpec]] = {
    "gpt": _gpt,
    "mlp": _mlp,
    "hf": _hf,
    "hf_gpt2": _hf,
    "hf_llama": _hf,
}


def build_model(cfg: Any) -> ModelSpec:
    """Build the model named by `cfg.name` (`gpt`, `mlp`, `hf`, `hf_gpt2`, `hf_llama`) from its config
    group: the typed `experiments.config.ModelConfig`, or a mapping (`model_config` types it)."""
    from experiments.config import model_config

    cfg = model_config(cfg)
    return MODEL_BUILDERS[str(cfg.name)](cfg)
