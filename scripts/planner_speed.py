"""How fast `partitioner.partition` (with its default refinement) answers at scale.

Random layer costs (uniform 0.5-1.5 ms forward, twice that backward, 1-4 MB of parameters and
activations), a 10 GB/s link, no memory limit. Prints wall and CPU seconds per problem (CPU
seconds of this process: on a shared machine the wall time measures the neighbours too) and the
number of splits the refinement simulated.

``--llama405``: the issue's end-to-end case instead, ``python -m experiments.partition`` with
``pipeline.schedule=auto pipeline.microbatches=auto pipeline.activation_checkpointing=auto`` on a
126-layer 405B-like Llama (d=16384, 128 heads, 8 KV heads, vocabulary 128,256, sequence 8192),
16 stages x 8 replicas of h100, analytic profile, bf16, ZeRO-1, batch 1024; once per memory limit
given ("none": no limit; nothing fits 80GiB without tensor parallelism, so that run ends with the
search's PartitionError and its advice). Reports the child's user + sys CPU seconds (the figure
to read on a shared machine), wall seconds, its exit status and its answer's first line.

Usage::

    python scripts/planner_speed.py                       # 1000 x 64 and 10000 x 256, m = 16 and 64
    python scripts/planner_speed.py --problems 1000x64x16 --schedules 1f1b zb-h1 --json out.json
    python scripts/planner_speed.py --tiny                # a smoke run (tests/test_scripts.py)
    python scripts/planner_speed.py --llama405 none 80GiB   # the 405B search, without and with a limit
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from partitioner import LayerCost, Profile, partition

__all__ = ["LLAMA405", "main", "random_profile", "time_partition", "time_llama405"]

LLAMA405 = ["model=hf_llama", "model.layers=126", "model.dim=16384", "model.heads=128", "model.kv_heads=8",
            "model.vocab=128256", "model.seq_len=8192", "model.intermediate=53248", "model.tie_embeddings=false",
            "pipeline.stages=16", "pipeline.data_parallel=8", "pipeline.schedule=auto", "pipeline.microbatches=auto",
            "pipeline.activation_checkpointing=auto", "partitioner.profile=analytic", "partitioner.device_spec=h100",
            "precision=bf16", "optimizer.zero_stage=1", "train.batch_size=1024"]
"""The issue's 405B-like search as ``experiments.partition`` overrides."""


def random_profile(n: int, seed: int = 0) -> Profile:
    """``n`` layers of random costs (the module docstring's distribution)."""
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.5e-3, 1.5e-3, n)
    return Profile([LayerCost(forward_s=float(x), backward_s=float(2 * x), param_bytes=int(rng.integers(1e6, 4e6)),
                              activation_bytes=int(rng.integers(1e6, 4e6)), output_bytes=1 << 18, name="L")
                    for x in t])


def time_partition(n: int, p: int, m: int, schedule: str = "1f1b") -> dict:
    """One timed ``partition`` of ``n`` random layers into ``p`` stages with ``m`` microbatches."""
    prof = random_profile(n)
    v = 2 if schedule in ("zbv", "interleaved-1f1b") else 1
    t0, c0 = time.perf_counter(), time.process_time()
    plan = partition(prof, p, microbatches=m, schedule=schedule, virtual_stages=v, link_bytes_per_s=1e10)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    note = next((x for x in plan.notes if x.startswith("refine")), "")
    return {"layers": n, "stages": p, "microbatches": m, "schedule": schedule, "wall_s": wall, "cpu_s": cpu,
            "step_s": plan.step_s, "split_search": plan.split_search, "refinement": note.split(":")[0]}


def time_llama405(limit: str = "none", timeout_s: float = 3600.0) -> dict:
    """One ``python -m experiments.partition`` of :data:`LLAMA405` (``limit``: a
    ``partitioner.memory_limit`` such as "80GiB", or "none") in a child process: its CPU and wall
    seconds, exit status and answer (the search's line or the error)."""
    extra = [] if limit == "none" else [f"partitioner.memory_limit={limit}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as run_dir:
        before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "experiments.partition", *LLAMA405, *extra,
                               f"hydra.run.dir={run_dir}"], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = proc.stdout.splitlines()
    answer = next((x.strip() for x in lines if "optimal split:" in x), "")
    searched = next((x.strip() for x in lines if "search:" in x and "layouts" in x), "")
    if proc.returncode != 0:
        answer = next((x for x in reversed(proc.stderr.splitlines()) if x.startswith("error")), proc.stderr[-300:])
    return {"case": "llama405", "memory_limit": limit, "cpu_s": cpu, "wall_s": wall, "exit": proc.returncode,
            "answer": answer, "search": searched}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", nargs="*", default=["1000x64x16", "1000x64x64", "10000x256x16", "10000x256x64"],
                    help="layers x stages x microbatches")
    ap.add_argument("--schedules", nargs="*", default=["1f1b"])
    ap.add_argument("--tiny", action="store_true", help="one small problem (a smoke run)")
    ap.add_argument("--llama405", nargs="*", metavar="LIMIT",
                    help="the 405B auto search instead, once per memory limit (none, 80GiB, ...)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    problems = [] if args.llama405 else ["60x8x8"] if args.tiny else args.problems
    rows = []
    for limit in args.llama405 or []:
        row = time_llama405(limit)
        rows.append(row)
        print(f"405B-like auto search, memory limit {limit}: {row['cpu_s']:.1f} s CPU (user + sys), "
              f"{row['wall_s']:.1f} s wall, exit {row['exit']}; {row['search']}\n  {row['answer'][:400]}", flush=True)
    for spec in problems:
        n, p, m = (int(x) for x in spec.split("x"))
        for schedule in args.schedules:
            row = time_partition(n, p, m, schedule)
            rows.append(row)
            print(f"{n} layers x {p} stages, m={m}, {schedule}: {row['wall_s']:.2f} s wall, {row['cpu_s']:.2f} s CPU; "
                  f"{row['split_search']}; {row['refinement']}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
