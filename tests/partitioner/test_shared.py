"""partitioner.shared: the shared cores' efficiency fitted on plain numbers, and the planner
simulating ranks that outnumber their cores on that fraction of them."""

import math
from dataclasses import replace

import pytest

from partitioner import FixedCosts, LayerCost, Profile, partition
from partitioner.shared import EFFICIENCY_RANGE, fit_shared_costs, fit_shared_efficiency, shared_pipeline_steps

RUNS = [{"schedule": s, "microbatches": m, "step_s": 0.0} for m in (4, 8) for s in ("1f1b", "gpipe", "zb-h2")]
RUNS.append({"schedule": "interleaved-1f1b", "microbatches": 6, "virtual_stages": 2, "step_s": 0.0})
REC = {"ranks": 3, "cores": 2, "layers_per_rank": 2, "size": 48, "width": 384, "hidden": 1536,
       "layer": {"forward_s": 1.3e-3, "backward_s": 3.0e-3, "input_grad_s": 1.5e-3, "weight_grad_s": 1.6e-3},
       "runs": RUNS}
FIXED = FixedCosts(action_s=1e-4, message_latency_s=7e-5, link_bytes_per_s=5e9, step_s=6e-4,
                   optimizer_s_per_byte={"sgd": 6e-11}, message_busy_s=4e-5, cores=2,
                   step_cpu_s={"compute": 3e-4, "step": 3e-4, "yield": 3e-4})


def _with_steps(steps: list[float]) -> dict:
    return {**REC, "runs": [{**run, "step_s": t} for run, t in zip(RUNS, steps)]}


@pytest.mark.parametrize("true", [0.55, 0.8, 0.95])
def test_the_fit_recovers_the_efficiency_the_steps_were_made_with(true):
    got = fit_shared_efficiency(_with_steps(shared_pipeline_steps(REC, FIXED, true)), FIXED)
    assert got == pytest.approx(true, abs=2e-3)


def test_the_fit_takes_the_geometric_mean_over_the_runs():
    """Runs made at two efficiencies (the 4-microbatch ones at 0.6, the rest at 0.9) fit between,
    where the runs' log errors cancel."""
    lo, hi = shared_pipeline_steps(REC, FIXED, 0.6), shared_pipeline_steps(REC, FIXED, 0.9)
    steps = [a if run["microbatches"] == 4 else b for run, a, b in zip(RUNS, lo, hi)]
    e = fit_shared_efficiency(_with_steps(steps), FIXED)
    assert 0.6 < e < 0.9
    pred = shared_pipeline_steps(REC, FIXED, e)
    assert sum(math.log(p / m) for p, m in zip(pred, steps)) == pytest.approx(0, abs=1e-2)


def test_less_of_the_cores_predicts_a_longer_step():
    steps = [shared_pipeline_steps(REC, FIXED, e) for e in (1.0, 0.8, 0.6)]
    assert all(a < b < c for a, b, c in zip(*steps))


def test_the_fit_is_clamped_to_its_range():
    fast = [t * 0.5 for t in shared_pipeline_steps(REC, FIXED, 1.0)]
    slow = [t * 3 for t in shared_pipeline_steps(REC, FIXED, 0.3)]
    assert fit_shared_efficiency(_with_steps(fast), FIXED) == EFFICIENCY_RANGE[1]
    assert fit_shared_efficiency(_with_steps(slow), FIXED) == EFFICIENCY_RANGE[0]


def _profile(efficiency: float) -> Profile:
    layer = LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4096, activation_bytes=1024, output_bytes=512)
    return Profile([layer] * 6, fixed=replace(FIXED, shared_efficiency=efficiency))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2"])
def test_the_planner_shares_only_the_cores_ranks_outnumber(schedule):
    """Three ranks on two cores run on efficiency x 2 of them, and predict a longer step; two
    ranks on the same two cores have a core each and are planned as before."""
    def plan(p: int, e: float):
        return partition(_profile(e), p, schedule=schedule, microbatches=4, optimizer="sgd")

    assert plan(3, 1.0).shared_cores == 2 and plan(3, 0.6).shared_cores == pytest.approx(1.2)
    assert plan(3, 0.6).step_s > plan(3, 1.0).step_s
    said = [n for n in plan(3, 0.6).notes if "CPU cores" in n]
    assert said == ["3 ranks share 2 CPU cores: simulated on 1.20 of them (the fraction 0.600 of the cores' "
                    "time such ranks got on this machine's measured pipeline, partitioner.shared)"]
    assert not [n for n in plan(3, 1.0).notes + plan(2, 0.6).notes if "CPU cores" in n]
    assert plan(2, 0.6).shared_cores == plan(2, 1.0).shared_cores == 2
    assert plan(2, 0.6).step_s == plan(2, 1.0).step_s


