"""Checkpoint stall benchmark: what a checkpoint costs the step loop, synchronous vs asynchronous.

Trains a stack of wide linear layers (``--layers`` x ``--dim``^2 parameters, SGD with momentum,
so a checkpoint holds weights and momentum) on ``--stages`` local ranks in three windows of
``--steps`` steps each: no checkpoints; a synchronous checkpoint every ``--every`` steps; an
asynchronous one (``engine.checkpoint.Checkpointer(async_save=True)``) every ``--every`` steps.
Each loop iteration (step + checkpoint call) is timed on every rank; the slowest rank counts.

Prints and (``--json``) writes: checkpoint size, per-checkpoint stall (the time the loop waits:
state gather + ``save``) and total write time, mean iteration time and CPU time per step of each
window, and the ratio of the async window's mean iteration to the no-checkpoint window's (the
issue's target: within 10%). The background write needs CPU of its own: on a machine whose cores
are all busy the async window slows down by that CPU time (compare the CPU column).

Example::

    OMP_NUM_THREADS=1 python scripts/checkpoint_stall.py --layers 8 --dim 2048 --steps 30 --every 10
    python scripts/checkpoint_stall.py --tiny          # seconds; what CI runs
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

__all__ = ["stall_worker", "main"]


def _layer(dim: int):
    from torch import nn
    return nn.Sequential(nn.Linear(dim, dim), nn.Tanh())


def _window(pipe, x, y, steps: int, saver, every: int, first_step: int) -> dict:
    """Run ``steps`` steps; checkpoint every ``every`` when ``saver`` is given."""
    from engine import checkpoint as ck
    iters, stalls, totals, size = [], [], [], 0
    cpu0 = time.process_time()
    for s in range(steps):
        t0 = time.perf_counter()
        pipe.train_step(x, y)
        step = first_step + s + 1
        if saver is not None and (s + 1) % every == 0:
            t1 = time.perf_counter()
            sd = pipe.state_dict()
            per_layer, scalars = ck.split_optimizer_state(sd["optimizer"])
            stalls.append(saver.save(step, layers=sd["layers"], optimizer=per_layer, started=t1,
                                     meta={"step": step, "optimizer": scalars}))
        iters.append(time.perf_counter() - t0)
        if saver is not None:
            for done in saver.poll():
                totals.append(done.total_s)
                size = done.bytes
    if saver is not None:
        for done in saver.close():
            totals.append(done.total_s)
            size = done.bytes
    return {"iter_s": iters, "stall_s": stalls, "total_s": totals, "bytes": size,
            "cpu_s": time.process_time() - cpu0}


def stall_worker(args: dict) -> dict:
    """One rank: the three windows (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from engine import OptimizerConfig, Pipeline
    from engine.checkpoint import Checkpointer
    n, p = args["layers"], args["stages"]
    pipe = Pipeline([functools.partial(_layer, args["dim"]) for _ in range(n)],
                    [(s * n // p, (s + 1) * n // p) for s in range(p)],
                    loss_fn=torch.nn.functional.mse_loss, microbatches=args["microbatches"],
                    optimizer=OptimizerConfig(name="sgd", lr=1e-3, momentum=0.9))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args["batch"], args["dim"], generator=g)
    y = torch.randn(args["batch"], args["dim"], generator=g)
    for _ in range(args["warmup"]):
        pipe.train_step(x, y)
    out, steps = {}, args["steps"]
    for k, mode in enumerate(("none", "sync", "async")):
        saver = None if mode == "none" else Checkpointer(
            os.path.join(args["root"], mode), num_layers=n, keep_last=1, async_save=mode == "async")
        dist.barrier()
        out[mode] = _window(pipe, x, y, steps, saver, args["every"], k * steps)
    return out


def _summarise(rows: list[dict], cfg: dict) -> dict:
    slowest = {m: [max(r[m]["iter_s"][i] for r in rows) for i in range(cfg["steps"])]
               for m in ("none", "sync", "async")}
    base = statistics.fmean(slowest["none"])
    report = {"config": cfg, "checkpoint_bytes": sum(r["async"]["bytes"] for r in rows[:1])}
    for m in ("none", "sync", "async"):
        stalls = [max(r[m]["stall_s"][i] for r in rows) for i in range(len(rows[0][m]["stall_s"]))]
        report[m] = {"mean_iter_s": statistics.fmean(slowest[m]), "median_iter_s": statistics.median(slowest[m]),
                     "stall_per_checkpoint_s": stalls,
                     "write_per_checkpoint_s": rows[0][m]["total_s"],
                     "cpu_s_per_step": statistics.fmean(r[m]["cpu_s"] for r in rows) / cfg["steps"],
                     "iter_ratio_to_none": statistics.fmean(slowest[m]) / base}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="steps per window")
    ap.add_argument("--every", type=int, default=10, help="checkpoint interval (steps)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dir", help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--tiny", action="store_true", help="a seconds-long run (CI)")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    if a.tiny:
        a.layers, a.dim, a.steps, a.every, a.warmup, a.batch = 4, 64, 4, 2, 1, 8
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from engine import launch
    with tempfile.TemporaryDirectory(dir=a.dir) as root:
        cfg = {k: getattr(a, k) for k in ("layers", "dim", "stages", "microbatches", "batch",
                                          "steps", "every", "warmup")}
        rows = launch(stall_worker, a.stages, dict(cfg, root=root))
    report = _summarise(rows, cfg)
    print(f"checkpoint: {report['checkpoint_bytes'] / 2**20:.1f} MiB every {a.every} steps; "
          f"{a.stages} ranks, {a.layers} x Linear({a.dim}, {a.dim}), SGD with momentum")
    print(f"{'mode':>6} | {'mean step':>10} | {'vs none':>7} | {'CPU / step':>10} | {'stall / checkpoint':>22} | "
          "write / checkpoint")
    for m in ("none", "sync", "async"):
        r = report[m]
        stalls = ", ".join(f"{s * 1e3:.0f}" for s in r["stall_per_checkpoint_s"]) or "-"
        writes = ", ".join(f"{s * 1e3:.0f}" for s in r["write_per_checkpoint_s"]) or "-"
        print(f"{m:>6} | {r['mean_iter_s'] * 1e3:>7.1f} ms | {r['iter_ratio_to_none']:>6.3f}x | "
              f"{r['cpu_s_per_step'] * 1e3:>7.1f} ms | "
              f"{stalls:>19} ms | {writes} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
