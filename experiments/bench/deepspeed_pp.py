"""DeepSpeed's pipeline engine as a peer: ``PipelineModule`` + ``PipelineEngine.train_batch``.

Same stage boundaries as the others: ``PipelineModule`` only knows the partition methods
``uniform``, ``parameters`` and ``type:<regex>``, so :class:`_FixedPartsPipelineModule`
overrides its ``_partition_layers`` hook to take the spec's ``stage_ranges`` as ``parts``.
Layers are given as :class:`_SeededLayerSpec` (a ``LayerSpec`` that calls the spec's factory
under ``torch.manual_seed(seed + i)``), so each rank builds only its own layers, with the same
weights as every other system.

Training math: fp32, no ZeRO, ``torch.optim.SGD`` as the client optimizer;
``train_micro_batch_size_per_gpu x gradient_accumulation_steps = global batch`` with the
accumulation steps equal to the spec's microbatches, so DeepSpeed's TrainSchedule (1F1B)
runs the same microbatches. Its engine divides each microbatch loss by the accumulation steps
before backward, so the gradient is that of the global-batch mean; ``train_batch`` returns the
mean microbatch loss.

Example::

    from experiments.bench.deepspeed_pp import run_deepspeed
    from experiments.bench.spec import tiny_spec

    run_deepspeed(tiny_spec(stages=2))["step_s"]
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from typing import Any, Callable

import torch
from torch import nn

from engine.stage import build_layers

from experiments.bench.trace import traced
from experiments.bench.measure import launch_fresh, make_row, named_params, timed_loop
from experiments.bench.spec import BenchSpec

__all__ = ["run_deepspeed", "deepspeed_config"]


def deepspeed_config(spec: BenchSpec, batch: int) -> dict[str, Any]:
    """The DeepSpeed config used: fp32, no ZeRO, m microbatches of batch / m, quiet."""
    m = spec.microbatches
    if batch % m:
        raise ValueError(f"global batch {batch} must be a multiple of microbatches {m}")
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch // m,
        "gradient_accumulation_steps": m,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,
    }


def _worker(spec: BenchSpec, return_params: bool) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    class _SeededLayerSpec(LayerSpec):
        def __init__(self, factory: Callable[[], nn.Module], seed: int) -> None:
            # LayerSpec insists on an nn.Module class; a factory + seed is what we have.
            self.typename, self.module_args, self.module_kwargs = nn.Module, (), {}
            self.factory, self.seed, self.global_rank = factory, seed, rank

        def build(self, log: bool = False) -> nn.Module:
            return build_layers([self.factory], 0, 1, self.seed)[0]

    class _FixedPartsPipelineModule(PipelineModule):
        def __init__(self, parts: list[int], **kwargs: Any) -> None:
            object.__setattr__(self, "_fixed_parts", parts)
            super().__init__(**kwargs)

        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(self._fixed_parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    ranges = list(spec.stage_ranges)
    parts = [start for start, _ in ranges] + [ranges[-1][1]]
    layers = [_SeededLayerSpec(f, spec.seed + i) for i, f in enumerate(spec.layers)]
    with contextlib.redirect_stdout(io.StringIO()):  # it prints the partition and seed
        module = _FixedPartsPipelineModule(parts, layers=layers, num_stages=world_size,
                                           loss_fn=spec.loss_fn, partition_method="uniform")
    opt = torch.optim.SGD(module.parameters(), lr=spec.lr)
    batch = int(spec.batches(0)[0].shape[0])
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt,
                                           config=deepspeed_config(spec, batch))
    is_last = rank == world_size - 1
    m = spec.microbatches

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        data = iter(list(zip(inputs.tensor_split(m), targets.tensor_split(m))))
        loss = engine.train_batch(data_iter=data)
        return float(loss) if is_last else None

    result = timed_loop(spec, step)
    if return_params:
        result["params"] = named_params([module])
    return result


def run_deepspeed(spec: BenchSpec, *, return_params: bool = False,
                  timeout_s: float = 900.0) -> dict[str, Any]:
    """One row: ``spec`` trained with DeepSpeed's PipelineEngine (1F1B) on p fresh ranks."""
    p = spec.num_stages
    spec = traced(spec, "deepspeed_1f1b")
    results = launch_fresh(_worker, p, spec, return_params, timeout_s=timeout_s)
    row = make_row("deepspeed", "1f1b", spec, results, stages=p, microbatches=spec.microbatches)
    row["impl"] = "PipelineEngine.TrainSchedule"
    return row
