"""partitioner.search: the planner chooses schedule, chunks, microbatches, max_inflight, recompute
and split, as a pure function on plain numbers (each layout checked against partition() itself)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.schedules import SCHEDULE_INFO, SCHEDULES, build_schedule
from partitioner import FixedCosts, LayerCost, PartitionError, Plan, Profile, partition, search
from partitioner.search import Candidate, candidate_layouts, inflight_values, microbatch_counts, scale_profile

MB = 4  # samples per microbatch the test profiles stand for


def _profile(n: int = 12, *, act: float = 4e6, param: float = 1e6, action_s: float = 2e-5, seed: int = 0) -> Profile:
    """Unequal layers (a heavy last layer, like an LM head) with fixed costs."""
    rng = np.random.default_rng(seed)
    f = rng.uniform(1e-3, 2e-3, n)
    f[-1] *= 3
    layers = [LayerCost(float(x), float(2 * x), int(param), int(act * (1 + (i % 3))), 200_000, weight_grad_s=float(x))
              for i, x in enumerate(f)]
    return Profile(layers, fixed=FixedCosts(action_s=action_s, message_latency_s=1e-5, link_bytes_per_s=1e9,
                                            step_s=1e-3, optimizer_s_per_byte={"adamw": 1e-10}))


def _direct(c, prof: Profile, p: int, batch: int, **kw) -> Plan:
    """The candidate's layout solved by partition() directly (what the search must agree with)."""
    size = batch // c.microbatches
    return partition(scale_profile(prof, size / MB), p, schedule=c.schedule, microbatches=c.microbatches,
                     virtual_stages=c.virtual_stages, max_inflight=c.max_inflight, **kw)


def test_it_picks_the_fastest_predicted_layout_and_ranks_the_rest():
    prof, p, B = _profile(), 3, 24
    res = search(prof, p, B, profile_microbatch=MB, scaling="linear", prune=False)
    from partitioner.search import _SAME

    ok = [c for c in res.candidates if c.status == "ok"]
    solved = ok + [c for c in res.candidates if c.status == "skipped" and c.note.startswith(_SAME)]
    assert len(solved) == len(res.candidates) > 10  # no limit: every layout solves (one program listed once)
    steps = [c.step_s for c in ok]
    assert steps == sorted(steps)
    assert res.chosen is ok[0] and res.plan is ok[0].plan and res.plan.step_s == min(steps)
    for c in solved:  # the search's figure is partition()'s, layout by layout
        assert c.step_s == pytest.approx(_direct(c, prof, p, B, activation_checkpointing=False).step_s, rel=1e-12)
    assert {c.schedule for c in solved} == set(SCHEDULES)
    alts = res.alternatives(5)
    assert [a.label for a in alts] == [c.label for c in ok[1:6]]
    assert (res.plan.schedule, res.plan.microbatches, res.plan.virtual_stages, res.plan.max_inflight) == (
        res.chosen.schedule, res.chosen.microbatches, res.chosen.virtual_stages, res.chosen.max_inflight)


def test_pruning_keeps_the_table_exact_and_bounds_are_lower_bounds():
    prof, p, B = _profile(action_s=2e-3), 2, 32  # costly actions: many microbatches lose
    full = search(prof, p, B, profile_microbatch=MB, scaling="linear", prune=False)
    for c in full.candidates:
        assert c.lower_bound_s <= c.step_s * (1 + 1e-12), c.label
    fast = search(prof, p, B, profile_microbatch=MB, scaling="linear", prune=True, top=3)
    assert fast.count("pruned") > 0
    want = [(c.label, c.step_s) for c in full.candidates[:4]]
    assert [(c.label, c.step_s) for c in fast.candidates[:4]] == want
    assert all(c.status == "ok" for c in fast.candidates[:4])


def test_fixed_costs_move_the_microbatch_choice():
    cheap = search(_profile(action_s=0.0), 2, 32, profile_microbatch=MB, scaling="linear", schedules=["1f1b"])
    dear = search(_profile(action_s=5e-2), 2, 32, profile_microbatch=MB, scaling="linear", schedules=["1f1b"])
    assert cheap.chosen.microbatches == 32  # free actions: the smallest bubble wins
    assert dear.chosen.microbatches == 2    # dear actions: the fewest microbatches win


