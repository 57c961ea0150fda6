"""Run tracking: `metrics.jsonl`, Weights & Biases and a progress bar.

One `Tracker` per job, created on the rank that owns the loss (other ranks pass
`enabled=False` and get a no-op). `metrics.jsonl` in the run directory gets one JSON object per
step with `step`, `loss`, `step_time_s`, `samples_per_s`, `tokens_per_s`, per-pipeline-rank
figures as lists (`rank_<name>`, index = pipeline rank) and any extra keys; W&B gets the same
metrics (`rank/<name>/<j>`), the resolved config, the plan as a table (one row per stage, i.e.
model chunk), pictures and a summary. `wandb` is imported only when used.

Example:
    >>> with Tracker(run_dir, config={"lr": 1e-3}, mode="disabled") as tracker:   # doctest: +SKIP
    ...     tracker.log_step(0, loss=5.5, step_time_s=0.2, batch_size=16, tokens_per_sample=128,
    ...                      ranks=[{"forward_s": 0.03}, {"forward_s": 0.05}])
    >>> read_metrics(run_dir / "metrics.jsonl")[0]["rank_forward_s"]                 # doctest: +SKIP
    [0.03, 0.05]
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "Tracker",
    "ProgressBar",
    "read_metrics",
    "plan_rows",
    "METRICS_FILE",
    "RANK_PREFIX",
    "stable_run_id",
]

METRICS_FILE = "metrics.jsonl"
RANK_PREFIX = "rank_"  # per-pipeline-rank lists in metrics.jsonl (named stage_ before; see README)
RUN_ID_FILE = "wandb_run_id"


def stable_run_id(run_dir: str | os.PathLike) -> str:
    """The W&B run id of the job in `run_dir`: created once, stored in `<run_dir>/wandb_run_id`,
    so a restarted or resumed job logs into the same W&B run."""
    path = Path(run_dir) / RUN_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    import secrets

    run_id = secrets.token_hex(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(run_id)
    os.replace(tmp, path)
    return run_id


def _jsonable(value: Any) -> Any:
    """Plain JSON value: tensors/NumPy scalars to Python numbers, non-finite floats to None."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _transpose_ranks(ranks: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    keys: list[str] = []
    for rank in ranks:
        keys += [k for k in rank if k not in keys]
    return {f"{RANK_PREFIX}{k}": [rank.get(k) for rank in ranks] for k in keys}


