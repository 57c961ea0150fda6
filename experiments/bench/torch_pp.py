"""torch.distributed.pipelining as a peer: manual ``PipelineStage`` per rank, its own schedules.

Each rank builds only its chunk(s) (``nn.Sequential`` of the spec's layers, seeded by global
index), wraps each in a ``PipelineStage`` (shapes inferred at the first step, which is a warm-up
step) and drives the torch schedule with ``step(inputs, target=..., losses=...,
return_outputs=False)`` followed by ``torch.optim.SGD.step()``.

Training math: the schedule's ``loss_fn`` is the spec's microbatch-mean loss, and torch's
default ``scale_grads=True`` divides the accumulated gradients by ``n_microbatches`` after the
backward passes, so the gradient is that of the global-batch mean loss, the same as the
single-process reference and DeepSpeed (which divides by gradient-accumulation steps). The
reported loss is the mean of the per-microbatch losses.

Schedules (``TORCH_SCHEDULES``; the name is the row's ``schedule``):
``gpipe`` (ScheduleGPipe), ``1f1b`` (Schedule1F1B), ``interleaved-1f1b``
(ScheduleInterleaved1F1B, 2 chunks per rank, chunk c on rank c % p), ``interleaved-zb``
(ScheduleInterleavedZeroBubble, same placement) and ``zbv`` (ScheduleZBVZeroBubble, 2 chunks
per rank in a V: rank r holds chunks r and 2p - 1 - r) and ``dualpipev`` (ScheduleDualPipeV,
the same V, at least 2p microbatches).

Example::

    from experiments.bench.torch_pp import run_torch_pipelining
    from experiments.bench.spec import tiny_spec

    run_torch_pipelining(tiny_spec(stages=2), "1f1b")["step_s"]
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from experiments.bench.trace import traced
from experiments.bench.measure import launch_fresh, make_row, named_params, timed_loop
from experiments.bench.spec import BenchSpec, build_chunk

__all__ = ["TORCH_SCHEDULES", "run_torch_pipelining", "chunk_to_rank", "torch_step_fn"]

# name -> (torch class name, chunks per rank, placement style)
TORCH_SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


def chunk_to_rank(num_ranks: int, num_chunks: int, style: str) -> list[int]:
    """Rank of each chunk: ``"loop"`` c % p (Megatron); ``"v"`` down then back up (ZB-V);
    the same map pipeshard's schedules use (``engine.schedules.chunk_rank``)."""
    from engine.schedules import PLACEMENTS, chunk_rank

    if style not in PLACEMENTS:
        raise ValueError(f"unknown placement style {style!r}; use 'loop' or 'v'")
    return [chunk_rank(style, num_ranks, c) for c in range(num_chunks)]


def torch_step_fn(spec: BenchSpec, schedule: str) -> tuple[Callable[[Any, Any], float | None], list[Any]]:
    """This rank's chunks of ``spec`` under torch's ``schedule``: ``(step(inputs, targets) ->
    loss or None, modules)``; one step is the schedule's step and ``torch.optim.SGD.step()``."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank, world_size = dist.get_rank(), dist.get_world_size()
    cls_name, v, style = TORCH_SCHEDULES[schedule]
    ranges = spec.ranges_for(v)
    placement = chunk_to_rank(world_size, len(ranges), style)
    mine = [c for c, r in enumerate(placement) if r == rank]
    modules = [build_chunk(spec, *ranges[c]) for c in mine]
    device = torch.device("cpu")
    stages = [pipelining.PipelineStage(mod, c, len(ranges), device) for c, mod in zip(mine, modules)]
    cls = getattr(pipelining, cls_name)
    sched = cls(stages[0] if v == 1 else stages, n_microbatches=spec.microbatches,
                loss_fn=spec.loss_fn, scale_grads=True)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=spec.lr)
    has_first, has_last = 0 in mine, len(ranges) - 1 in mine

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] | None = [] if has_last else None
        args = (inputs,) if has_first else ()
        sched.step(*args, target=targets if has_last else None, losses=losses,
                   return_outputs=False)
        opt.step()
        return float(torch.stack(losses).detach().mean()) if losses else None

    return step, modules


def _torch_worker(spec: BenchSpec, schedule: str, return_params: bool) -> dict[str, Any]:
    step, modules = torch_step_fn(spec, schedule)
    result = timed_loop(spec, step)
    if return_params:
        result["params"] = named_params(modules)
    return result


def run_torch_pipelining(spec: BenchSpec, schedule: str = "1f1b", *, return_params: bool = False,
                         timeout_s: float = 600.0) -> dict[str, Any]:
    """One row: ``spec`` trained with torch.distributed.pipelining's ``schedule`` on p fresh ranks."""
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"unknown torch schedule {schedule!r}; choose from {list(TORCH_SCHEDULES)}")
    p = spec.num_stages
    spec = traced(spec, f"torch-pipelining_{schedule}")
    results = launch_fresh(_torch_worker, p, spec, schedule, return_params, timeout_s=timeout_s)
    v = TORCH_SCHEDULES[schedule][1]
    row = make_row("torch-pipelining", schedule, spec, results, stages=p,
                   microbatches=spec.microbatches, virtual_stages=v)
    row["impl"] = TORCH_SCHEDULES[schedule][0]
    return row
