"""Test helpers for W&B and pictures: read an offline W&B run back, and a loss plot.

``read_offline_run`` parses the ``.wandb`` transaction log with the record protobufs that ship
with wandb, so a test can check what a run logged without an account or network.

Example::

    from wandb_offline import read_offline_run
    run = read_offline_run(run_dir)        # run.config, run.history, run.summary
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["OfflineRun", "read_offline_run", "plot_loss"]


def plot_loss(records: Iterable[Mapping[str, Any]], path: str | os.PathLike, title: str = "") -> Path:
    """Save a loss-vs-step PNG (training loss, and `eval_loss` points where present)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    records = list(records)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    steps = [r["step"] for r in records if r.get("loss") is not None]
    ax.plot(steps, [r["loss"] for r in records if r.get("loss") is not None], label="train loss", lw=1)
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


@dataclass
class OfflineRun:
    """What an offline W&B run recorded: its config, history rows (one per logged step) and summary."""

    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


_HEADER = b":W&B"
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes) -> Iterable[bytes]:
    """Split W&B's transaction log (LevelDB log format after a 7-byte ':W&B' header) into records."""
    if not data.startswith(_HEADER):
        raise ValueError("not a W&B run file (missing the ':W&B' header)")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # block trailer too short for a header: skip the padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        elif kind == 0 and length == 0:  # zero padding at the end of a block
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
        else:
            raise ValueError(f"corrupt W&B run file: record type {kind} at byte {pos}")


def _item_value(item: Any) -> Any:
    if item.value_json:
        return json.loads(item.value_json)
    for name in ("number", "integer", "boolean", "text", "json"):
        try:
            if item.HasField(name):
                value = getattr(item, name)
                return json.loads(value) if name == "json" else value
        except ValueError:  # field absent in this protobuf version
            continue
    return None


def _item_key(item: Any) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def _parse_run_file(path: Path) -> tuple[OfflineRun, bool]:
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun(path=path)
    complete = False
    try:
        raws = list(_records(path.read_bytes()))
    except ValueError:  # a record still being written
        return run, False
    for raw in raws:
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            for item in updates:
                key = _item_key(item)
                if key != "_wandb":
                    run.config[key] = _item_value(item)
        elif kind == "history":
            run.history.append({_item_key(item): _item_value(item) for item in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_item_key(item)] = _item_value(item)
        elif kind == "exit":
            complete = True
    return run, complete


def read_offline_run(path: str | os.PathLike, *, wait_s: float = 30.0) -> OfflineRun:
    """Read an offline run's `.wandb` file back (a run directory, its `wandb/` folder or the file).

    Uses the record protobufs that ship with wandb (`wandb.proto.wandb_internal_pb2`). wandb's
    service process may still be writing for a moment after `finish()` returns, so this waits up
    to `wait_s` seconds for the run's exit record, then returns what is there.
    """
    import time

    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*.wandb") if "latest-run" not in p.parts)
        if not found:
            raise FileNotFoundError(f"no .wandb file under {path}; was the run logged with logger.mode=offline?")
        path = found[-1]
    deadline = time.monotonic() + wait_s
    while True:
        run, complete = _parse_run_file(path)
        if complete or time.monotonic() >= deadline:
            return run
        time.sleep(0.05)
