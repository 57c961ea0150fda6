"""Soak run: many training steps on a small model, per-rank memory at the start and the end.

Runs each layout (``STAGESxREPLICAS``, default ``4x1`` and ``2x2``) for ``--steps`` steps with
the local launcher and prints, per rank: peak RSS (``ru_maxrss``) and current RSS after the
warm-up steps and at the end, the RSS trajectory (sampled every ``--sample-every`` steps) and
its least-squares slope over the second half of the run, live Python objects, and the peak
saved-activation bytes over the first and the last ``--window`` steps (plus CUDA peak allocated
bytes on GPUs). A leak shows as a steady climb (the allocator's noise as steps of a few MiB up
and down); the script exits with status 1 if any rank's median RSS over its last 10 samples
exceeds that over its first 10 by more than ``--tolerance-mib``, or live Python objects grew by
more than 1000.

With ``--kills K`` it soaks failure recovery instead: ``python -m experiments.train`` (the smoke
model, ``--layouts``' first layout) trains ``--steps`` steps with an asynchronous checkpoint every
``--every`` steps and ``train.max_restarts``; a random worker is killed with SIGKILL at ``K``
random steps. It checks that the job finishes on its own, that every step's loss is in
metrics.jsonl, that each kill produced one ``restart`` record, and that memory does not grow: the
launcher's RSS across the restarts, and each worker's RSS over its life, sampled from outside
every ``--sample-s`` seconds and tagged with how many loss records metrics.jsonl held. A worker's
growth is measured over its steady part, once it trained ``2 * --every`` steps (before that come
start-up, imports and the restore, about 130 MiB on the smoke model, and the first checkpoints'
buffers): median of the last 10 samples minus that of the first 10; a life with fewer than 20
steady samples is not measured, and the soak fails if none is (``--allow-unmeasured`` for tiny CI
runs). The default tolerance, 8 MiB, is below what keeping one checkpoint copy per save would
add over a few hundred steps. It prints the figures and exits with status 1 on a failure.

Example::

    OMP_NUM_THREADS=1 python scripts/soak.py --steps 300 --layouts 4x1 2x2
    OMP_NUM_THREADS=1 python scripts/soak.py --kills 4 --steps 400 --every 5 --layouts 2x1
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

__all__ = ["soak_worker", "main"]

MiB = 2**20


def _block(dim: int, hidden: int):
    from torch import nn
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(),
                         nn.Linear(hidden, dim))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def soak_worker(stages: int, replicas: int, args: dict) -> dict:
    """One rank of a soak job; returns its memory figures."""
    import torch
    import torch.distributed as dist
    from engine import OptimizerConfig, Pipeline
    layers = [functools.partial(_block, args["dim"], args["hidden"])
              for _ in range(args["layers"])]
    per = args["layers"] // stages
    ranges = [(s * per, (s + 1) * per if s < stages - 1 else args["layers"])
              for s in range(stages)]
    pipe = Pipeline(layers, ranges, loss_fn=torch.nn.functional.mse_loss,
                    schedule=args["schedule"], microbatches=args["microbatches"],
                    data_parallel=replicas,
                    optimizer=OptimizerConfig(name="adamw", lr=1e-4, grad_clip=1.0))
    cuda = pipe.device.type == "cuda"
    g = torch.Generator().manual_seed(dist.get_rank() // stages)
    x = torch.randn(args["batch"], args["dim"], generator=g)
    y = torch.randn(args["batch"], args["dim"], generator=g)
    steps, window, warm = args["steps"], args["window"], args["warmup"]
    act: list[int] = []
    start: dict = {}
    samples: list[tuple[int, int]] = []      # (step, current RSS) after warm-up

    def snapshot() -> dict:
        gc.collect()
        return {"peak_rss": _peak_rss_bytes(), "rss": _rss_bytes(),
                "cuda_peak": torch.cuda.max_memory_allocated() if cuda else 0,
                "py_objects": len(gc.get_objects())}

    t0 = time.perf_counter()
    for step in range(steps):
        r = pipe.train_step(x, y)
        act.append(int(r.stats["peak_activation_bytes"]))
        if step + 1 == warm:
            start = snapshot()
        if step + 1 >= warm and (step + 1 - warm) % args["sample_every"] == 0:
            samples.append((step + 1, _rss_bytes()))
    end = snapshot()
    half = samples[len(samples) // 2:]
    slope = _slope(half) if len(half) >= 3 else 0.0
    return {"rank": dist.get_rank(), "stage": pipe.mesh.pipeline_rank,
            "replica": pipe.mesh.replica, "start": start, "end": end,
            "act_first": max(act[:window]), "act_last": max(act[-window:]),
            "rss_samples": samples, "rss_slope_b_per_step": slope,
            "loss": r.loss, "s_per_step": (time.perf_counter() - t0) / steps}


def _slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope (bytes per step) of (step, bytes) points."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else 0.0


# ------------------------------------------------------------------------- failure-recovery soak
def _metric_lines(path: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return out


def _workers(launcher) -> list:
    """The training workers: children of the launcher's fork server (else of the launcher)."""
    kids = launcher.children()
    servers = [k for k in kids if any("forkserver" in part for part in _cmdline(k))]
    return [w for s in servers for w in s.children()] if servers else \
        [k for k in kids if "resource_tracker" not in " ".join(_cmdline(k))]


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001 - gone in the meantime
        return []


