"""`ModelSpec`: what pipeshard needs to know about a model, independent of how it was built.

Example:
    >>> from experiments.models import build_model
    >>> spec = build_model({"name": "gpt", "layers": 2, "dim": 32, "heads": 2, "vocab": 256, "seq_len": 16})
    >>> len(spec.layers), spec.example_input(4).shape
    (4, torch.Size([4, 16]))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from partitioner.meta import meta_device

__all__ = ["ModelSpec", "LayerFactory", "count_params", "compose"]

LayerFactory = Callable[[], nn.Module]


@dataclass
class ModelSpec:
    """A model as pipeshard layers.

    layers: one zero-argument factory per pipeline layer; the engine calls factory i under
        `torch.manual_seed(seed + i)`, so layer i's weights do not depend on the split. Factories
        are picklable (functools.partial of module-level callables) so spawned workers can use them.
    loss_fn: `loss_fn(last_layer_output, target) -> scalar`, the mean over the microbatch.
    example_input / example_target: `f(batch) -> Tensor` with the shapes and dtypes of one batch
        (used by profiling and shape checks; values are deterministic but meaningless).
    ties: pairs `("i.param", "j.param")` of parameters that are one parameter in the model (tied
        input/output embeddings): the first is the source of truth at build time and their
        gradients are summed.
    name: short model name for logs.
    cached_chunk: for generation, a picklable callable taking a list of this model's layers (one
        chunk) and returning an `engine.generate.CachedChunk` (runs them with a KV cache);
        None when the model cannot generate.
    num_params: trainable parameters, counting a tied pair once.
    tokens_per_sample: tokens in one sample (sequence length for language models, 1 otherwise),
        for `tokens_per_s`.
    """

    layers: list[LayerFactory]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    example_input: Callable[[int], torch.Tensor]
    example_target: Callable[[int], torch.Tensor]
    ties: list[tuple[str, str]] = field(default_factory=list)
    name: str = "model"
    num_params: int = 0
    tokens_per_sample: int = 1
    extra: dict[str, Any] = field(default_factory=dict)  # model-specific facts (e.g. vocab)
    cached_chunk: Callable[[list[nn.Module]], Any] | None = None


def count_params(layers: list[LayerFactory], ties: list[tuple[str, str]] = ()) -> int:
    """Count parameters by building every layer on the meta device (no memory, no init cost).

    >>> count_params([lambda: nn.Linear(2, 3)])
    9
    """
    total = 0
    tied_numel = 0
    tied_second = {b for _, b in ties}
    with meta_device():
        for i, factory in enumerate(layers):
            for name, p in factory().named_parameters():
                total += p.numel()
                if f"{i}.{name}" in tied_second:
                    tied_numel += p.numel()
    return total - tied_numel


def compose(layers: list[LayerFactory], seed: int = 0) -> nn.Sequential:
    """Build every layer the way the engine does (`engine.stage.build_layers`), in one module.

    The single-process reference for a pipelined model. Tied parameters are not shared here.

    >>> model = compose([lambda: nn.Linear(2, 2)], seed=0)
    """
    from engine.stage import build_layers

    return nn.Sequential(*build_layers(layers, 0, len(layers), seed))
