"""``optimal`` refines the min-bottleneck split on the predicted step (partitioner.planner._refine)."""
import itertools

import numpy as np
import pytest

import partitioner.planner as planner
from engine.schedules import chunk_ranks
from partitioner import FixedCosts, LayerCost, Profile, partition
from partitioner.transfers import transfer_model

FIXED = FixedCosts(action_s=2e-4, message_latency_s=1e-4, link_bytes_per_s=4e9, step_s=1e-2,
                   optimizer_s_per_byte={"sgd": 1.5e-10})


def _gpt_like(blocks: int = 6) -> Profile:
    """The bench preset's shape (times in ms from its profile): a light embedding, equal blocks, a
    head that costs 2.5 blocks."""
    def layer(f: float, name: str) -> LayerCost:
        return LayerCost(forward_s=f * 1e-3, backward_s=2 * f * 1e-3, param_bytes=int(f * 1e6),
                         activation_bytes=int(4e6), output_bytes=1 << 19, weight_grad_s=f * 1e-3,
                         input_grad_s=f * 1e-3, name=name)
    layers = [layer(0.3, "Embedding")] + [layer(8.0, "Block")] * blocks + [layer(20.0, "Head")]
    return Profile(layers, fixed=FIXED, meta={"input_requires_grad": False})


def _kw(schedule: str) -> dict:
    v = 2 if schedule in ("zbv", "interleaved-1f1b") else 1
    return dict(schedule=schedule, microbatches=8, virtual_stages=v, optimizer="sgd", zero_stage=0)


def _every_split(prof: Profile, p: int, **kw) -> list[tuple[float, list[tuple[int, int]], bool]]:
    """Each contiguous split's predicted step (the plan of that split, priced like any plan)."""
    plan0 = partition(prof, p, **kw)
    n, k = len(prof.layers), p * plan0.virtual_stages
    prob = planner._problem(prof, p, kw["microbatches"], plan0.virtual_stages, kw["schedule"], None, "off",
                            transfer_model(FIXED, None, None, chunk_ranks(kw["schedule"], p, plan0.virtual_stages), p, 1, 1),
                            planner.MemorySettings("fp32", "sgd", 0.0, 0, 1, "fp32", "auto",
                                                                           True, planner.GRAD_BUCKET_MB),
                            plan0.memory_limit_bytes, True, [])
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = planner._bounds_of(cuts, n)
        plan = planner._plan(prob, bounds, [False] * k, [], method="optimal", data_parallel=1, zero_stage=0,
                             optimizer="sgd", max_inflight=None)
        planner._predict(plan, prob)
        out.append((plan.step_s, bounds, plan.fits))
    return sorted(out)


@pytest.mark.parametrize("schedule", ["zbv", "interleaved-1f1b", "zb-h2", "1f1b"])
def test_optimal_predicts_the_fastest_of_every_split(schedule):
    prof = _gpt_like()
    plan = partition(prof, 2, **_kw(schedule))
    best = _every_split(prof, 2, **_kw(schedule))[0]
    assert plan.step_s <= best[0] * (1 + 1e-3), (plan.stage_ranges, best)
    assert plan.step_s == pytest.approx(plan.predicted_step_s(plan.simulate()), rel=1e-12)


def test_the_min_bottleneck_split_of_a_v_is_not_the_fastest_and_the_plan_says_so():
    # zbv: many splits balance the two ranks, but which chunks the head and the embedding share
    # decides the V's fill; the exact search alone picks a slower one on this shape
    prof = _gpt_like()
    plan = partition(prof, 2, **_kw("zbv"))
    note = [n for n in plan.notes if n.startswith("refined on the predicted step")]
    assert note and "all of them" in note[0]
    start = note[0].split("the min-bottleneck split ")[1]
    assert str(list(plan.stage_ranges)) not in start           # it moved
    assert plan.step_s < float(start.rsplit(" ", 2)[-2]) * 1e-3


def test_equal_layers_keep_the_min_bottleneck_split():
    prof = Profile([LayerCost(1e-3, 2e-3, 10**6, 10**6, 10**4)] * 8)
    plan = partition(prof, 2, microbatches=8, optimizer="sgd", zero_stage=0)
    assert plan.stage_ranges == [(0, 4), (4, 8)]
    assert not any(n.startswith("refined") for n in plan.notes)


def test_the_refined_split_fits_the_memory_limit():
    prof = _gpt_like()
    free = partition(prof, 2, **_kw("zbv"))
    every = _every_split(prof, 2, **_kw("zbv"))
    # a limit just under the fastest split's peak: it must be refused, and what is kept must fit
    limit = max(free.rank_memory_bytes) - 1
    plan = partition(prof, 2, memory_limit_bytes=limit, **_kw("zbv"))
    assert plan.fits and max(plan.rank_memory_bytes) <= limit
    assert plan.stage_ranges != free.stage_ranges
    assert plan.step_s >= every[0][0]


def test_past_the_budget_a_local_search_finds_the_fastest_split(monkeypatch):
    # 165 splits of 12 layers into 4 chunks: over a budget of 100, so the search is local
    prof = _gpt_like(blocks=10)
    monkeypatch.setattr(planner, "_REFINE_BUDGET", 100)
    calls = []
    real = planner._predict
    monkeypatch.setattr(planner, "_predict", lambda pl, prob: calls.append(1) or real(pl, prob))
    plan = partition(prof, 2, **_kw("zbv"))
    assert len(calls) <= 100 + 1          # the candidates, then the plan itself
    note = [n for n in plan.notes if n.startswith("refined")]
    assert note and "a local search" in note[0]
    monkeypatch.setattr(planner, "_predict", real)
    best = _every_split(prof, 2, **_kw("zbv"))[0]
    assert plan.step_s == pytest.approx(best[0], rel=1e-9)   # (two splits tie for it here)