def plan_rows(plan: Any) -> list[dict[str, Any]]:
    """One row per chunk from a `partitioner.Plan` (or anything with `stage_ranges` etc.).

    Columns: stage (chunk index), rank (the schedule's placement: chunk % num_stages, or a V for
    zbv), start, stop, layers, time_s,
    memory_bytes, and activation_bytes where the plan has it.
    """
    ranges = list(getattr(plan, "stage_ranges"))
    n = len(ranges)
    ranks = int(getattr(plan, "num_stages", 0) or n)
    try:
        from engine.schedules import chunk_ranks
        rank_of = chunk_ranks(getattr(plan, "schedule", "1f1b"), ranks, max(n // ranks, 1))
    except ValueError:   # an unknown schedule name: looped placement
        rank_of = [j % ranks for j in range(n)]
    times = list(getattr(plan, "stage_time_s", None) or [None] * n)
    memory = list(getattr(plan, "stage_memory_bytes", None) or [None] * n)
    activation = getattr(plan, "stage_activation_bytes", None)
    rows = []
    for j, (a, b) in enumerate(ranges):
        row = {"stage": j, "rank": rank_of[j], "start": int(a), "stop": int(b), "layers": int(b) - int(a),
               "time_s": times[j], "memory_bytes": memory[j]}
        if activation:
            row["activation_bytes"] = activation[j]
        rows.append(row)
    return rows


class Tracker:
    """Writes `metrics.jsonl` into `run_dir` and logs the same to W&B (one run per job).

    `mode`: "offline" (default; no account, `wandb sync` later), "online", or "disabled" (no W&B
    at all; `metrics.jsonl` is still written). `enabled=False` makes every method a no-op (use it
    on ranks that do not own the loss). The W&B run id is stable per run directory
    (`stable_run_id`) and the run is opened with `resume="allow"`: a restarted or resumed job
    continues the same W&B run; steps W&B already has are not sent again.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        config: Mapping[str, Any] | None = None,
        mode: str = "offline",
        project: str = "pipeshard",
        name: str | None = None,
        entity: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.mode = str(getattr(mode, "value", mode))
        self.run: Any = None
        self._file = None
        self._summary: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}  # event figures, sent to W&B with the next step
        self._floor = 0                     # W&B's next step when resuming a run
        if not enabled:
            return
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode={self.mode!r}; choose offline, online or disabled")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        if self._file.tell() and not self.metrics_path.read_bytes().endswith(b"\n"):
            self._file.write("\n")  # a line cut short by a killed writer stays on its own line
        if self.mode != "disabled":
            import wandb

            self.run = wandb.init(
                mode=self.mode,
                dir=str(self.run_dir),
                project=project,
                entity=entity,
                name=name,
                group=group,
                tags=list(tags) or None,
                config=_jsonable(dict(config or {})),
                settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
                id=stable_run_id(self.run_dir),
                resume="allow",
            )
            self._floor = int(getattr(self.run, "step", 0) or 0)

    # ------------------------------------------------------------------ per step
    def log_step(
        self,
        step: int,
        *,
        loss: float,
        step_time_s: float,
        batch_size: int,
        tokens_per_sample: int = 1,
        ranks: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Record one step; returns the JSON object written to `metrics.jsonl`.

        `ranks`: one mapping per pipeline rank (e.g. forward_s, backward_s, idle_fraction,
        peak_activation_bytes); written as lists `rank_<key>` and to W&B as `rank/<key>/<j>`.
        """
        samples_per_s = batch_size / step_time_s if step_time_s > 0 else float("nan")
        record: dict[str, Any] = {
            "step": int(step),
            "loss": loss,
            "step_time_s": step_time_s,
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * tokens_per_sample,
        }
        if ranks:
            record.update(_transpose_ranks(ranks))
        record.update(extra)
        record = _jsonable(record)
        if not self._write(record):
            return record
        if self.run is not None:
            flat = {k: v for k, v in record.items() if not k.startswith(RANK_PREFIX) and k != "step"}
            for key, values in record.items():
                if key.startswith(RANK_PREFIX) and isinstance(values, list):
                    for j, v in enumerate(values):
                        if isinstance(v, (int, float)):
                            flat[f"rank/{key[len(RANK_PREFIX):]}/{j}"] = v
            if int(step) >= self._floor:  # W&B drops steps below the run's current one
                flat.update(self._pending)
                self._pending = {}
                self.run.log({k: v for k, v in flat.items() if v is not None and not isinstance(v, (list, dict))},
                             step=int(step))
        return record

    def _write(self, record: dict[str, Any]) -> bool:
        """Append ``record`` to metrics.jsonl; False when tracking is disabled."""
        if not self.enabled:
            return False
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        return True

    def log_event(self, kind: str, step: int, **fields: Any) -> dict[str, Any]:
        """Record an event (e.g. `restart`, `checkpoint`) as `{"event": kind, "step": step, ...}`
        in `metrics.jsonl`; its numbers go to W&B as `<kind>/<field>` with the next step."""
        record = _jsonable({"event": kind, "step": int(step), **fields})
        if not self._write(record):
            return record
        if self.run is not None:
            self._pending.update({f"{kind}/{k}": v for k, v in record.items()
                                  if isinstance(v, (int, float)) and not isinstance(v, bool)
                                  and k not in ("step", "time")})
            if kind == "restart":
                self.summary({"restarts": record.get("attempt")})
        return record

    # ------------------------------------------------------------------ tables, pictures, summary
    def log_table(self, key: str, rows: Sequence[Mapping[str, Any]], step: int | None = None) -> None:
        """Log rows (dicts with the same keys) as a W&B table (at `step`, default: W&B's next step)."""
        if not (self.enabled and self.run is not None and rows):
            return
        import wandb

        columns = list(rows[0].keys())
        data = [[_jsonable(row.get(c)) for c in columns] for row in rows]
        self.run.log({key: wandb.Table(columns=columns, data=data)}, step=step)

    def log_plan(self, plan: Any, key: str = "plan", step: int | None = None) -> None:
        """Log a partition plan (stage ranges, predicted time and memory) as a W&B table and summary."""
        rows = plan if isinstance(plan, list) else plan_rows(plan)
        self.log_table(key, rows, step=step)
        for attr in ("step_s", "bottleneck_s", "bubble_fraction", "lower_bound_s"):
            value = getattr(plan, attr, None)
            if isinstance(value, (int, float)):
                self.summary({f"{key}/{attr}": value})

    def log_image(self, key: str, path: str | os.PathLike, caption: str | None = None,
                  step: int | None = None) -> None:
        """Log a picture file (e.g. the timeline PNG) to W&B (at `step`, default: W&B's next step)."""
        if not (self.enabled and self.run is not None):
            return
        import wandb

        self.run.log({key: wandb.Image(str(path), caption=caption)}, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set run-summary values (W&B summary; also returned by `finish`)."""
        if not self.enabled:
            return
        values = _jsonable(dict(values))
        self._summary.update(values)
        if self.run is not None:
            for k, v in values.items():
                self.run.summary[k] = v

    def finish(self) -> dict[str, Any]:
        """Close `metrics.jsonl` and the W&B run; returns the summary set so far."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.run is not None:
            self.run.finish()
            self.run = None
        return dict(self._summary)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()


def read_metrics(path: str | os.PathLike, *, events: bool = False) -> list[dict[str, Any]]:
    """The step records of a `metrics.jsonl` file (or of the one in a run directory); with
    `events=True` also the event records (`{"event": "restart" | "checkpoint", ...}`). After a
    restart the steps after `resumed_from_step` appear again: the later record is the one kept
    by training. A line cut short by a killed writer is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if rec is not None and (events or "event" not in rec):
                out.append(rec)
    return out


class ProgressBar:
    """A rich progress bar showing step, loss and throughput (no-op when disabled).

    >>> with ProgressBar(total=10, enabled=False) as bar:
    ...     bar.update(1, loss=5.0, samples_per_s=80.0)
    """

    def __init__(self, total: int, *, enabled: bool = True, description: str = "train") -> None:
        self.enabled = enabled
        self._progress: Any = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
        )
        self._task = self._progress.add_task(description, total=total, loss="-", rate="")
        self._progress.start()

    def update(self, completed: int, *, loss: float | None = None, samples_per_s: float | None = None,
               tokens_per_s: float | None = None) -> None:
        """Move to `completed` steps and show the latest loss and throughput."""
        if self._progress is None:
            return
        fields: dict[str, Any] = {}
        if loss is not None:
            fields["loss"] = f"{loss:.4f}"
        if tokens_per_s is not None:
            fields["rate"] = f"{tokens_per_s:,.0f} tok/s"
        elif samples_per_s is not None:
            fields["rate"] = f"{samples_per_s:,.1f} samples/s"
        self._progress.update(self._task, completed=completed, **fields)

    def close(self) -> None:
        """Stop the bar (leaves the last state on screen)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