# the same pipeline at a quarter of the samples: each layer about a quarter of the time
SMALL = {**REC, "size": 12, "layer": {k: v / 4 for k, v in REC["layer"].items()}}


def _made(rec: dict, efficiency: float, action_s: float) -> dict:
    return {**rec, "runs": [{**run, "step_s": t}
                            for run, t in zip(RUNS, shared_pipeline_steps(rec, FIXED, efficiency, action_s))]}


@pytest.mark.parametrize("true_e, true_a", [(0.95, 1.2e-3), (0.7, 3e-4), (0.8, 0.0)])
def test_the_joint_fit_recovers_the_efficiency_and_the_cost_per_action(true_e, true_a):
    """Steps made at two sizes with a known efficiency and cost per compute action: the fit
    finds both, and predicts every run."""
    fit = fit_shared_costs([_made(REC, true_e, true_a), _made(SMALL, true_e, true_a)], FIXED)
    assert fit.efficiency == pytest.approx(true_e, abs=0.01)
    assert fit.by_mode == pytest.approx({"compute": true_e, "step": true_e, "yield": true_e}, abs=0.01)
    assert fit.action_s == pytest.approx(true_a, abs=4e-5)
    assert fit.rms_log_error < 5e-3


def test_one_efficiency_cannot_fit_two_sizes_that_a_cost_per_action_made():
    """A cost per action weighs four times as much at a quarter of the samples: the efficiency
    alone fits each size to a different figure and misses both together; the joint fit does not."""
    recs = [_made(REC, 0.95, 1.2e-3), _made(SMALL, 0.95, 1.2e-3)]
    large, small = (fit_shared_efficiency(rec, FIXED) for rec in recs)
    assert small < large - 0.1
    alone = fit_shared_efficiency(recs, FIXED)
    errors = [math.log(p / r["step_s"]) for rec in recs
              for p, r in zip(shared_pipeline_steps(rec, FIXED, alone), rec["runs"])]
    assert math.sqrt(sum(x * x for x in errors) / len(errors)) > 10 * fit_shared_costs(recs, FIXED).rms_log_error


def test_the_planner_charges_the_cost_per_action_only_where_ranks_outnumber_cores():
    layer = LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4096, activation_bytes=1024, output_bytes=512)
    prof = Profile([layer] * 6, fixed=replace(FIXED, shared_efficiency=0.9, shared_action_s=1e-3))
    plan = {p: partition(prof, p, schedule="1f1b", microbatches=4, optimizer="sgd") for p in (2, 3)}
    assert plan[3].action_s == pytest.approx(plan[2].action_s + 1e-3)
    said = [n for n in plan[3].notes if "CPU cores" in n]
    assert said and "1.00 ms more per compute action" in said[0]
    without = partition(replace(prof, fixed=replace(prof.fixed, shared_action_s=0.0)), 3, schedule="1f1b",
                        microbatches=4, optimizer="sgd")
    assert plan[3].step_s > without.step_s


def test_the_fit_gives_each_runtime_mode_its_own_efficiency():
    """Steps made with the schedules that wait for their sends before each compute (1F1B, GPipe:
    mode "compute") at 0.7, the zero-bubble ones (mode "step") at 0.85 and interleaved ("yield") at
    0.8, all with 0.5 ms per action: each mode's efficiency comes back, and the runs are predicted."""
    true = {"compute": 0.7, "step": 0.85, "yield": 0.8}
    recs = [{**rec, "runs": [{**run, "step_s": t} for run, t in zip(RUNS, shared_pipeline_steps(rec, FIXED, true, 5e-4))]}
            for rec in (REC, SMALL)]
    fit = fit_shared_costs(recs, FIXED)
    assert fit.by_mode == pytest.approx(true, abs=0.02)
    assert fit.action_s == pytest.approx(5e-4, abs=1e-4)
    assert fit.rms_log_error < 0.01


def test_the_planner_shares_the_cores_at_its_schedules_own_efficiency():
    layer = LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4096, activation_bytes=1024, output_bytes=512)
    fixed = replace(FIXED, shared_efficiency=0.75, shared_efficiency_by_mode={"compute": 0.7, "step": 0.9})
    prof = Profile([layer] * 6, fixed=fixed)
    plan = {s: partition(prof, 3, schedule=s, microbatches=6, optimizer="sgd", virtual_stages=2 if s.startswith("inter") else 1)
            for s in ("1f1b", "gpipe", "zb-h2", "interleaved-1f1b")}
    assert [plan[s].shared_cores for s in plan] == pytest.approx([1.4, 1.4, 1.8, 1.5])
    assert "the fraction 0.900 of the cores' time" in [n for n in plan["zb-h2"].notes if "CPU cores" in n][0]
