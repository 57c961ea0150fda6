"""The benchmark wing: pipeshard beside its peers on one model, in one run.

`python -m experiments.bench [overrides]` (see `experiments/bench/__main__.py`) runs a single
process, pipeshard (every schedule), torch.distributed.pipelining and DeepSpeed's
PipelineEngine on the same model, batches, microbatches and stage boundaries, each in fresh
processes started by `engine.launch`, and writes `bench.json` and `bench.png`.

Modules: `spec` (the problem every system gets), `measure` (start and timing loop),
`single` / `pipeshard_pp` / `torch_pp` / `deepspeed_pp` (the systems), `jobs` (the one job
table, rounds, error rows), `problem` / `predict` (a configured model as a problem, its
profile and calibrated predictions), `run` (`run_peers`, `run_bench`), `report` (tables,
chart, ratios). Names below are imported lazily, so `import experiments.bench` is light.

Example::

    from experiments.bench import run_peers, tiny_spec, format_table

    rows = run_peers(tiny_spec(), systems=("single", "pipeshard"), pipeshard_schedules=("1f1b",))
    print(format_table(rows))
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BenchSpec": "spec", "tiny_spec": "spec", "uniform_ranges": "spec", "build_chunk": "spec",
    "launch_fresh": "measure", "timed_loop": "measure", "make_row": "measure",
    "run_single": "single", "SINGLE_MODES": "single", "run_pipeshard": "pipeshard_pp",
    "run_torch_pipelining": "torch_pp", "TORCH_SCHEDULES": "torch_pp", "run_deepspeed": "deepspeed_pp",
    "SYSTEMS": "jobs", "Job": "jobs", "job_table": "jobs", "run_jobs": "jobs", "error_row": "jobs",
    "combine_rounds": "jobs",
    "run_peers": "run", "run_bench": "run", "TORCH_FOR_PIPESHARD": "run",
    "ideal_step_s": "report", "add_ideal": "report", "json_rows": "report", "format_table": "report",
    "bar_chart": "report", "ratios": "report", "format_prediction_table": "report",
    "format_rank_times": "report", "format_markdown": "report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'experiments.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"experiments.bench.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
