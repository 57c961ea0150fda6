"""Where a step's time goes, per rank, from torch.profiler traces of the benchmark's timed steps.

`bench.trace=true` runs pipeshard, torch.distributed.pipelining and DeepSpeed on the same
model with each rank profiling its timed steps (`torch.profiler`, CPU activities; CUDA too on a
GPU). Each rank writes a Chrome/Perfetto trace (``r<rank>.json``) and the profiler's own
self-time per operator, summed into categories (`CATEGORIES`): compute (aten kernels),
communication (c10d/gloo/NCCL calls, including the waits), allocation (empty/resize), copies,
the autograd engine's own bookkeeping, other profiled work, and the time the profiler saw no
operator at all: Python (the engine's dispatch, hooks, bookkeeping) and idle gaps.

Example::

    python -m experiments.bench model=gpt model.layers=8 model.dim=192 pipeline.stages=2 \\
        pipeline.microbatches=8 train.batch_size=32 bench.trace=true
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import torch

__all__ = ["CATEGORIES", "category_of", "traced", "start_profiler", "finish_profiler", "format_trace"]

# First match wins; names are torch.profiler event names (lower-cased).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("c10d", "gloo", "nccl", "record_param_comms", "send", "recv", "wait",
                       "barrier", "all_reduce", "allreduce", "broadcast", "isend", "irecv")),
    ("allocation", ("aten::empty", "aten::resize_", "aten::zeros", "aten::new_empty",
                    "aten::new_zeros", "aten::zero_", "aten::fill_")),
    ("copies", ("aten::copy_", "aten::clone", "aten::to", "aten::_to_copy", "aten::detach",
                "aten::contiguous", "aten::cat")),
    ("autograd engine", ("autograd::engine", "torch::autograd", "accumulategrad", "backward0",
                         "backward1")),
    ("compute", ("aten::",)),
)


def category_of(name: str) -> str:
    """The category of a profiler event name ('other' when none matches).

    >>> category_of("aten::addmm"), category_of("gloo:recv"), category_of("aten::empty_strided")
    ('compute', 'communication', 'allocation')
    """
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def traced(spec: Any, tag: str) -> Any:
    """``spec`` with its traces going to ``<trace_dir>/<tag>_<split>`` (unchanged if not tracing)."""
    if not spec.trace_dir:
        return spec
    split = "-".join(f"{a}_{b}" for a, b in spec.stage_ranges)
    if spec.chunk_ranges:
        split += "_chunks_" + "-".join(f"{a}_{b}" for a, b in spec.chunk_ranges)
    return dataclasses.replace(spec, trace_dir=os.path.join(spec.trace_dir, f"{tag}_{split}"))


def start_profiler() -> Any:
    """A started `torch.profiler.profile` (CPU, and CUDA when available)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=acts)
    prof.start()
    return prof


def finish_profiler(prof: Any, path: str, wall_s: float) -> dict[str, float]:
    """Stop ``prof`` and write its trace to ``path``; return seconds per category over the
    ``wall_s`` of timed steps, from the main thread's events (self time: an operator's time
    minus its children's). ``unprofiled`` is main-thread time inside no operator: Python (the
    engine's dispatch, hooks, bookkeeping) and waits on communication outside an operator.
    Asynchronous transfers on the backend's own threads are not counted: they overlap."""
    prof.stop()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    out = {c: 0.0 for c, _ in CATEGORIES}
    out["other"] = 0.0
    top = 0.0
    for name, self_us, is_top, dur_us in _self_times(_main_thread(events)):
        cat = category_of(name)
        out[cat] = out.get(cat, 0.0) + self_us / 1e6
        top += dur_us / 1e6 if is_top else 0.0
    out["unprofiled"] = max(0.0, wall_s - top)
    out["wall"] = wall_s
    return out


def _main_thread(events: list[dict]) -> list[dict]:
    """The events of the thread that ran the most aten operators (the step loop's thread)."""
    count: dict[Any, int] = {}
    for e in events:
        if e["name"].startswith("aten::"):
            count[e["tid"]] = count.get(e["tid"], 0) + 1
    tid = max(count, key=count.get) if count else None
    return [e for e in events if e["tid"] == tid]


def _self_times(events: list[dict]) -> list[tuple[str, float, bool, float]]:
    """(name, self us, is top level, duration us) per event, nesting found from the intervals."""
    events = sorted(events, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
    out: list[list] = []
    stack: list[tuple[float, int]] = []       # (end, index in out)
    for e in events:
        ts, dur = float(e["ts"]), float(e.get("dur", 0))
        while stack and stack[-1][0] <= ts:
            stack.pop()
        if stack:
            out[stack[-1][1]][1] -= dur        # the parent's self time loses this child
        out.append([e["name"], dur, not stack, dur])
        stack.append((ts + dur, len(out) - 1))
    return [tuple(x) for x in out]


def format_trace(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: per system and rank, milliseconds per microbatch in each category."""
    cats = [c for c, _ in CATEGORIES] + ["other", "unprofiled", "wall"]
    out = ["| system | schedule | rank | " + " | ".join(cats) + " |", "|---" * (len(cats) + 3) + "|"]
    for r in rows:
        steps, m = len(r.get("step_s_all") or [1]), int(r.get("microbatches") or 1)
        for rank, t in enumerate(r.get("trace") or []):
            cells = [f"{t.get(c, 0.0) / steps / m * 1e3:.2f}" for c in cats]
            out.append(f"| {r['system']} | {r['schedule']} | {rank} | " + " | ".join(cells) + " |")
    return "\n".join(out)
