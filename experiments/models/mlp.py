"""Deep residual MLP with a width profile: layers of unequal cost, for partitioning experiments.

Layers: an input projection `[b, in_dim] -> [b, dim]`, `depth` residual blocks
`x + W2 gelu(W1 ln(x))` whose hidden width follows the profile, and a head (LayerNorm + linear
to `classes` logits). The loss is cross-entropy.

Profiles (hidden width of block i of n, base width w, ratio r):
    uniform    every block w
    ramp       rises linearly from w to r * w
    hourglass  r * w at both ends, w in the middle
An explicit `widths` list overrides the profile.

Example:
    >>> from experiments.config import MLPConfig
    >>> spec = build_mlp(MLPConfig(depth=4, dim=32, width=16, profile="ramp", in_dim=8, classes=4))
    >>> compose(spec.layers)(spec.example_input(2)).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from experiments.models.spec import ModelSpec, compose, count_params

__all__ = ["MLPBlock", "MLPHead", "build_mlp", "width_profile", "classification_loss", "compose"]

PROFILES = ("uniform", "ramp", "hourglass")


def width_profile(depth: int, width: int, profile: str = "uniform", ratio: float = 4.0) -> list[int]:
    """Hidden width of each residual block.

    >>> width_profile(3, 10, "ramp", ratio=3.0)
    [10, 20, 30]
    >>> width_profile(3, 10, "hourglass", ratio=3.0)
    [30, 10, 30]
    """
    profile = str(profile)
    if profile not in PROFILES:
        raise ValueError(f"model.profile={profile!r}; choose one of {PROFILES}")
    if depth < 1:
        raise ValueError(f"model.depth={depth}; it must be at least 1")
    out = []
    for i in range(depth):
        pos = i / (depth - 1) if depth > 1 else 0.0  # 0 at the first block, 1 at the last
        if profile == "uniform":
            scale = 1.0
        elif profile == "ramp":
            scale = 1.0 + (ratio - 1.0) * pos
        else:
            scale = 1.0 + (ratio - 1.0) * abs(2.0 * pos - 1.0)
        out.append(max(1, round(width * scale)))
    return out


class MLPBlock(nn.Module):
    """Residual block `x + W2 gelu(W1 ln(x))` with hidden width `hidden`; `[b, dim] -> [b, dim]`."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.out(F.gelu(self.fc(self.ln(x)))))


class MLPHead(nn.Module):
    """LayerNorm + linear classifier: `[b, dim] -> [b, classes]`."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x))


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy: logits `[b, classes]`, targets `[b]` int64."""
    return F.cross_entropy(logits.float(), targets)


def random_features(batch: int, *, in_dim: int, seed: int = 0) -> torch.Tensor:
    """Deterministic standard-normal features `[batch, in_dim]`."""
    return torch.randn(batch, in_dim, generator=torch.Generator().manual_seed(seed))


def random_labels(batch: int, *, classes: int, seed: int = 1) -> torch.Tensor:
    """Deterministic class labels `[batch]`."""
    return torch.randint(0, classes, (batch,), generator=torch.Generator().manual_seed(seed))


def build_mlp(cfg: Any) -> ModelSpec:
    """Build the residual-MLP layer factories from the typed model group (`experiments.config.MLPConfig`;
    `experiments.models.build_model` types a mapping).

    Fields: depth, dim, width, profile, ratio, widths (optional list), in_dim, classes, dropout.
    """
    dim = int(cfg.dim)
    in_dim = int(cfg.in_dim)
    classes = int(cfg.classes)
    dropout = float(cfg.dropout)
    widths: Sequence[int] | None = cfg.widths
    if widths:
        widths = [int(w) for w in widths]
    else:
        widths = width_profile(
            int(cfg.depth),
            int(cfg.width),
            str(cfg.profile),
            float(cfg.ratio),
        )
    factories = [partial(nn.Linear, in_dim, dim)]
    factories += [partial(MLPBlock, dim, w, dropout) for w in widths]
    factories.append(partial(MLPHead, dim, classes))
    return ModelSpec(
        layers=factories,
        loss_fn=classification_loss,
        example_input=partial(random_features, in_dim=in_dim, seed=0),
        example_target=partial(random_labels, classes=classes, seed=1),
        name=f"mlp-{len(widths)}x{dim}",
        num_params=count_params(factories),
        tokens_per_sample=1,
        extra={"widths": widths, "in_dim": in_dim, "classes": classes},
    )
