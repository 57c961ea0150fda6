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


def _shared_plan(cores):
    """1f1b, 3 ranks, 1 microbatch, F = 1, B = 2 per chunk, no transfer time; a step CPU of 0.5
    in a per-step cost of 0.75, an update of 0.5 per rank, 0.25 of message CPU per end."""
    from partitioner import Plan

    return Plan(stage_ranges=[(0, 1), (1, 2), (2, 3)], stage_time_s=[3.0] * 3, stage_memory_bytes=[0] * 3,
                bottleneck_s=3.0, step_s=0.0, bubble_fraction=0.0, lower_bound_s=0.0, schedule="1f1b",
                num_stages=3, microbatches=1, stage_forward_s=[1.0] * 3, stage_backward_s=[2.0] * 3,
                stage_weight_s=[1.0] * 3, boundary_comm_s=[0.0, 0.0], step_fixed_s=0.75, step_cpu_s=0.5,
                rank_optimizer_s=[0.5] * 3, boundary_cpu_s=[0.25, 0.25], shared_cores=cores)


def test_shared_cores_charge_the_cpu_off_the_actions_as_load():
    """On one core for three ranks, each message end costs 0.25 more work (chunk 1 has two ends:
    F = 1.25, 1.5, 1.25 and B = 2.25, 2.5, 2.25) and each rank's update and step CPU (1.0) run
    after its last action, time-shared: F0 F1 F2 B2 alone until 6.25; rank 2's tail and B1 share
    the core (tail ends 8.25, B1 9.75); rank 1's tail and B0 (11.75, 13.0); rank 0's tail 14.0,
    the whole work serially; plus the per-step cost beyond its CPU, 0.25: 14.25. With a processor
    per rank (None, or as many cores as ranks) nothing of it is charged: rank 0 ends at 9, plus
    its update and the per-step cost, 10.25."""
    shared = _shared_plan(1.0)
    sim = shared.simulate()
    assert [t[0][1] for t in sim.tails] == [pytest.approx(14.0), pytest.approx(11.75), pytest.approx(8.25)]
    assert shared.predicted_step_s(sim) == pytest.approx(14.25)
    assert shared.step_without_cpu_load_s() == pytest.approx(10.25)   # F, B only, serially; + update + step
    for cores in (None, 3.0):
        own = _shared_plan(cores)
        res = own.simulate()
        assert res.tails == [] and own.predicted_step_s(res) == pytest.approx(10.25)


def test_shared_cpu_of_a_message_is_its_bytes_beyond_the_busy_measurement():
    fc = FixedCosts(step_cpu_s={"compute": 7e-4, "step": 1e-3}, message_cpu_byte_s=2e-10, message_busy_bytes=1000)
    assert fc.shared_cpu("step", 500.0) == (1e-3, 0.0)             # smaller: inside message_busy_s
    assert fc.shared_cpu("compute", 1_001_000.0) == pytest.approx((7e-4, 2e-4))
    assert fc.shared_cpu("yield", 0.0)[0] == 0.0                   # not measured: nothing


def test_planner_books_the_cpu_figures_and_charges_them_only_when_ranks_share_cores():
    """The planner's plan carries the step CPU of its runtime mode and each boundary's message
    CPU; with a core per rank its prediction is the same as without the CPU figures."""
    import dataclasses

    cpu = dataclasses.replace(FIXED, step_cpu_s={"compute": 1e-3}, message_cpu_byte_s=1e-9, message_busy_bytes=0)
    prof = Profile([LAYER] * 6, fixed=dataclasses.replace(cpu, cores=3))
    plan = partition(prof, 3, schedule="1f1b", microbatches=4, optimizer="sgd")
    assert plan.step_cpu_s == 1e-3 and plan.boundary_cpu_s == [pytest.approx(1e-4)] * 2
    base = partition(Profile([LAYER] * 6, fixed=dataclasses.replace(FIXED, cores=3)), 3, schedule="1f1b",
                     microbatches=4, optimizer="sgd")
    assert plan.step_s == base.step_s
    two = partition(Profile([LAYER] * 6, fixed=dataclasses.replace(cpu, cores=2)), 3, schedule="1f1b",
                    microbatches=4, optimizer="sgd")
    two_base = partition(Profile([LAYER] * 6, fixed=dataclasses.replace(FIXED, cores=2)), 3, schedule="1f1b",
                         microbatches=4, optimizer="sgd")
    assert two.step_s > two_base.step_s
