"""Issue 39's MLP layout under each runtime mode, head to head in the same processes, with the CPU
time of every compute action: what a pipeline's step costs when its ranks share the cores.

The layout is the search check's (``scripts/mlp_search_check.py``): 12 blocks of 256 -> 1024 -> 256
and a head, batch 256, 4 microbatches, 3 ranks (layers 0-5, 5-9, 9-14 unless ``--ranges``).
Each variant is (schedule, ``send_wait``, gloo transport thread policy: ``engine.runtime``); all
of them run in the same three processes (one Pipeline per schedule), in alternating blocks of
steps (the order flips every block, the first block is warm-up), so a slow spell of the shared
machine biases no variant. Printed per variant: the median step (the maximum over ranks of each
step between two barriers), the median over blocks of its block median over the first
variant's, and per rank and action kind (F, B, I, W) the mean thread CPU time and wall time of
an action (``engine.stage.Chunk`` calls), from which ``Plan.simulate(forward_s=, backward_s=)``
can be re-run on what the pipeline itself computed, and per rank the CPU of a step off its
actions: the main thread's (``off_actions_cpu_s``: its step CPU less its actions') and the
other threads' (``transport_cpu_s``: gloo's transport thread), thread CPU time
(``engine.overhead.thread_cpu_s``).

Run (timings need the shared lock and a quiet machine)::

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/shared_cores_check.py            # 8 blocks of 4 steps
    PYTHONPATH=. python scripts/shared_cores_check.py --blocks 1 --per 1            # a smoke run
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from typing import Any

__all__ = ["VARIANTS", "main", "summary"]

VARIANTS: list[tuple[str, str, str]] = [
    ("1f1b", "compute", "batch"), ("1f1b", "step", "normal"), ("1f1b", "compute", "normal"),
    ("1f1b", "step", "batch"), ("zb-h2", "step", "normal"), ("gpipe", "compute", "batch")]
"""(schedule, send_wait, transport thread policy): the runtime's defaults for 1f1b, zb-h2 and gpipe
first in their schedule, and 1f1b under the other three combinations."""


def _timed_chunks(acc: dict, current: dict) -> None:
    """Wrap ``engine.stage.Chunk``'s compute calls to add each call's thread CPU and wall time to
    ``acc[(variant, kind)]`` while ``current["variant"]`` is set."""
    from engine import stage

    def wrap(name: str, kind: str) -> None:
        orig = getattr(stage.Chunk, name)

        def timed(self: Any, *a: Any, **k: Any) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            out = orig(self, *a, **k)
            if current["variant"] is not None:
                e = acc[(current["variant"], kind)]
                e[0] += time.thread_time() - c0
                e[1] += time.perf_counter() - w0
                e[2] += 1
            return out

        setattr(stage.Chunk, name, timed)

    for name, kind in (("forward", "F"), ("backward", "B"), ("backward_input", "I"), ("backward_weight", "W")):
        wrap(name, kind)


def _worker(spec: Any, blocks: int, per: int, variants: list[tuple[str, str, str]]) -> dict[str, Any]:
    import threading

    import torch.distributed as dist

    from engine.overhead import thread_cpu_s
    from engine.transport import set_transport_threads
    from experiments.bench.pipeshard_pp import build_pipeline

    acc: dict = collections.defaultdict(lambda: [0.0, 0.0, 0])
    current: dict = {"variant": None}
    _timed_chunks(acc, current)
    extra = {"zb-h2": {"max_inflight": 4}}
    pipes = {s: build_pipeline(spec, s, virtual_stages=1, **extra.get(s, {})) for s, _, _ in variants}
    times: dict[int, list[float]] = {i: [] for i in range(len(variants))}
    cpu: dict = collections.defaultdict(lambda: [0.0, 0.0, 0])   # variant -> main, others, steps
    me = threading.get_native_id()
    step = 0
    for b in range(blocks + 1):
        order = list(range(len(variants)))[::1 if b % 2 == 0 else -1]
        for i in order:
            schedule, wait, policy = variants[i]
            pipe = pipes[schedule]
            pipe.executor.wait_before_compute = wait == "compute"
            pipe.executor.yield_before_compute = wait == "yield"
            set_transport_threads(policy)
            for _ in range(per):
                x, y = spec.batches(step)
                step += 1
                current["variant"] = i if b else None
                dist.barrier()
                before, c0 = thread_cpu_s(), time.thread_time()
                t0 = time.perf_counter()
                pipe.train_step(x, y)
                c1, after = time.thread_time(), thread_cpu_s()
                dist.barrier()
                if b:
                    times[i].append(time.perf_counter() - t0)
                    e = cpu[i]
                    e[0] += c1 - c0
                    e[1] += sum(v - before.get(t, 0.0) for t, v in after.items() if t != me)
                    e[2] += 1
                current["variant"] = None
    return {"times": times, "actions": {f"{i}|{k}": v for (i, k), v in acc.items()},
            "cpu": {str(i): v for i, v in cpu.items()}}


def summary(results: list[dict[str, Any]], variants: list[tuple[str, str, str]], per: int
            ) -> list[dict[str, Any]]:
    """Per variant: its median step, its median block ratio to variant 0 (with the range), and
    per rank the mean CPU and wall seconds of each action kind."""
    out = []
    n = len(results[0]["times"][0])
    steps = {i: [max(r["times"][i][k] for r in results) for k in range(n)] for i in range(len(variants))}

    def blocks(xs: list[float]) -> list[float]:
        return [statistics.median(xs[j:j + per]) for j in range(0, len(xs), per)]

    for i, v in enumerate(variants):
        ratios = [a / b for a, b in zip(blocks(steps[i]), blocks(steps[0]))]
        actions = [{k.split("|")[1]: {"cpu_s": c / max(cnt, 1), "wall_s": w / max(cnt, 1)}
                    for k, (c, w, cnt) in r["actions"].items() if k.split("|")[0] == str(i)} for r in results]
        off = []
        for r in results:   # per rank and step: main thread's CPU less its actions', the other threads'
            main, others, n_steps = r.get("cpu", {}).get(str(i), [0.0, 0.0, 0])
            acted = sum(c for k, (c, _, _) in r["actions"].items() if k.split("|")[0] == str(i))
            off.append({"off_actions_cpu_s": (main - acted) / max(n_steps, 1), "transport_cpu_s": others / max(n_steps, 1)})
        out.append({"variant": list(v), "step_s": statistics.median(steps[i]), "block_ratio": statistics.median(ratios),
                    "block_ratio_range": [min(ratios), max(ratios)], "actions": actions, "off_actions": off})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=8, help="timed blocks per variant (plus one warm-up block)")
    ap.add_argument("--per", type=int, default=4, help="steps per block")
    ap.add_argument("--ranges", default="[[0,5],[5,9],[9,14]]", help="the ranks' layer ranges (JSON)")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    from experiments.bench.measure import launch_fresh
    from experiments.bench.problem import bench_spec
    from experiments.config import compose_config
    from scripts.mlp_search_check import OVERRIDES

    ranges = [tuple(r) for r in json.loads(args.ranges)]
    spec = bench_spec(compose_config(*OVERRIDES, "pipeline.microbatches=4"), stage_ranges=ranges)
    load0 = os.getloadavg()[0]
    rows = summary(launch_fresh(_worker, len(ranges), spec, args.blocks, args.per, VARIANTS), VARIANTS, args.per)
    for r in rows:
        lo, hi = r["block_ratio_range"]
        print(f"{'/'.join(r['variant']):22s} step {r['step_s'] * 1e3:6.1f} ms  / first {r['block_ratio']:.3f} "
              f"({lo:.3f}-{hi:.3f})")
        for rank, acts in enumerate(r["actions"]):
            off = r["off_actions"][rank]
            print(f"    rank {rank}: " + "  ".join(f"{k} cpu {a['cpu_s'] * 1e3:.2f} wall {a['wall_s'] * 1e3:.2f} ms"
                                                for k, a in sorted(acts.items()))
                  + f"  | per step off the actions: main {off['off_actions_cpu_s'] * 1e3:.2f} ms, "
                    f"other threads {off['transport_cpu_s'] * 1e3:.2f} ms")
    print(f"load average start {load0:.1f} end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
