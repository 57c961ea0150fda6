"""Peer pipeline systems for the benchmark, each run in fresh worker processes.

- :func:`run_single` (single process, ``microbatched`` or ``full-batch``),
- :func:`run_torch_pipelining` (torch.distributed.pipelining schedules),
- :func:`run_deepspeed` (DeepSpeed's PipelineEngine, 1F1B),
- :func:`run_pipeshard` (pipeshard's own ``engine.Pipeline``, imported only in its workers),

all on a :class:`BenchSpec`, all measured by the same loop (:mod:`experiments.peers.common`)
in processes started by :func:`spawn_workers`. DeepSpeed is imported only inside its workers.

Example::

    from experiments.peers import run_single, tiny_spec

    row = run_single(tiny_spec())
"""

from experiments.peers.common import make_row, timed_loop
from experiments.peers.deepspeed_pp import run_deepspeed
from experiments.peers.harness import WorkerFailure, spawn_workers
from experiments.peers.pipeshard_pp import PIPESHARD_SCHEDULES, run_pipeshard
from experiments.peers.single import SINGLE_MODES, run_single
from experiments.peers.spec import BenchSpec, build_chunk, tiny_spec, uniform_ranges
from experiments.peers.torch_pp import TORCH_SCHEDULES, run_torch_pipelining

__all__ = [
    "BenchSpec", "tiny_spec", "uniform_ranges", "build_chunk",
    "spawn_workers", "WorkerFailure", "timed_loop", "make_row",
    "run_single", "SINGLE_MODES", "run_torch_pipelining", "TORCH_SCHEDULES", "run_deepspeed",
    "run_pipeshard", "PIPESHARD_SCHEDULES",
]