def test_memory_limit_is_honoured_and_changes_the_choice():
    prof, p, B = _profile(act=2e7), 2, 16
    free = search(prof, p, B, profile_microbatch=MB, scaling="linear", prune=False)
    limit = 0.9 * free.chosen.peak_memory_bytes  # the unconstrained choice does not fit
    assert sum(c.peak_memory_bytes <= limit for c in free.candidates) >= 3
    res = search(prof, p, B, profile_microbatch=MB, scaling="linear", memory_limit_bytes=limit, activation_checkpointing=False,
                 prune=False)
    assert res.plan.fits and max(res.plan.rank_memory_bytes) <= limit
    assert res.chosen.label != free.chosen.label
    for c in res.candidates:
        if c.status == "ok":
            assert c.peak_memory_bytes <= limit and not any(c.recompute)
        else:
            assert c.status == "infeasible" and "smallest memory_limit_bytes" in c.note
            with pytest.raises(PartitionError):
                _direct(c, prof, p, B, memory_limit_bytes=limit)
    gpipe = next(c for c in res.candidates if c.label == "gpipe m=16")
    assert gpipe.status == "infeasible"  # gpipe holds every microbatch


def test_recompute_per_stage_only_where_the_limit_needs_it():
    prof, p, B = _profile(act=2e7), 2, 8
    plain = search(prof, p, B, profile_microbatch=MB, scaling="linear", prune=False)
    limit = min(c.peak_memory_bytes for c in plain.candidates)
    for _ in range(20):  # lower the limit until no layout fits without recomputation
        limit *= 0.9
        try:
            search(prof, p, B, profile_microbatch=MB, scaling="linear", memory_limit_bytes=limit, activation_checkpointing=False)
        except PartitionError as err:
            assert "no layout of the" in str(err) and "smallest memory_limit_bytes" in str(err)
            break
    else:
        pytest.fail("no limit needed recomputation")
    res = search(prof, p, B, profile_microbatch=MB, scaling="linear", memory_limit_bytes=limit)  # "auto"
    assert res.plan.fits and max(res.plan.rank_memory_bytes) <= limit
    assert any(res.plan.stage_recompute) and not all(res.plan.stage_recompute)  # per stage
    assert res.chosen.recompute == res.plan.stage_recompute
    direct = _direct(res.chosen, prof, p, B, memory_limit_bytes=limit, activation_checkpointing="auto")
    assert direct.step_s == pytest.approx(res.chosen.step_s) and direct.stage_recompute == res.plan.stage_recompute
    unlimited = search(prof, p, B, profile_microbatch=MB, scaling="linear")  # "auto" without a limit never recomputes
    assert not any(c for cand in unlimited.candidates for c in cand.recompute)


def test_layouts_honour_each_schedules_rules():
    p, n, B = 3, 12, 24
    ms = microbatch_counts(p, B)
    assert ms == [3, 4, 6, 8, 12, 24]
    cands = candidate_layouts(p, n, ms)
    assert {c.schedule for c in cands} == set(SCHEDULES)
    for c in cands:
        info = SCHEDULE_INFO[c.schedule]
        assert B % c.microbatches == 0 and c.microbatches >= p
        assert p * c.virtual_stages <= n
        if info.chunks_per_rank is None:
            assert 2 <= c.virtual_stages <= 4 and c.microbatches % p == 0
        else:
            assert c.virtual_stages == info.chunks_per_rank
        if info.memory_knob:
            assert c.max_inflight in (4, 5)  # p itself is zb-h1's schedule, which is searched
        else:
            assert c.max_inflight is None
        build_schedule(c.schedule, p, c.microbatches, c.virtual_stages, max_inflight=c.max_inflight)
    inter = {(c.virtual_stages, c.microbatches) for c in cands if c.schedule == "interleaved-1f1b"}
    assert inter == {(v, m) for v in (2, 3, 4) for m in (3, 6, 12, 24)}
    few = candidate_layouts(p, 5, ms)  # 5 layers: no room for 2 chunks per rank
    assert {c.schedule for c in few} == {"gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto"}
    only_h2 = candidate_layouts(p, n, [6], schedules=["zb-h2"])
    assert [c.max_inflight for c in only_h2] == inflight_values(p) == [3, 4, 5]
    with pytest.raises(ValueError, match="unknown schedules"):
        candidate_layouts(p, n, ms, schedules=["1f1b", "pipedream"])


