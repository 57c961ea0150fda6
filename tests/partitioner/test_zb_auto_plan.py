"""The planner with zb-auto: the plan's schedule is built from the plan's own per-chunk costs,
within the in-flight counts its memory model read; the search considers it."""
from __future__ import annotations

from engine.schedules import build_schedule, peak_inflight
from engine.simulate import simulate
from partitioner import LayerCost, Profile, partition, search


def _profile() -> Profile:
    # unequal layers, the backward's weight part varying: the split cannot balance them all
    times = [(1.0, 2.0, 0.4), (3.0, 4.0, 2.5), (1.0, 3.0, 1.0), (2.0, 2.0, 0.2), (1.5, 4.0, 2.0),
             (0.5, 1.0, 0.5), (2.5, 5.0, 2.0), (1.0, 1.5, 0.5)]
    return Profile([LayerCost(f * 1e-3, b * 1e-3, 1 << 20, 4 << 20, 1 << 18, weight_grad_s=w * 1e-3)
                    for f, b, w in times])


def test_plan_builds_zb_auto_from_its_costs_within_its_memory():
    from partitioner.memory import schedule_states

    built = {}
    for cap, m in ((4, 6), (3, 6), (6, 6), (4, 9)):
        plan = partition(_profile(), 3, schedule="zb-auto", microbatches=m, max_inflight=cap)
        sched = plan.build_schedule()
        unit = build_schedule("zb-auto", 3, m, max_inflight=cap)
        built[(cap, m)] = sched is not unit
        # no state of any rank holds or has pending more than the memory model's peak counts
        for r, states in enumerate(schedule_states(sched)):
            for held, pend in states:
                assert held[0] <= plan.stage_inflight[r] and pend[0] <= plan.stage_pending[r]
        assert all(a <= b for a, b in zip(peak_inflight(sched), peak_inflight(unit)))
        again = build_schedule("zb-auto", 3, m, **plan.schedule_kwargs())
        assert again.actions == sched.actions
        res = plan.simulate()
        assert plan.step_s >= res.step_s
        _, f, b, w, comm = plan._schedule_and_costs(None, None)
        assert res.step_s <= simulate(unit, f, b, w, comm).step_s + 1e-12   # never slower
        assert not any("differs from the memory model" in n for n in plan.notes)
    assert all(built.values())   # bounded by the memory model's pending counts too, the costs rule



def test_search_considers_zb_auto_beside_the_handcrafted():
    res = search(_profile(), 3, 12, profile_microbatch=2, schedules=["zb-h1", "zb-h2", "zb-auto"],
                 microbatches=[6])
    names = {c.schedule for c in res.candidates if c.status == "ok"}
    assert names == {"zb-h1", "zb-h2", "zb-auto"}