def test_neighbours_move_layers_between_chunks_and_stay_valid():
    near = list(planner._neighbours((1, 2, 7), 12))
    assert (2, 3, 8) in near          # all three cuts: a layer from the last chunk to the first
    assert (1, 3, 7) in near and (1, 2, 9) in near and (2, 2, 7) not in near
    assert all(0 < c[0] and all(a < b for a, b in zip(c, c[1:])) and c[-1] < 12 for c in near)
    assert len(set(near)) == len(near)


def _reference_refine(prob, bounds, recompute, settings):
    """The refinement priced one split at a time by its whole plan (``_plan`` + ``_predict``), as
    it was written before the batched pricing: the fast one must choose the same split."""
    import math
    n, k, budget, step = prob.n, prob.k, planner._REFINE_BUDGET, {}

    def price(cuts):
        if cuts not in step:
            plan = planner._plan(prob, planner._bounds_of(cuts, n), recompute, [], **settings)
            planner._predict(plan, prob)
            step[cuts] = plan.step_s if plan.fits else math.inf

    start = tuple(e for _, e in bounds[:-1])
    price(start)
    if math.comb(n - 1, k - 1) <= budget:
        for cuts in itertools.combinations(range(1, n), k - 1):
            price(cuts)
    else:
        for seed in (planner.uniform_split(n, k), planner.greedy_split(prob.f + prob.b, k),
                     planner.parameter_split(prob.static, k)):
            price(tuple(e for _, e in seed[:-1]))
        best = min(step, key=step.__getitem__)
        while len(step) < budget:
            for cuts in planner._neighbours(best, n):
                if len(step) >= budget:
                    break
                price(cuts)
            nxt = min(step, key=step.__getitem__)
            if step[nxt] >= step[best]:
                break
            best = nxt
    best = min(step, key=step.__getitem__)
    return bounds if not step[best] < step[start] * (1 - 1e-3) else planner._bounds_of(best, n), step[best]


def _random_profile(rng, n):
    layers = []
    for _ in range(n):
        f = float(rng.uniform(0.2e-3, 3e-3))
        layers.append(LayerCost(f, 2 * f, int(rng.integers(1e5, 4e6)), int(rng.integers(1e5, 4e6)),
                                int(rng.integers(1e4, 1e6)), weight_grad_s=f,
                                input_grad_s=f * 1.1 if rng.random() < 0.5 else None))
    return Profile(layers, fixed=FIXED, meta={"input_requires_grad": bool(rng.random() < 0.5)})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv"])
def test_the_batched_refinement_chooses_what_pricing_each_plan_chooses(schedule, monkeypatch):
    rng = np.random.default_rng(len(schedule))
    seen = set()
    for trial in range(6):
        v = 2 if schedule in ("zbv", "interleaved-1f1b") else 1
        n, p = int(rng.integers(7, 15)), 2 + trial % 2
        prof = _random_profile(rng, n)
        kw = dict(schedule=schedule, microbatches=2 * p, virtual_stages=v, optimizer="sgd", zero_stage=0)
        free = partition(prof, p, **kw)
        limit = int(max(free.rank_memory_bytes) * 0.95) if trial % 3 == 2 else None
        captured = {}
        real = planner._refine

        def spy(prob, bounds, recompute, settings, notes):
            captured.update(prob=prob, bounds=list(bounds), recompute=recompute, settings=settings)
            return real(prob, bounds, recompute, settings, notes)

        monkeypatch.setattr(planner, "_refine", spy)
        try:
            plan = partition(prof, p, memory_limit_bytes=limit, activation_checkpointing="auto", **kw)
        except planner.PartitionError:
            continue
        finally:
            monkeypatch.setattr(planner, "_refine", real)
        want, want_step = _reference_refine(captured["prob"], captured["bounds"], captured["recompute"],
                                            captured["settings"])
        assert plan.stage_ranges == want
        unrefined = planner._plan(captured["prob"], captured["bounds"], captured["recompute"], [],
                                  **captured["settings"])
        planner._predict(unrefined, captured["prob"])
        assert plan.step_s <= unrefined.step_s                      # never worse than the optimum it starts from
        seen.add(any("local search" in x for x in plan.notes))
    assert seen   # at least one problem solved


def test_a_thousand_layers_on_64_stages_prices_at_most_the_budget_in_few_simulations(monkeypatch):
    import partitioner.batchsim as bs
    rng = np.random.default_rng(0)
    t = rng.uniform(0.5e-3, 1.5e-3, 1000)
    prof = Profile([LayerCost(x, 2 * x, int(rng.integers(1e6, 4e6)), int(rng.integers(1e6, 4e6)), 1 << 18)
                    for x in t])
    batches = []
    real = bs.simulate_many
    monkeypatch.setattr(planner, "simulate_many", lambda g, f, *a: batches.append(f.shape[1]) or real(g, f, *a))
    plan = partition(prof, 64, microbatches=16, link_bytes_per_s=1e10)
    note = [x for x in plan.notes if x.startswith("refine")]
    assert note and "256 splits simulated, a local search" in note[0] and plan.split_search == "local search"
    assert sum(batches) == planner._REFINE_BUDGET      # each split simulated once
    assert len(batches) <= 10                          # in a few batched simulations, not one by one
