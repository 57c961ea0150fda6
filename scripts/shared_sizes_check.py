"""Does the shared cores' efficiency depend on the size of the actions? (issue 39, docs/performance.md)

``engine.overhead``'s shared pipeline (three ranks on two cores, two layers of 384 -> 1536 -> 384
each) measured at its own microbatch of 48 samples and at 12, alternating, ``--rounds`` times
each; for each measurement the efficiency ``partitioner.shared.fit_shared_efficiency`` fits, the
layer's alone forward + backward, and each run's measured step against the plan at that
efficiency. A figure that holds for every size would come out the same at both. Run on a quiet
machine::

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/shared_sizes_check.py
"""

from __future__ import annotations

import argparse

__all__ = ["main"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[48, 12], help="microbatch sizes, alternated")
    ap.add_argument("--rounds", type=int, default=2, help="measurements per size")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run and round")
    args = ap.parse_args()
    import engine.overhead as ov
    from engine.launch import launch
    from partitioner import FixedCosts
    from partitioner.shared import fit_shared_efficiency, shared_pipeline_steps

    fixed = FixedCosts.from_dict({**ov.measure_fixed_costs(), **ov.measure_cpu_costs(), "cores": 2})
    for _ in range(args.rounds):
        for size in args.sizes:
            rec = launch(ov._shared_worker, 3, args.steps, 3, size, timeout_s=600)[0]
            e = fit_shared_efficiency(rec, fixed)
            runs = ", ".join(f"{r['schedule']} m={r['microbatches']} {r['step_s'] * 1e3:.1f} ms ({r['step_s'] / p - 1:+.0%})"
                             for r, p in zip(rec["runs"], shared_pipeline_steps(rec, fixed, e)))
            alone = rec["layer"]["forward_s"] + rec["layer"]["backward_s"]
            print(f"size {size}: e = {e:.3f}, the layer alone F + B {alone * 1e3:.2f} ms; {runs}", flush=True)


if __name__ == "__main__":
    main()