def test_microbatch_counts_bounds_and_errors():
    assert microbatch_counts(2, 12, max_microbatches=4) == [2, 3, 4]
    assert microbatch_counts(4, 32, microbatches=8) == [8]
    assert microbatch_counts(4, 32, microbatches=[16, 8]) == [8, 16]
    with pytest.raises(ValueError, match="do not divide the batch of 32"):
        microbatch_counts(4, 32, microbatches=6)
    with pytest.raises(ValueError, match="multiple of 4"):
        microbatch_counts(4, 3)


def test_profiles_per_size_are_asked_once_each_and_a_single_profile_needs_its_size():
    base, calls = _profile(), []

    def at(size: int) -> Profile:
        calls.append(size)
        return scale_profile(base, size / MB)

    res = search(at, 2, 16, prune=False)
    assert sorted(calls) == [1, 2, 4, 8] and res.profile_seconds >= 0
    same = search(base, 2, 16, profile_microbatch=MB, scaling="linear", prune=False)
    assert [(c.label, c.step_s) for c in res.candidates] == [(c.label, c.step_s) for c in same.candidates]
    with pytest.raises(ValueError, match="profile_microbatch"):
        search(base, 2, 16)
    one = search(base, 2, 16, microbatches=4)  # one size: the profile is taken as it is
    assert {c.microbatches for c in one.candidates} == {4}
    doubled = scale_profile(base, 2.0)
    a, b = base.layers[0], doubled.layers[0]
    assert (b.forward_s, b.activation_bytes, b.output_bytes) == (2 * a.forward_s, 2 * a.activation_bytes,
                                                                  2 * a.output_bytes)
    assert b.param_bytes == a.param_bytes and doubled.fixed == base.fixed


def test_the_record_travels_with_the_plan_and_its_table():
    res = search(_profile(), 2, 16, profile_microbatch=MB, scaling="linear", top=3)
    rec = res.plan.search
    assert rec["chosen"]["label"] == res.chosen.label and len(rec["alternatives"]) == 3
    assert rec["considered"] == len(res.candidates) == len(rec["candidates"])
    assert sum(rec[s] for s in ("ok", "pruned", "infeasible", "skipped")) == rec["considered"]
    assert rec["chosen"]["stage_ranges"] == [list(r) for r in res.plan.stage_ranges]
    back = Plan.from_json(res.plan.to_json())
    assert back.search == rec
    text = back.summary()
    assert "search:" in text and res.chosen.schedule in text
    for alt in rec["alternatives"]:
        assert f"{alt['step_s'] * 1e3:.3f}" in text
    assert res.table(3) in text


def test_zbv_over_the_v_solver_budget_is_skipped_with_a_note():
    res = search(_profile(), 2, 8, profile_microbatch=MB, scaling="linear", v_split_budget=0)
    zbv = [c for c in res.candidates if c.schedule == "zbv"]
    assert zbv and all(c.status == "skipped" and "O(p n^4)" in c.note for c in zbv)
    assert res.chosen.schedule != "zbv" and any("skipped" in n for n in res.notes)


def test_a_thousand_layers_search_without_running_out_of_memory():
    rng = np.random.default_rng(1)
    layers = [LayerCost(float(x), float(2 * x), 10**6, 10**6, 10**4) for x in rng.uniform(1e-4, 1e-3, 1000)]
    res = search(Profile(layers), 8, 16, profile_microbatch=2, schedules=["1f1b", "zbv"])
    # zbv's V split is over budget at m = 8 and 16; 1f1b at m = 16 (one sample) is below the profiled size
    assert res.chosen.schedule == "1f1b" and res.count("skipped") == 3
    small = [c for c in res.candidates if c.microbatches == 16 and c.schedule == "1f1b"]
    assert small[0].status == "skipped" and "not extrapolated" in small[0].note
    assert math.isclose(res.plan.stage_ranges[-1][1], 1000)


def _exhaustive(prof: Profile, p: int, B: int, limit: float | None) -> list[tuple[float, str, Plan]]:
    """Every layout enumerated by hand (not by candidate_layouts), each solved by partition()
    with checkpointing off, on, and per stage where the limit needs it; the fitting ones."""
    out = []
    for name in SCHEDULES:
        info = SCHEDULE_INFO[name]
        for v in ([info.chunks_per_rank] if info.chunks_per_rank else [2, 3, 4]):
            for m in (m for m in range(1, B + 1) if B % m == 0 and m >= p):
                for cap in (range(p, 2 * p) if info.memory_knob else [None]):
                    for ckpt in (False, True, "auto"):
                        c = Candidate(name, v, m, cap)
                        try:
                            plan = _direct(c, prof, p, B, memory_limit_bytes=limit, activation_checkpointing=ckpt)
                        except (ValueError, PartitionError):
                            continue  # the schedule refuses the layout, or nothing fits
                        if plan.fits:
                            out.append((plan.step_s, c.label, plan))
    return sorted(out, key=lambda t: t[0])


