"""What every benchmark runner is given: the model, the loss, the data and the pipeline layout.

A :class:`BenchSpec` is pickled into each worker process, so its callables must be picklable
(module-level functions and classes, ``functools.partial`` of them; not lambdas). Every system
builds layer ``i`` as the engine does (``engine.stage.build_layers``: under
``torch.manual_seed(seed + i)``), so all of them start from the same weights whatever the
split, and the same batches come from ``batches(step)``.

Example::

    from experiments.bench.spec import tiny_spec

    spec = tiny_spec(layers=8, width=64, batch=32, stages=2, microbatches=4)
    inputs, targets = spec.batches(0)        # the global batch of step 0
    spec.stage_ranges                        # ((0, 4), (4, 8))
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = ["BenchSpec", "ResidualMLPBlock", "RegressionBatches", "mse_loss", "uniform_ranges",
           "tiny_spec", "build_chunk"]

Range = tuple[int, int]


@dataclass(frozen=True)
class BenchSpec:
    """One benchmark problem, identical for every system.

    - ``layers``: one zero-argument factory per layer, returning an ``nn.Module``.
    - ``loss_fn(output, target)``: scalar mean over the (micro)batch.
    - ``batches(step) -> (inputs, targets)``: the global batch of a step, deterministic.
    - ``stage_ranges``: half-open global layer ranges, one per pipeline rank (p of them).
    - ``chunk_ranges``: for schedules with 2 chunks per rank (interleaved, zero-bubble V):
      2p ranges in chunk order; ``None`` splits the layers uniformly into 2p chunks.
    - ``steps`` timed steps after ``warmup`` untimed ones; SGD with ``lr``.
    """

    layers: Sequence[Callable[[], nn.Module]]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    batches: Callable[[int], tuple[Tensor, Tensor]]
    stage_ranges: Sequence[Range]
    microbatches: int
    steps: int = 5
    warmup: int = 2
    seed: int = 0
    lr: float = 1e-3
    chunk_ranges: Sequence[Range] | None = None
    name: str = "model"
    trace_dir: str | None = None   # set: each rank writes a torch.profiler trace of its timed steps here

    def __post_init__(self) -> None:
        check_ranges(self.stage_ranges, len(self.layers), "stage_ranges")
        if self.chunk_ranges is not None:
            check_ranges(self.chunk_ranges, len(self.layers), "chunk_ranges")
        if self.microbatches < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError("need microbatches >= 1, steps >= 1 and warmup >= 0; got "
                             f"{self.microbatches}, {self.steps}, {self.warmup}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranges)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def ranges_for(self, virtual_stages: int) -> list[Range]:
        """The chunk ranges for ``virtual_stages`` chunks per rank (1: ``stage_ranges``)."""
        if virtual_stages == 1:
            return list(self.stage_ranges)
        n = self.num_stages * virtual_stages
        if self.chunk_ranges is not None and len(self.chunk_ranges) == n:
            return list(self.chunk_ranges)
        return uniform_ranges(self.num_layers, n)


def check_ranges(ranges: Sequence[Range], num_layers: int, what: str) -> None:
    """Raise unless ``ranges`` are non-empty, contiguous and cover ``range(num_layers)``."""
    pos = 0
    for start, stop in ranges:
        if start != pos or stop <= start:
            raise ValueError(f"{what} must be non-empty contiguous half-open ranges covering "
                             f"0..{num_layers}; got {list(ranges)}")
        pos = stop
    if pos != num_layers:
        raise ValueError(f"{what} cover 0..{pos} but the model has {num_layers} layers: {list(ranges)}")


def uniform_ranges(num_layers: int, parts: int) -> list[Range]:
    """Equal layer counts, the first ranges one more: the partitioner's ``uniform`` method."""
    from partitioner.solve import Infeasible, uniform_split

    if parts < 1:
        raise ValueError(f"cannot split {num_layers} layers into {parts} non-empty parts")
    try:
        return uniform_split(num_layers, parts)
    except Infeasible as err:
        raise ValueError(f"cannot split {num_layers} layers into {parts} non-empty parts: {err}") from None


def build_chunk(spec: BenchSpec, start: int, stop: int) -> nn.Sequential:
    """Layers ``start..stop-1`` built as the engine builds them, named by global index (``"5.fc1.weight"``)."""
    from engine.stage import build_layers

    layers = build_layers(spec.layers, start, stop, spec.seed)
    return nn.Sequential(OrderedDict((str(start + j), m) for j, m in enumerate(layers)))


class ResidualMLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(layer_norm(x))))``: the tiny built-in layer."""

    def __init__(self, width: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or width
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def mse_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error (mean over all elements)."""
    return torch.nn.functional.mse_loss(output, target)


class RegressionBatches:
    """Random ``(inputs, targets)`` of shape ``(batch, width)``, a fixed pair per step."""

    def __init__(self, batch: int, width: int, seed: int = 0) -> None:
        self.batch, self.width, self.seed = batch, width, seed

    def __call__(self, step: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(self.batch, self.width, generator=g)
        return x, torch.randn(self.batch, self.width, generator=g)


def tiny_spec(*, layers: int = 8, width: int = 64, batch: int = 32, stages: int = 2,
              microbatches: int = 4, steps: int = 3, warmup: int = 1, seed: int = 0,
              lr: float = 0.1) -> BenchSpec:
    """A residual-MLP problem split uniformly; used by the tests and quick runs."""
    if batch % microbatches:
        raise ValueError(f"batch {batch} must be a multiple of microbatches {microbatches}")
    return BenchSpec(
        layers=[functools.partial(ResidualMLPBlock, width)] * layers,
        loss_fn=mse_loss,
        batches=RegressionBatches(batch, width, seed),
        stage_ranges=tuple(uniform_ranges(layers, stages)),
        microbatches=microbatches, steps=steps, warmup=warmup, seed=seed, lr=lr,
        name=f"residual-mlp L{layers} w{width}",
    )
