"""Surviving failures in a training job: where a (re)started job resumes, what a restart lost,
and the checkpointer the worker loop uses.

A job restarted after a failure (`train.max_restarts` with pipeshard's launcher, or
`torchrun --max-restarts`) learns its attempt number from `engine.cluster.restart_count()`; it
resumes from the newest *loadable* checkpoint of its own run (torn ones are skipped and named)
and the loss-owning rank records a `restart` event: attempt, `resumed_from_step`, `lost_steps`
(steps recorded before the failure that are trained again) and the failure's cause.

Example (inside a worker)::

    path, skipped = resume_point(job.resume_from, job.checkpoint_root, restart_count())
    ...
    if restart_count() > 0 and owner:
        event = restart_event(run_dir, restart_count(), start, path, skipped)
        announce(event); tracker.log_event("restart", start, **event)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["resume_point", "restart_event", "announce", "checkpoint_event", "make_checkpointer",
           "skipped_messages"]


def skipped_messages(skipped: list[tuple[Path, str]]) -> list[str]:
    """One line per checkpoint that was passed over, saying which and why.

    >>> skipped_messages([(Path("ck/.tmp_step_000006"), "incomplete: no manifest.json")])
    ['skipping checkpoint ck/.tmp_step_000006: incomplete: no manifest.json']
    """
    return [f"skipping checkpoint {p}: {why}" for p, why in skipped]


def resume_point(resume_from: str | None, checkpoint_root: str | os.PathLike, attempt: int
                 ) -> tuple[str | None, list[tuple[Path, str]]]:
    """(the checkpoint this start of the job loads, the newer ones skipped with why).

    The first start loads what the job was prepared with (`resume_from`, None for a fresh
    start); a restart loads the newest loadable checkpoint of this run, or `resume_from` when
    the run has written none yet.
    """
    if attempt == 0:
        return resume_from, []
    from engine.checkpoint import find_resumable

    found, skipped = find_resumable(checkpoint_root)
    return (str(found) if found is not None else resume_from), skipped


def _last_recorded_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    last = 0
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:  # a line cut by the failure
                    continue
                if "event" not in rec and isinstance(rec.get("step"), int):
                    last = max(last, rec["step"])
    return last


def restart_event(run_dir: str | os.PathLike, attempt: int, start: int, path: str | None,
                  skipped: list[tuple[Path, str]]) -> dict[str, Any]:
    """The `restart` record: attempt, resumed_from_step, lost_steps, checkpoint, skipped, cause."""
    last = _last_recorded_step(Path(run_dir))
    return {"attempt": attempt, "resumed_from_step": start, "lost_steps": max(0, last - start),
            "last_recorded_step": last, "checkpoint": Path(path).name if path else None,
            "skipped": [{"checkpoint": p.name, "reason": why} for p, why in skipped],
            "cause": os.environ.get("PIPESHARD_LAST_FAILURE", ""), "time": time.time()}


def announce(event: dict[str, Any]) -> None:
    """Tell the console about a restart (and the checkpoints it skipped)."""
    for item in event["skipped"]:
        print(f"skipping checkpoint {item['checkpoint']}: {item['reason']}", flush=True)
    lost = event["lost_steps"]
    lost_text = (f"steps {event['resumed_from_step'] + 1}..{event['last_recorded_step']} "
                 f"({lost}) are trained again") if lost else "no recorded step was lost"
    source = event["checkpoint"] or "the start (no checkpoint yet)"
    cause = event["cause"].split(" -- ")[0]  # the launcher printed the full text
    print(f"restart {event['attempt']}: resumed from {source} (step {event['resumed_from_step']}); "
          f"{lost_text}" + (f"; it followed: {cause}" if cause else ""), flush=True)


def make_checkpointer(ccfg: Any, root: str, num_layers: int) -> Any:
    """The job's `engine.checkpoint.Checkpointer` (collective: every rank, same point), or None
    when `checkpoint.every_steps` is 0."""
    if not int(ccfg.every_steps or 0):
        return None
    from engine.checkpoint import Checkpointer

    return Checkpointer(root, num_layers=num_layers, keep_last=int(ccfg.keep_last or 0) or None,
                        async_save=bool(ccfg.async_save))


def checkpoint_event(saved: Any) -> dict[str, Any]:
    """The fields of the `checkpoint` record of a finished save (logged at `saved.step`): the
    stall (how long the step loop waited) and the write time until the manifest."""
    return {"checkpoint": saved.path.name, "stall_s": saved.stall_s,
            "write_s": saved.total_s, "async": saved.asynchronous, "bytes": saved.bytes}
