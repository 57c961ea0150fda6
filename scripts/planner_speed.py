"""How fast `partitioner.partition` (with its default refinement) answers at scale.

Random layer costs (uniform 0.5-1.5 ms forward, twice that backward, 1-4 MB of parameters and
activations), a 10 GB/s link, no memory limit. Prints wall and CPU seconds per problem (CPU
seconds of this process: on a shared machine the wall time measures the neighbours too) and the
number of splits the refinement simulated.

Usage::

    python scripts/planner_speed.py                       # 1000 x 64 and 10000 x 256, m = 16 and 64
    python scripts/planner_speed.py --problems 1000x64x16 --schedules 1f1b zb-h1 --json out.json
    python scripts/planner_speed.py --tiny                # a smoke run (tests/test_scripts.py)
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from partitioner import LayerCost, Profile, partition

__all__ = ["main", "random_profile", "time_partition"]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", nargs="*", default=["1000x64x16", "1000x64x64", "10000x256x16", "10000x256x64"],
                    help="layers x stages x microbatches")
    ap.add_argument("--schedules", nargs="*", default=["1f1b"])
    ap.add_argument("--tiny", action="store_true", help="one small problem (a smoke run)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    problems = ["60x8x8"] if args.tiny else args.problems
    rows = []
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