@pytest.mark.parametrize("p, B, n, tight", [(2, 8, 6, False), (2, 12, 8, True), (3, 12, 9, True)])
def test_it_finds_what_an_exhaustive_enumeration_finds(p, B, n, tight):
    prof = _profile(n, act=2e7 if tight else 4e6, seed=p + B)
    limit = None
    if tight:  # a limit that about half the plain layouts miss
        plain = sorted(c.peak_memory_bytes for c in search(prof, p, B, profile_microbatch=MB, scaling="linear", prune=False,
                                                           activation_checkpointing=False).candidates)
        limit = plain[len(plain) // 2]
    assert set(inflight_values(p)) == set(range(p, 2 * p))  # every max_inflight at these sizes
    every = _exhaustive(prof, p, B, limit)
    res = search(prof, p, B, profile_microbatch=MB, scaling="linear", memory_limit_bytes=limit)
    assert every and res.plan.step_s == pytest.approx(every[0][0], rel=1e-12), (res.chosen.label, every[0][1])
    assert limit is None or max(res.plan.rank_memory_bytes) <= limit
    if tight:  # the limit bites: some layouts need recomputation or do not fit at all
        assert any(any(c.recompute) or c.status == "infeasible" for c in res.candidates)
    pruned = search(prof, p, B, profile_microbatch=MB, scaling="linear", memory_limit_bytes=limit, prune=False)
    assert pruned.chosen.label == res.chosen.label


def _sized(size: int, fixed: float = 2e-3, per_sample: float = 1e-4, n: int = 6) -> Profile:
    """A model whose layers cost a fixed part plus a part per sample (as measured ones do)."""
    t = fixed + per_sample * size
    return Profile([LayerCost(t, 2 * t, 10**6, 10**5 * size, 10**4 * size, weight_grad_s=t) for _ in range(n)],
                   meta={"microbatch_size": size})


def test_the_search_profiles_each_size_it_searches_and_says_so():
    asked = []

    def profiles(size: int) -> Profile:
        asked.append(size)
        return _sized(size)

    res = search(profiles, 2, 16, schedules=["1f1b"], prune=False)
    assert sorted(asked) == [1, 2, 4, 8]                         # each size once (m = 2, 4, 8, 16)
    assert all(c.profile == f"profiled at {16 // c.microbatches}" for c in res.candidates)
    # one sample pays the whole fixed part: more, smaller microbatches are not free
    assert res.chosen.microbatches < 16
    assert "profiled" in res.table()


def test_a_smaller_microbatch_is_not_extrapolated_but_sizes_between_are_interpolated():
    res = search({2: _sized(2), 8: _sized(8)}, 2, 16, schedules=["1f1b"], prune=False)
    by_m = {c.microbatches: c for c in res.candidates}
    assert by_m[16].status == "skipped" and "not extrapolated" in by_m[16].note        # 1 sample < 2
    assert by_m[8].profile == "profiled at 2" and by_m[2].profile == "profiled at 8"
    assert by_m[4].profile.startswith("interpolated 2..8")
    # the interpolation is exact for costs that are a fixed part plus a part per sample
    direct = partition(_sized(4), 2, microbatches=4, optimizer="adamw")
    assert by_m[4].step_s == pytest.approx(direct.step_s, rel=1e-9)
    # above the largest size it is scaled linearly from it, which over-prices a fixed part
    up = search({2: _sized(2)}, 2, 8, microbatches=[2], schedules=["1f1b"])
    assert up.chosen.profile.startswith("scaled linearly from 2 (an upper bound)")
    assert up.chosen.step_s > partition(_sized(4), 2, microbatches=2, optimizer="adamw").step_s


def test_linear_scaling_to_a_smaller_microbatch_only_when_asked_and_the_record_says_so():
    res = search(_sized(4), 2, 16, profile_microbatch=4, schedules=["1f1b"], prune=False, scaling="linear")
    one = [c for c in res.candidates if c.microbatches == 16][0]
    assert one.status == "ok" and one.profile == "scaled linearly from 4 (no fixed cost)"
    assert res.plan.search["candidates"][0]["profile"]
    with pytest.raises(ValueError, match="scaling"):
        search(_sized(4), 2, 16, profile_microbatch=4, scaling="quadratic")


def test_scaling_and_interpolation_move_every_per_sample_byte_count():
    """The loss's bytes, the backward workspace and the self-saved output grow with the
    microbatch like the activations; parameters do not."""
    import importlib

    search_mod = importlib.import_module("partitioner.search")
    from partitioner.costs import LayerCost, Profile

    def cost(k: int) -> LayerCost:
        return LayerCost(1.0 * k, 2.0 * k, 8, 4 * k, 4 * k, shared_input_bytes=3 * k, pending_grad_bytes=5 * k,
                         workspace_bytes=10 * k, output_saved_bytes=7 * k, loss_input_bytes=6 * k,
                         loss_saved_bytes=2 * k)

    doubled = search_mod.scale_profile(Profile([cost(1)]), 2.0).layers[0]
    middle = search_mod.affine_profile(Profile([cost(1)]), 1, Profile([cost(4)]), 4, 2).layers[0]
    for field in search_mod.PER_SAMPLE_BYTES:
        assert getattr(doubled, field) == getattr(cost(2), field), field
        assert getattr(middle, field) == getattr(cost(2), field), field
    assert doubled.param_bytes == middle.param_bytes == 8


def test_caps_that_cannot_bind_are_one_candidate():
    """Every max_inflight of at least m builds the same program (checked here with zb-auto's
    cost-aware builder too), so the search lists it once, at the smallest such cap."""
    from engine.schedules import build_schedule
    from partitioner.search import candidate_layouts

    got = [c.label for c in candidate_layouts(3, 12, [4, 8], schedules=["zb-h2", "zb-auto"], max_inflight=[3, 4, 5])]
    assert got == ["zb-h2 m=4 inflight=3", "zb-h2 m=4 inflight=4", "zb-h2 m=8 inflight=3", "zb-h2 m=8 inflight=4",
                   "zb-h2 m=8 inflight=5", "zb-auto m=4 inflight=3", "zb-auto m=4 inflight=4",
                   "zb-auto m=8 inflight=3", "zb-auto m=8 inflight=4", "zb-auto m=8 inflight=5"]
    costs = dict(forward_s=[1.0, 1.3, 0.8], backward_s=[2.1, 2.5, 1.7], weight_s=[0.9, 1.0, 0.7], comm_s=0.2)
    for name, kw in (("zb-h2", {}), ("zb-auto", costs)):
        progs = [[[str(a) for a in r] for r in build_schedule(name, 3, 4, max_inflight=cap, **kw).actions]
                 for cap in (4, 5)]
        assert progs[0] == progs[1], name


def test_one_program_under_two_names_is_listed_once():
    """zb-auto may build zb-h2's very order: the table then lists that program once, under the
    simpler name, and the other layout is skipped naming it. No two layouts left in the table
    run the same split, recompute and actions."""
    from partitioner.search import _SAME

    skipped = 0
    for seed in range(4):
        res = search(_profile(12, seed=seed), 3, 64, microbatches=[4, 8], schedules=["zb-h1", "zb-h2", "zb-auto"],
                     profile_microbatch=8)
        ok = [c for c in res.candidates if c.status == "ok"]
        progs = [(c.microbatches, c.plan.stage_ranges, c.plan.stage_recompute,
                  [[str(a) for a in r] for r in c.plan.build_schedule().actions]) for c in ok]
        assert all(a != b for i, a in enumerate(progs) for b in progs[i + 1:]), seed
        for c in res.candidates:
            assert c.status in ("ok", "skipped"), c.note
            if c.status != "skipped":
                continue
            skipped += 1
            kept = next(k for k in ok if c.note == f"{_SAME} {k.label} (its split, recompute and actions)")
            assert c.schedule == "zb-auto" and kept.schedule == "zb-h2" and kept.step_s == c.step_s
            assert kept.plan.stage_ranges == c.plan.stage_ranges
            assert kept.plan.build_schedule().actions == c.plan.build_schedule().actions
            assert any(n.startswith(f"1 layout(s) skipped: each {_SAME}") or f"layout(s) skipped: each {_SAME}" in n
                       for n in res.notes)
    assert skipped >= 2   # seed 0 builds zb-h2's order at m = 4 and 8
