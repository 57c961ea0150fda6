"""Fixed costs in the plan: per action, per message, per step and the optimizer update."""
from __future__ import annotations

import pytest

from engine.schedules import build_schedule
from engine.simulate import simulate
from partitioner import FixedCosts, LayerCost, Profile, partition

LAYER = LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4_000_000, activation_bytes=10_000,
                  output_bytes=100_000)
FIXED = FixedCosts(action_s=2e-4, message_latency_s=5e-5, link_bytes_per_s=1e9, step_s=3e-3,
                   optimizer_s_per_byte={"sgd": 1e-10, "adamw": 5e-10}, message_busy_s=3e-4)


def test_profile_json_keeps_the_fixed_costs():
    prof = Profile([LAYER] * 4, fixed=FIXED)
    assert Profile.from_json(prof.to_json()) == prof
    assert Profile.from_json(Profile([LAYER] * 4).to_json()).fixed is None


def test_fixed_costs_from_the_measurement_dict():
    measured = {"action_s": 1e-4, "message_latency_s": 2e-5, "link_bytes_per_s": 3e9, "step_s": 1e-3,
                "optimizer_s_per_byte": {"sgd": 1e-10}, "measured": {"when": "now"}}
    fc = FixedCosts.from_dict(measured)
    assert fc.action_s == 1e-4 and fc.optimizer_s("SGD", 1e6) == pytest.approx(1e-4)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_prediction_charges_each_action_message_and_the_step(schedule):
    m, p = 8, 2
    plan = partition(Profile([LAYER] * 4, fixed=FIXED), p, schedule=schedule, microbatches=m,
                     optimizer="adamw", zero_stage=1, data_parallel=2)
    a, c = FIXED.action_s, FIXED.message_busy_s    # p = 2: each F and B (or I) has one message
    f = [x + a + c for x in plan.stage_forward_s]
    if schedule == "zb-h1":
        b = [x + 2 * a + c for x in plan.stage_backward_s]
        w = [x + a for x in plan.stage_weight_s]
    else:
        b = [x + a + c for x in plan.stage_backward_s]
        w = [x + a for x in plan.stage_weight_s]
    comm = LAYER.output_bytes / FIXED.link_bytes_per_s + FIXED.message_latency_s
    assert plan.boundary_comm_s == [pytest.approx(comm)]
    sched = simulate(build_schedule(schedule, p, m), f, b, weight_s=w, comm_s=[comm]).step_s
    opt = 2 * LAYER.param_bytes / 2 * 5e-10          # 2 layers a rank, ZeRO-1 over 2 replicas
    assert plan.rank_optimizer_s == [pytest.approx(opt)] * 2
    assert plan.step_s == pytest.approx(sched + FIXED.step_s + opt)
    assert "fixed costs" in plan.predicted_by


@pytest.mark.parametrize("schedule,v,mode", [("1f1b", 1, "compute"), ("gpipe", 1, "compute"),
                                             ("interleaved-1f1b", 2, "yield"), ("zb-h1", 1, "step"),
                                             ("zb-h2", 1, "step"), ("zbv", 2, "step")])
def test_each_schedule_is_charged_the_fixed_costs_of_its_runtime_mode(schedule, v, mode):
    """gpipe and 1f1b run with sends waited before each compute, interleaved-1f1b yields to its
    sends in flight, the others wait them at the step's end (engine.schedules.send_mode): each
    gets the per-action and per-step cost measured in its own mode."""
    three = FixedCosts(action_s=2e-4, step_s=3e-3, action_s_send_wait=5e-5, step_s_send_wait=1e-3,
                       action_s_yield=1e-4, step_s_yield=2e-3, message_latency_s=5e-5,
                       link_bytes_per_s=1e9)
    plan = partition(Profile([LAYER] * 8, fixed=three), 2, schedule=schedule, microbatches=4,
                     virtual_stages=v, optimizer="sgd")
    want = {"compute": (5e-5, 1e-3), "yield": (1e-4, 2e-3), "step": (2e-4, 3e-3)}[mode]
    assert (plan.action_s, plan.step_fixed_s) == want
    for m in ("compute", "yield", "step"):    # costs measured in one mode only: every mode's
        assert FixedCosts(action_s=2e-4, step_s=3e-3).runtime_costs(m) == (2e-4, 3e-3)
    with pytest.raises(ValueError, match="send_mode"):
        three.runtime_costs(True)


def test_fixed_costs_without_the_busy_message_cost_read_as_zero():
    assert FixedCosts.from_dict({"action_s": 1e-4}).message_busy_s == 0.0


@pytest.mark.parametrize("schedule,v,ends", [("1f1b", 1, [1, 2, 1]), ("interleaved-1f1b", 2, [1, 2, 2, 2, 2, 1])])
def test_the_busy_message_cost_is_charged_per_cut_at_either_end(schedule, v, ends):
    """A chunk in the middle sends and receives across two cuts, an end chunk across one; the
    cost rides on its F and its B, so the step grows by it wherever those are on the critical path."""
    prof = Profile([LAYER] * 12, fixed=FIXED)
    plan = partition(prof, 3, schedule=schedule, microbatches=6, virtual_stages=v, optimizer="sgd")
    assert plan.message_busy_s == FIXED.message_busy_s
    a, c = FIXED.action_s, FIXED.message_busy_s
    f = [x + a + c * k for x, k in zip(plan.stage_forward_s, ends)]
    b = [x + a + c * k for x, k in zip(plan.stage_backward_s, ends)]
    w = [x + a for x in plan.stage_weight_s]
    want = simulate(build_schedule(schedule, 3, 6, v), f, b, weight_s=w, comm_s=plan.boundary_comm_s)
    assert plan.simulate().step_s == pytest.approx(want.step_s)
    plan.message_busy_s = 0.0
    assert plan.simulate().step_s < want.step_s


def test_no_fixed_costs_is_compute_only():
    plan = partition(Profile([LAYER] * 4), 2, microbatches=8)
    assert plan.action_s == 0 and plan.step_fixed_s == 0 and plan.rank_optimizer_s == []
    base = simulate(build_schedule("1f1b", 2, 8), plan.stage_forward_s, plan.stage_backward_s).step_s
    assert plan.step_s == pytest.approx(base)


def test_an_update_inside_a_ranks_slack_costs_nothing_and_beyond_it_the_excess():
    """No rank waits for another before its update: in 1F1B the last rank ends ``p - 1``
    backwards before rank 0, so its update overlaps them; only what exceeds that slack counts."""
    plan = partition(Profile([LAYER] * 4, fixed=FIXED), 2, schedule="1f1b", microbatches=8,
                     optimizer="sgd")
    sim = plan.simulate()
    end0, end1 = (row[-1][2] for row in sim.timeline)
    slack = end0 - end1
    assert slack > 0
    plan.rank_optimizer_s = [0.0, 0.5 * slack]
    assert plan.predicted_step_s(sim) == pytest.approx(sim.step_s + FIXED.step_s)
    plan.rank_optimizer_s = [0.0, slack + 1e-3]
    assert plan.predicted_step_s(sim) == pytest.approx(sim.step_s + FIXED.step_s + 1e-3)
    plan.rank_optimizer_s = [2e-3, 0.0]          # rank 0 ends last: all of its update counts
    assert plan.predicted_step_s(sim) == pytest.approx(sim.step_s + FIXED.step_s + 2e-3)
