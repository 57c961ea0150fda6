"""The benchmark's one job table, and running it in rounds.

A job is one system running one schedule on one split, in fresh processes. `job_table` lists
the jobs for the systems asked for (single-process modes, pipeshard schedules each on its own
split, torch.distributed.pipelining schedules, DeepSpeed's PipelineEngine), one entry per
distinct run: two rows that need the same run (e.g. pipeshard 1f1b with the optimal split as a
system row and as a partition-quality row) share its job. `run_jobs` runs the table, a failed
run becoming an error row (`error_row`) so that one failure ends no benchmark, repeated in
alternating order over rounds and pooled per job (`combine_rounds`).

Example::

    jobs = job_table(spec, single_modes=["microbatched"], pipeshard=[("1f1b", spec)])
    rows = run_jobs(jobs, spec, rounds=1)    # {job key: row}
"""

from __future__ import annotations

import statistics
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from experiments.bench.deepspeed_pp import run_deepspeed
from experiments.bench.pipeshard_pp import run_pipeshard
from experiments.bench.single import SINGLE_MODES, SPLIT_MODE, run_single
from experiments.bench.spec import BenchSpec
from experiments.bench.torch_pp import TORCH_SCHEDULES, run_torch_pipelining
from experiments.wiring import schedule_chunks

__all__ = ["SYSTEMS", "SINGLE_MODES", "SPLIT_MODE", "Job", "check_systems", "pipeshard_key", "job_table", "run_jobs",
           "error_row", "combine_rounds"]

SYSTEMS = ("single", "pipeshard", "torch-pipelining", "deepspeed")


@dataclass(frozen=True)
class Job:
    """One run: `run()` returns its row (`system`, `schedule`, `stages`, `step_s`, ...)."""

    key: tuple
    system: str
    schedule: str
    stages: int
    virtual_stages: int
    run: Callable[[], dict[str, Any]]


def check_systems(systems: Sequence[str]) -> list[str]:
    """``systems`` as a list, or ``ValueError`` naming the unknown ones."""
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    return list(systems)


def pipeshard_key(schedule: str, spec: BenchSpec, layout: dict[str, Any] | None = None) -> tuple:
    """The job key of pipeshard running ``schedule`` on ``spec``'s split and microbatches, with
    ``layout`` (``run_pipeshard`` keywords: ``virtual_stages``, ``max_inflight``, ...)."""
    layout = dict(layout or {})
    v = layout.get("virtual_stages") or _chunks(schedule)
    if v == _chunks(schedule):  # the default: the same run as without it
        layout.pop("virtual_stages", None)
    extra = tuple(sorted((k, tuple(x) if isinstance(x, list) else x) for k, x in layout.items()))
    return ("pipeshard", schedule, tuple(map(tuple, spec.ranges_for(v))), spec.microbatches, extra)


def job_table(spec: BenchSpec, *, single_modes: Sequence[str] = (),
              pipeshard: Sequence[tuple] = (), torch_schedules: Sequence[str] = (),
              deepspeed: bool = False, timeout_s: float = 900.0) -> dict[tuple, Job]:
    """The jobs listed, keyed: the single-process modes and the torch / DeepSpeed peers on
    `spec`; pipeshard on each `(schedule, spec)` or `(schedule, spec, layout)` given (that spec
    carries the run's split and microbatches; `layout` the `run_pipeshard` keywords)."""
    p, jobs = spec.num_stages, {}

    def add(key: tuple, stages: int, v: int, run: Callable[[], dict[str, Any]]) -> None:
        jobs.setdefault(key, Job(key, key[0], key[1], stages, v, run))

    for mode in single_modes:
        add(("single", mode), 1, 1, lambda mode=mode: run_single(spec, mode=mode, timeout_s=timeout_s))
    for name, s, *rest in pipeshard:
        layout = dict(rest[0]) if rest else {}
        add(pipeshard_key(name, s, layout), p, layout.get("virtual_stages") or _chunks(name),
            lambda name=name, s=s, layout=layout: run_pipeshard(s, name, timeout_s=timeout_s, **layout))
    for name in torch_schedules:
        v = TORCH_SCHEDULES[name][1] if name in TORCH_SCHEDULES else 1
        add(("torch-pipelining", name), p, v, lambda name=name: run_torch_pipelining(spec, name, timeout_s=timeout_s))
    if deepspeed:
        add(("deepspeed", "1f1b"), p, 1, lambda: run_deepspeed(spec, timeout_s=timeout_s))
    return jobs


