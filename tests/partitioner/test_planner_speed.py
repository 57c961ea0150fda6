"""The planner's shortcuts at scale change no answer: the schedule states' dominance filter,
the stage-count advice of an infeasible layout, and the search's pruning (issue 39 part C)."""

from __future__ import annotations

import numpy as np
import pytest

import partitioner.planner as planner
from engine.schedules import SCHEDULE_INFO, SCHEDULES, build_schedule
from partitioner import LayerCost, PartitionError, Profile, partition, search
from partitioner.memory import _undominated, schedule_states


def _states_by_definition(schedule) -> list:  # noqa: ANN001
    """Each rank's states no other state dominates, by comparing every pair (the definition)."""
    out = []
    for r, acts in enumerate(schedule.actions):
        mine = schedule.stages_of(r)
        held, pend, seen = dict.fromkeys(mine, 0), dict.fromkeys(mine, 0), []
        for a in acts:
            if a.kind not in ("F", "I", "B", "W"):
                continue
            if a.kind in ("F", "I"):
                (held if a.kind == "F" else pend)[a.stage] += 1
            else:
                held[a.stage] -= 1
                pend[a.stage] -= a.kind == "W"
            st = (tuple(held[c] for c in mine), tuple(pend[c] for c in mine))
            if st not in seen:
                seen.append(st)
        flat = [h + g for h, g in seen]
        out.append([st for st, x in zip(seen, flat)
                    if not any(y != x and all(b >= a for a, b in zip(x, y)) for y in flat)])
    return out


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_states_keep_exactly_the_undominated_states_in_order(name):
    v = SCHEDULE_INFO[name].chunks_per_rank or 3
    for p in (2, 3, 4):
        for m in (1, 3, p, 2 * p + 1):
            try:
                sched = build_schedule(name, p, m, v)
            except ValueError:
                continue   # the schedule refuses this layout
            assert schedule_states(sched) == _states_by_definition(sched), (name, p, m)


def test_undominated_on_random_vectors():
    import random
    rng = random.Random(0)
    for _ in range(200):
        d = rng.randint(1, 4)
        flat = list(dict.fromkeys(tuple(rng.randint(0, 3) for _ in range(d)) for _ in range(rng.randint(1, 30))))
        want = [not any(y != x and all(b >= a for a, b in zip(x, y)) for y in flat) for x in flat]
        assert _undominated(flat) == want


def _llm_like(n: int = 12, act: float = 6e7) -> Profile:
    """Heavy activations (nothing fits a small limit on few stages), a head with a loss variant."""
    layers = [LayerCost(1e-3, 2e-3, int(2e7), int(act), int(4e6), weight_grad_s=1e-3) for _ in range(n)]
    head = dict(forward_s=2e-3, backward_s=4e-3, param_bytes=int(4e7), activation_bytes=int(act / 4),
                output_bytes=0, weight_grad_s=2e-3)
    return Profile(layers, meta={"loss_variants": {"chunked": head}})


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2", "interleaved-1f1b"])
def test_the_advice_is_the_sweep_over_stage_counts(schedule, monkeypatch):
    """The stage-count advice (cached counts, no advice built for the loss variant's check)
    names the first stage count that fits, as a sweep building each schedule finds it."""
    prof, v = _llm_like(), 2 if schedule == "interleaved-1f1b" else 1
    kw = dict(schedule=schedule, microbatches=8, virtual_stages=v, optimizer="sgd", zero_stage=0,
              activation_checkpointing="auto")
    found = 0
    for limit in (3e8, 4e8, 6e8, 9e8):
        try:
            partition(prof, 2, memory_limit_bytes=limit, **kw)
            continue
        except PartitionError as exc:
            fast = str(exc)
        planner._advice_counts.cache_clear()
        monkeypatch.setattr(planner, "_advice_counts", _uncached_counts)
        with pytest.raises(PartitionError) as slow:
            partition(prof, 2, memory_limit_bytes=limit, **kw)
        monkeypatch.undo()
        assert fast == str(slow.value)
        found += ", or use " in fast
    assert found, "no limit of the grid gets stage-count advice: the test checks nothing"


def _uncached_counts(schedule, p, m, v, act, pend):  # noqa: ANN001
    from partitioner.memory import held_and_pending
    return held_and_pending(build_schedule(schedule, p, m, v), [act] * p * v, [pend] * p * v)


def _random_profile(n: int, seed: int) -> Profile:
    """Unequal layers, a heavy head, fixed costs (per action and per step) and a link."""
    from partitioner import FixedCosts
    rng = np.random.default_rng(seed)
    f = rng.uniform(1e-3, 3e-3, n)
    f[-1] *= 3
    layers = [LayerCost(float(x), float(rng.uniform(1.5, 2.5) * x), int(rng.integers(1e6, 4e6)),
                        int(rng.integers(2e6, 8e6)), 200_000, weight_grad_s=float(0.8 * x)) for x in f]
    fixed = FixedCosts(action_s=float(rng.choice([0.0, 1e-4, 1e-3])), message_latency_s=1e-5, link_bytes_per_s=1e9,
                       step_s=1e-3, optimizer_s_per_byte={"adamw": 1e-10})
    return Profile(layers, fixed=fixed)


@pytest.mark.parametrize("seed", range(4))
def test_pruning_changes_no_choice_and_every_bound_is_below_its_step(seed):
    """The search's pruning (each layout's lower bound against the (top + 1)-th best step) gives
    the unpruned search's choice and table head; every bound is below its layout's step."""
    n, p, B = (9, 3, 24) if seed % 2 else (10, 2, 32)
    prof = _random_profile(n, seed)
    limit = None
    kw = dict(profile_microbatch=4, scaling="linear", top=3)
    if seed >= 2:   # a limit about half the layouts miss without recomputation
        plain = sorted(c.peak_memory_bytes for c in search(prof, p, B, prune=False, activation_checkpointing=False,
                                                           **kw).candidates if c.peak_memory_bytes)
        limit = plain[len(plain) // 2]
    full = search(prof, p, B, prune=False, memory_limit_bytes=limit, **kw)
    fast = search(prof, p, B, prune=True, memory_limit_bytes=limit, **kw)
    for c in full.candidates:
        if c.step_s is not None:
            assert c.lower_bound_s <= c.step_s * (1 + 1e-12), (c.label, c.lower_bound_s, c.step_s)
    assert fast.chosen.label == full.chosen.label and fast.plan.step_s == full.plan.step_s
    assert fast.plan.stage_ranges == full.plan.stage_ranges
    head = [(c.label, c.step_s) for c in full.candidates if c.status == "ok"][:4]
    assert [(c.label, c.step_s) for c in fast.candidates if c.status == "ok"][:4] == head
    assert fast.count("pruned") > 0, "nothing pruned: the comparison checks nothing"


def test_partition_and_search_import_no_torch():
    """The planner answers without importing torch (about a second of a fresh process's first
    ``partition()``): a plain-numbers profile, planned and searched in a child process, leaves
    torch out of ``sys.modules``. Importing the engine's runtime from the planner would fail this."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from partitioner import LayerCost, Profile, partition, search\n"
            "prof = Profile([LayerCost(1e-3, 2e-3, 10**6, 10**6, 10**5, name=f'l{i}') for i in range(12)])\n"
            "plan = partition(prof, 3, microbatches=4, schedule='1f1b', link_bytes_per_s=1e9)\n"
            "search(prof, 3, 8, profile_microbatch=2)\n"
            "assert plan.step_s > 0\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