class _Progress:
    """How many loss records metrics.jsonl holds (restarts re-record steps: a count, not a step
    number, says how far the job got), read incrementally."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.records = path, 0, 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.records
        end = chunk.rfind(b"\n") + 1  # a line being written is read next time
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                self.records += "loss" in json.loads(line)
            except ValueError:
                continue
        return self.records


def _sample(launcher, metrics: str, stop, samples: dict, interval: float) -> None:
    """(time, RSS, loss records so far) of the launcher and of each worker (by pid) every
    `interval` seconds."""
    progress = _Progress(metrics)
    while not stop.is_set():
        try:
            done = progress()
            samples.setdefault("launcher", []).append((time.time(), launcher.memory_info().rss, done))
            for w in _workers(launcher):
                samples.setdefault(w.pid, []).append((time.time(), w.memory_info().rss, done))
        except Exception:  # noqa: BLE001 - a process ended between the listing and the read
            pass
        stop.wait(interval)


def _kill_at(launcher, metrics: str, steps: list[int], rng, kills: list, stop) -> None:
    """SIGKILL a random worker once the run has recorded each of `steps` (after new progress)."""
    import signal
    seen = 0
    for target in steps:
        while not stop.is_set():
            recs = [r for r in _metric_lines(metrics) if "loss" in r]
            if len(recs) > seen and recs[-1]["step"] >= target:
                break
            stop.wait(0.05)
        workers = _workers(launcher)
        if stop.is_set() or not workers:
            return
        victim = rng.choice(workers)
        os.kill(victim.pid, signal.SIGKILL)
        seen = len([r for r in _metric_lines(metrics) if "loss" in r])
        kills.append({"at_step": recs[-1]["step"], "pid": victim.pid, "time": time.time()})


def _steady(points: list, warm: int) -> list:
    """The samples of one worker life taken once it trained `warm` steps (start-up, the restore
    and the first checkpoints' buffers come before), without the exiting process's."""
    points = [p for p in points if p[1] > 0]
    return [p for p in points if points and p[2] >= points[0][2] + warm]


def _growth_mib(points: list, warm: int) -> float | None:
    """RSS growth over the steady part of one worker life: median of its last 10 samples minus
    that of its first 10 (None: fewer than 20 samples)."""
    body = [p[1] for p in _steady(points, warm)]
    if len(body) < 20:
        return None
    first, last = sorted(body[:10]), sorted(body[-10:])
    return (last[5] - first[5]) / MiB


def restart_soak(a) -> int:
    """The failure-recovery soak (see the module docstring)."""
    import random
    import subprocess
    import tempfile
    import threading

    import psutil
    stages, replicas = (int(v) for v in a.layouts[0].lower().split("x"))
    run_dir = a.run_dir or tempfile.mkdtemp(prefix="pipeshard-soak-")
    os.makedirs(run_dir, exist_ok=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    cmd = [sys.executable, "-m", "experiments.train", "experiment=smoke", "partitioner.method=uniform",
           f"train.steps={a.steps}", f"checkpoint.every_steps={a.every}", f"train.max_restarts={a.kills + 2}",
           f"pipeline.stages={stages}", f"pipeline.data_parallel={replicas}", "train.log_every=50",
           "train.eval_every=0", "logger.progress=false", "logger.timeline=false", "logger.mode=disabled",
           f"hydra.run.dir={run_dir}", *a.override]
    rng = random.Random(a.seed)
    # kills in the first two thirds: the watcher (polling metrics.jsonl) lags a few steps behind a
    # fast run, and a kill that lands after the last step restarts nothing
    kill_steps = sorted(rng.sample(range(a.every + 1, max(a.every + 1 + a.kills, 2 * a.steps // 3)),
                                   a.kills))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    t0 = time.time()
    with open(os.path.join(run_dir, "soak.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        launcher, stop, samples, kills = psutil.Process(proc.pid), threading.Event(), {}, []
        threads = [threading.Thread(target=_sample, args=(launcher, metrics, stop, samples, a.sample_s), daemon=True),
                   threading.Thread(target=_kill_at, args=(launcher, metrics, kill_steps, rng, kills, stop),
                                    daemon=True)]
        for t in threads:
            t.start()
        rc = proc.wait()
        stop.set()
    return _restart_report(a, rc, run_dir, metrics, kills, samples, time.time() - t0)


def _print_longest(samples: dict, warm: int) -> None:
    """The RSS curve of the longest worker life (by loss records since the job started)."""
    longest = [p for p in max(samples.values(), key=len, default=[]) if p[1] > 0]
    if len(longest) < 7:
        return
    picks = [longest[int(k * (len(longest) - 1) / 6)] for k in range(7)]
    steady = _steady(longest, warm)
    print(f"longest worker life ({longest[-1][0] - longest[0][0]:.0f} s), RSS after n loss records: "
          + ", ".join(f"{p[2]}: {p[1] / MiB:.1f}" for p in picks) + " MiB"
          + (f"; steady from record {steady[0][2]} at {steady[0][1] / MiB:.1f} MiB" if steady else ""))


def _restart_report(a, rc: int, run_dir: str, metrics: str, kills: list, samples: dict, wall: float) -> int:
    records = _metric_lines(metrics)
    losses = {r["step"] for r in records if "loss" in r and r.get("loss") is not None}
    restarts = [r for r in records if r.get("event") == "restart"]
    saves = [r for r in records if r.get("event") == "checkpoint"]
    missing = sorted(set(range(1, a.steps + 1)) - losses)
    launcher = [(p[0], p[1]) for p in samples.pop("launcher", []) if p[1] > 0]  # not the exited one
    warm = 2 * a.every
    lives = {pid: _growth_mib(pts, warm) for pid, pts in samples.items()}
    measured = [g for g in lives.values() if g is not None]
    worker_growth = max(measured, default=0.0)
    first_up = [b for t, b in launcher if t >= min((p[0][0] for p in samples.values()), default=0)]
    launcher_growth = (launcher[-1][1] - first_up[0]) / MiB if first_up else 0.0
    print(f"run directory: {run_dir} ({wall:.0f} s, exit status {rc})")
    print(f"kills at steps {[k['at_step'] for k in kills]}; restart records "
          f"{[(r['attempt'], r['resumed_from_step'], r['lost_steps']) for r in restarts]} "
          "(attempt, resumed from, lost steps)")
    stalls = sorted(r["stall_s"] for r in saves)
    if stalls:
        print(f"{len(saves)} checkpoints; stall median {stalls[len(stalls) // 2] * 1e3:.1f} ms, max "
              f"{stalls[-1] * 1e3:.1f} ms; write median "
              f"{sorted(r['write_s'] for r in saves)[len(saves) // 2] * 1e3:.0f} ms")
    print(f"steps with a loss: {len(losses)} of {a.steps} (missing: {missing[:10] or 'none'})")
    print(f"memory: launcher RSS {first_up[0] / MiB if first_up else 0:.1f} -> "
          f"{launcher[-1][1] / MiB if launcher else 0:.1f} MiB ({launcher_growth:+.1f}); largest growth over "
          f"a worker's life after its first {warm} steps {worker_growth:+.1f} MiB ({len(measured)} of "
          f"{len(lives)} worker lives long enough to measure: 20 samples)")
    _print_longest(samples, warm)
    unmeasured = not measured and not a.allow_unmeasured
    ok = (rc == 0 and not missing and len(restarts) == len(kills) == a.kills and not unmeasured
          and launcher_growth <= a.tolerance_mib and worker_growth <= a.tolerance_mib)
    print("OK" if ok else "FAILED" + (" (no worker life was long enough to measure its memory: more "
                                      "--steps, or a smaller --sample-s)" if unmeasured else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"exit": rc, "wall_s": wall, "kills": kills, "restarts": restarts, "missing_steps": missing,
                       "checkpoints": saves, "launcher_growth_mib": launcher_growth,
                       "worker_growth_mib": lives, "worker_rss": samples, "ok": ok}, f, indent=1)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20, help="steps before the 'start' figures")
    ap.add_argument("--window", type=int, default=20, help="steps per activation-peak window")
    ap.add_argument("--layouts", nargs="+", default=["4x1", "2x2"], help="STAGESxREPLICAS")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--sample-every", type=int, default=10, help="RSS sample interval (steps)")
    ap.add_argument("--tolerance-mib", type=float, default=None,
                    help="largest allowed growth of the median RSS (first vs last 10 samples); "
                         "default 32, with --kills 8")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--kills", type=int, default=0,
                    help="failure-recovery soak: kill a random worker this many times (see above)")
    ap.add_argument("--every", type=int, default=5, help="--kills: checkpoint interval (steps)")
    ap.add_argument("--seed", type=int, default=0, help="--kills: where the kills land")
    ap.add_argument("--sample-s", type=float, default=0.1, help="--kills: RSS sample interval (s)")
    ap.add_argument("--run-dir", help="--kills: the run directory (default: a temporary one)")
    ap.add_argument("--allow-unmeasured", action="store_true",
                    help="--kills: pass even when no worker life was long enough to measure (tiny CI runs)")
    ap.add_argument("--override", nargs="*", default=[], help="--kills: extra experiments.train overrides")
    a = ap.parse_args(argv)
    if a.tolerance_mib is None:
        a.tolerance_mib = 8.0 if a.kills else 32.0
    if a.kills:
        return restart_soak(a)
    if a.steps < a.warmup + a.window:
        ap.error("--steps must be at least --warmup + --window")
    from engine import launch
    from engine.runtime import Pipeline
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = {k: getattr(a, k) for k in ("steps", "warmup", "window", "layers", "dim", "hidden",
                                      "batch", "microbatches", "schedule", "sample_every")}
    report, worst, worst_objs = [], 0.0, 0
    for layout in a.layouts:
        stages, replicas = (int(v) for v in layout.lower().split("x"))
        per = a.layers // stages
        ranges = [(s * per, (s + 1) * per if s < stages - 1 else a.layers) for s in range(stages)]
        Pipeline.check_arguments(a.layers, ranges, schedule=a.schedule,
                                 microbatches=a.microbatches, data_parallel=replicas,
                                 world_size=stages * replicas, global_batch=a.batch)
        t0 = time.perf_counter()
        rows = launch(soak_worker, stages * replicas, stages, replicas, cfg)
        wall = time.perf_counter() - t0
        print(f"\n== {stages} stages x {replicas} replicas, {a.steps} steps, "
              f"{wall:.0f} s ({rows[0]['s_per_step'] * 1e3:.1f} ms/step) ==")
        print(f"{'rank':>4} {'stage':>5} {'rep':>3} | {'peak RSS start':>14} {'peak RSS end':>12}"
              f" | {'RSS start':>9} {'RSS end':>9} {'slope 2nd half':>14} | {'py objs':>15} |"
              f" {'act peak first':>14} {'act peak last':>13}")
        for r in rows:
            s, e = r["start"], r["end"]
            slope = r["rss_slope_b_per_step"] / 1024
            traj = [b for _, b in r["rss_samples"]]
            k = min(10, max(1, len(traj) // 4))
            growth = (sorted(traj[-k:])[k // 2] - sorted(traj[:k])[k // 2]) / MiB
            worst = max(worst, growth)
            objs = e["py_objects"] - s["py_objects"]
            worst_objs = max(worst_objs, objs)
            print(f"{r['rank']:>4} {r['stage']:>5} {r['replica']:>3} | "
                  f"{s['peak_rss'] / MiB:>10.1f} MiB {e['peak_rss'] / MiB:>8.1f} MiB | "
                  f"{s['rss'] / MiB:>5.1f} MiB {e['rss'] / MiB:>5.1f} MiB "
                  f"{slope:>+7.2f} KiB/step | {s['py_objects']:>7} {e['py_objects']:>7} | "
                  f"{r['act_first'] / MiB:>10.3f} MiB {r['act_last'] / MiB:>9.3f} MiB"
                  + (f" | cuda peak {s['cuda_peak'] / MiB:.1f} -> {e['cuda_peak'] / MiB:.1f} MiB"
                     if e["cuda_peak"] else ""))
            traj = r["rss_samples"]
            picks = [traj[int(k * (len(traj) - 1) / 4)] for k in range(5)]
            print("       RSS after step " + ", ".join(f"{st}: {b / MiB:.1f}" for st, b in picks)
                  + " MiB")
        report.append({"layout": layout, "wall_s": wall, "ranks": rows})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": cfg, "layouts": report}, f, indent=1)
    ok = worst <= a.tolerance_mib and worst_objs <= 1000
    print(f"\nlargest growth of the median RSS after warm-up (first vs last 10 samples): "
          f"{worst:+.1f} MiB; of live Python objects: {worst_objs:+d} "
          f"({'OK' if ok else 'GROWTH'}; tolerance {a.tolerance_mib:g} MiB, 1000 objects)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