def _chunks(schedule: str) -> int:
    try:
        return schedule_chunks(schedule)
    except ValueError:
        return 1  # an unknown schedule: its run fails and says why (an error row)


def error_row(job: Job, spec: BenchSpec, exc: BaseException) -> dict[str, Any]:
    """The row of a run that failed: the figures are ``None``, ``error`` says why (one line)."""
    from engine.launch import WorkerError

    if isinstance(exc, WorkerError):
        cause = f"rank {exc.rank}: {exc.cause.strip().splitlines()[0]}"
    else:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return {"system": job.system, "schedule": job.schedule, "stages": job.stages,
            "microbatches": spec.microbatches, "virtual_stages": job.virtual_stages,
            "step_s": None, "step_s_all": [], "samples_per_s": None, "peak_rss_bytes": [],
            "loss": None, "losses": [], "error": cause,
            "traceback": "".join(traceback.format_exception(exc))
            + (f"\n--- worker traceback ---\n{exc.traceback_text}" if isinstance(exc, WorkerError) else "")}


def run_jobs(jobs: dict[tuple, Job], spec: BenchSpec, *, rounds: int = 1,
             log: Callable[[str], None] | None = print) -> dict[tuple, dict[str, Any]]:
    """Every job's row (pooled over ``rounds``, run in alternating order A B C, C B A, ... so
    that a machine whose load drifts biases no system); a failed run gives an error row."""
    runs: dict[tuple, list[dict[str, Any]]] = {k: [] for k in jobs}
    order = list(jobs)
    for rnd in range(rounds):
        for k in (order if rnd % 2 == 0 else order[::-1]):
            job = jobs[k]
            try:
                row = job.run()
            except Exception as exc:  # noqa: BLE001 - every failure becomes a row
                row = error_row(job, spec, exc)
            if log:
                figure = f"{row['step_s'] * 1e3:.1f} ms" if row.get("step_s") else f"ERROR {row.get('error')}"
                tag = f"round {rnd + 1}/{rounds} " if rounds > 1 else ""
                log(f"[bench] {tag}{job.system:17s} {job.schedule:17s} {figure}")
            runs[k].append(row)
    return {k: combine_rounds(v) for k, v in runs.items()}


def combine_rounds(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same job run in several rounds: ``step_s`` is the median of every timed
    step of every round, ``step_s_rounds`` each round's median, ``step_s_by_round`` each
    round's timed steps in round order (None for a failed round), memory the maximum; the other
    fields come from the round whose median is the middle one. A failed round makes the row
    an error row only if every round failed."""
    ok = [r for r in runs if r.get("step_s")]
    if not ok:
        return dict(runs[-1])
    mid = sorted(ok, key=lambda r: r["step_s"])[len(ok) // 2]
    row = dict(mid)
    steps = [t for r in ok for t in r["step_s_all"]]
    row["step_s_all"] = steps
    row["step_s"] = statistics.median(steps)
    row["step_s_rounds"] = [r["step_s"] for r in ok]
    row["step_s_by_round"] = [list(r["step_s_all"]) if r.get("step_s") else None for r in runs]
    row["samples_per_s"] = mid["samples_per_s"] * mid["step_s"] / row["step_s"]
    row["peak_rss_bytes"] = [max(v) for v in zip(*(r["peak_rss_bytes"] for r in ok))]
    row["rounds"] = len(ok)
    if len(ok) < len(runs):
        row["failed_rounds"] = [r.get("error") for r in runs if not r.get("step_s")]
    return row
