"""Does the shared cores' efficiency depend on the size of the actions? (issue 39, docs/performance.md)

``engine.overhead``'s shared pipeline (three ranks on two cores, two layers of 384 -> 1536 -> 384
each) measured at microbatches of 48 and 12 samples (alternating in each of the worker's rounds),
``--rounds`` times; for each measurement and size the efficiency
``partitioner.shared.fit_shared_efficiency`` fits alone, the layer's alone forward + backward, and
each run's measured step against the plan under the efficiency and the cost per action that
``partitioner.shared.fit_shared_costs`` fits on both sizes together (what the planner uses). An
efficiency that held for every size would come out the same at both. Run on a quiet machine::

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/shared_sizes_check.py
"""

from __future__ import annotations

import argparse

__all__ = ["main"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[48, 12], help="microbatch sizes, alternated")
    ap.add_argument("--rounds", type=int, default=2, help="measurements of both sizes")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run and round")
    args = ap.parse_args()
    import engine.overhead as ov
    from engine.launch import launch
    from partitioner import FixedCosts
    from partitioner.shared import fit_shared_costs, fit_shared_efficiency, shared_pipeline_steps

    fixed = FixedCosts.from_dict({**ov.measure_fixed_costs(), **ov.measure_cpu_costs(), "cores": 2})
    for _ in range(args.rounds):
        recs = launch(ov._shared_worker, 3, args.steps, 3, tuple(args.sizes), timeout_s=900)[0]
        fit = fit_shared_costs(recs, fixed)
        modes = ", ".join(f"{mode} {e:.3f}" for mode, e in fit.by_mode.items())
        print(f"both sizes: e = {fit.efficiency:.3f} ({modes}), {fit.action_s * 1e3:.2f} ms per action, "
              f"rms log error {fit.rms_log_error:.3f}", flush=True)
        for rec in recs:
            runs = ", ".join(f"{r['schedule']} m={r['microbatches']} {r['step_s'] * 1e3:.1f} ms ({r['step_s'] / p - 1:+.0%})"
                             for r, p in zip(rec["runs"], shared_pipeline_steps(rec, fixed, fit.by_mode, fit.action_s)))
            alone = rec["layer"]["forward_s"] + rec["layer"]["backward_s"]
            print(f"size {rec['size']}: e alone = {fit_shared_efficiency(rec, fixed):.3f}, the layer alone F + B "
                  f"{alone * 1e3:.2f} ms; {runs}", flush=True)

if __name__ == "__main__":
    main()
