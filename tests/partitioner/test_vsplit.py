"""The V split (zbv: rank r holds chunks r and 2p-1-r) is exact: equal to enumerating every
split into 2p chunks, with each rank's time and memory the sum of its two chunks'."""
import time

import numpy as np
import pytest

from partitioner.feasible import Infeasible
from partitioner.vsplit import min_v_memory_scale, optimal_v_split

from test_solve import compositions, random_instance


def chunk_cost(s, e, j, n, inst, rec, turn):
    """One chunk, loops only; ``turn``: its hand-off stays on the rank (no transfer time)."""
    t, st, act, out, infl, cut, rt, sh = (inst[x] for x in ("t", "st", "act", "out", "infl", "cut", "rt", "sh"))
    tm = sum(t[s:e]) + (cut[e] if e < n and not turn else 0.0) + (sum(rt[s:e]) if rec else 0.0)
    inb = out[s - 1] if s > 0 else 0.0
    outb = out[e - 1] if e < n else 0.0
    if rec:
        mem = sum(st[s:e]) + sum(act[s:e]) + (infl[j] + 1) * inb + outb
    else:
        mem = sum(st[s:e]) + infl[j] * (sum(act[s:e]) + (sh[s] if s > 0 else 0.0)) + inb + outb
    return tm, mem


def brute(n, p, inst, caps, ckpt):
    opts = {"off": [False], "on": [True], "auto": [False, True]}[ckpt]
    best = None
    for b in compositions(n, 2 * p):
        worst = 0.0
        for r in range(p):
            rank_best = None
            for rl in opts:
                for rr in opts:
                    tl, ml = chunk_cost(*b[r], r, n, inst, rl, r == p - 1)
                    tr, mr = chunk_cost(*b[2 * p - 1 - r], 2 * p - 1 - r, n, inst, rr, False)
                    if caps is None or ml + mr <= caps[r] * (1 + 1e-12):
                        rank_best = tl + tr if rank_best is None else min(rank_best, tl + tr)
            if rank_best is None:
                worst = None
                break
            worst = max(worst, rank_best)
        if worst is not None and (best is None or worst < best):
            best = worst
    return best


@pytest.mark.parametrize("ckpt", ["off", "auto", "on"])
def test_v_split_equals_brute_force(ckpt):
    rng = np.random.default_rng({"off": 1, "auto": 2, "on": 3}[ckpt])
    checked = infeasible = 0
    for trial in range(60):
        p = int(rng.integers(1, 4))
        n = int(rng.integers(2 * p, min(2 * p + 5, 10)))
        inst = random_instance(rng, n, 2 * p, "gpipe", 3, [None, 3.0][trial % 2])
        inst["infl"] = list(rng.integers(1, 6, 2 * p))
        caps = [None, list(rng.uniform(100, 600, p)), [float(rng.uniform(100, 600))] * p][trial % 3]
        kw = dict(static=inst["st"], act=inst["act"], out=inst["out"], inflight=inst["infl"],
                  shared=inst["sh"], cut_time=inst["cut"], recompute_time=inst["rt"], checkpointing=ckpt)
        want = brute(n, p, inst, caps, ckpt)
        if want is None:
            with pytest.raises(Infeasible):
                optimal_v_split(inst["t"], p, caps=caps, **kw)
            infeasible += 1
            continue
        bounds, got, var = optimal_v_split(inst["t"], p, caps=caps, return_variants=True, **kw)
        assert got == pytest.approx(want, rel=1e-9), (trial, bounds)
        assert bounds[0][0] == 0 and bounds[-1][1] == n and len(bounds) == 2 * p
        assert all(bounds[i][1] == bounds[i + 1][0] and bounds[i][0] < bounds[i][1] for i in range(2 * p - 1))
        for r in range(p):   # the split achieves it and fits
            tl, ml = chunk_cost(*bounds[r], r, n, inst, bool(var[r]), r == p - 1)
            tr, mr = chunk_cost(*bounds[2 * p - 1 - r], 2 * p - 1 - r, n, inst, bool(var[2 * p - 1 - r]), False)
            assert tl + tr <= got * (1 + 1e-9)
            assert caps is None or ml + mr <= caps[r] * (1 + 1e-9)
        checked += 1
    assert checked > 20 and (ckpt == "on" or infeasible > 2)


def test_v_min_memory_is_exact_and_names_the_limit():
    rng = np.random.default_rng(4)
    for _ in range(25):
        p = int(rng.integers(1, 4))
        n = int(rng.integers(2 * p, min(2 * p + 4, 9)))
        inst = random_instance(rng, n, 2 * p, "gpipe", 3, None)
        inst["infl"] = list(rng.integers(1, 6, 2 * p))
        kw = dict(static=inst["st"], act=inst["act"], out=inst["out"], inflight=inst["infl"], shared=inst["sh"])
        need, _ = min_v_memory_scale(n, p, **kw)
        exact = min(max(chunk_cost(*b[r], r, n, inst, False, False)[1]
                        + chunk_cost(*b[2 * p - 1 - r], 2 * p - 1 - r, n, inst, False, False)[1] for r in range(p))
                    for b in compositions(n, 2 * p))
        assert need == pytest.approx(exact, rel=1e-9)
        optimal_v_split(np.ones(n), p, caps=need, **kw)
        with pytest.raises(Infeasible):
            optimal_v_split(np.ones(n), p, caps=need * (1 - 1e-6), **kw)


def test_v_turn_is_free_and_ranks_pair_up():
    # rank 0 holds the first and the last chunk: a V pairs a heavy end with a light start
    t = np.array([1.0, 1, 1, 1, 4, 1])
    bounds, b = optimal_v_split(t, 2)
    assert b == 5.0   # 9 units over 2 ranks, the 4 indivisible
    rank = [t[slice(*bounds[r])].sum() + t[slice(*bounds[3 - r])].sum() for r in range(2)]
    assert max(rank) == 5.0 and sum(rank) == 9.0
    # 4 layers, 4 chunks: the transfer at the turn (chunk 1 -> 2, both on rank 1) is free,
    # the others are charged to the sending chunk's rank
    cut = np.array([0.0, 0.5, 100.0, 0.25, 0.0])
    bounds, b = optimal_v_split(np.ones(4), 2, cut_time=cut)
    assert bounds == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert b == 2.5   # rank 0: 1 + 0.5 + 1; rank 1: 1 + 1 + 0.25


def test_v_split_speed():
    rng = np.random.default_rng(0)
    n, p = 100, 4
    kw = dict(static=rng.random(n) * 1e6, act=rng.random(n) * 1e6, out=rng.random(n) * 1e5, inflight=[4] * 8)
    need, _ = min_v_memory_scale(n, p, **kw)
    t0 = time.process_time()
    optimal_v_split(rng.random(n), p, caps=need * 1.1, **kw)
    assert time.process_time() - t0 < 5.0
