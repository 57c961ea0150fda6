"""Simulator: closed forms, memory, exports (pure data, no processes)."""

from __future__ import annotations

import json

import pytest

from engine.schedules import build_schedule
from engine.simulate import simulate

PM = [(1, 1), (1, 4), (2, 1), (2, 3), (2, 8), (3, 2), (3, 4), (4, 4), (4, 9), (5, 3), (5, 10)]


@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (0.5, 0.5), (2.0, 1.0)])
def test_gpipe_1f1b_closed_form(name, p, m, f, b):
    r = simulate(build_schedule(name, p, m), f, b)
    assert r.step_s == pytest.approx((m + p - 1) * (f + b))
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 6), (4, 4), (4, 12), (5, 10)])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_per_megatron(p, m, v):
    f, b = 1.0, 2.0
    one = simulate(build_schedule("1f1b", p, m), f, b)
    # same model cut into v times more chunks, each v times cheaper
    il = simulate(build_schedule("interleaved-1f1b", p, m, v), f / v, b / v)
    # Megatron (Narayanan et al. 2021): bubble time shrinks from (p-1)(f+b) to (p-1)(f+b)/v
    assert il.step_s == pytest.approx((m + (p - 1) / v) * (f + b))
    assert il.bubble_fraction < one.bubble_fraction
    assert il.bubble_fraction == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 3), (4, 8), (5, 12)])
def test_zb_h1_bubble_smaller_than_1f1b(p, m):
    f, b = 1.0, 2.0
    one = simulate(build_schedule("1f1b", p, m), f, b)
    zb = simulate(build_schedule("zb-h1", p, m), f, b, weight_s=b / 2)
    assert zb.bubble_fraction < one.bubble_fraction
    # At least (p-1) deferred weight gradients leave the bubble ...
    assert zb.step_s <= m * (f + b) + (p - 1) * (f + b - b / 2) + 1e-9
    # ... and with two stages it reaches the paper's H1 figure m(F+B) + (p-1)(F+I-W).
    if p == 2 and m >= 2:
        assert zb.step_s == pytest.approx(m * (f + b) + (p - 1) * (f + (b - b / 2) - b / 2))
    assert max(zb.peak_inflight) <= max(one.peak_inflight)


@pytest.mark.parametrize("f,b", [([1.0, 3.0, 2.0], [2.0, 5.0, 4.0]), ([3.0, 1.0, 1.0], [1.0, 4.0, 2.0])])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_heterogeneous_bounds(name, f, b):
    # Rank j works m(f_j + b_j), cannot start before the forwards upstream of it, and its
    # last backward still has to travel back upstream. In 1F1B the bottleneck rank is never
    # idle in steady state, so the step stays within one fill/drain of that bound.
    m = 6
    r = simulate(build_schedule(name, 3, m), f, b)
    bound = max(m * (f[j] + b[j]) + sum(f[:j]) + sum(b[:j]) for j in range(3))
    assert bound <= r.step_s + 1e-9
    if name == "1f1b":
        assert r.step_s <= bound + sum(f) + sum(b)


@pytest.mark.parametrize("p,m,c", [(2, 3, 0.25), (4, 5, 1.0)])
def test_comm_gpipe_exact_and_increases_step(p, m, c):
    f, b = 1.0, 2.0
    g = simulate(build_schedule("gpipe", p, m), f, b, comm_s=c)
    # each direction crosses p - 1 links once on the critical path
    assert g.step_s == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * c)
    for name in ("1f1b", "zb-h1"):
        base = simulate(build_schedule(name, p, m), f, b).step_s
        assert simulate(build_schedule(name, p, m), f, b, comm_s=c).step_s > base


def test_comm_per_boundary_and_cost_checks():
    s = build_schedule("1f1b", 3, 2)
    slow_first = simulate(s, 1.0, 2.0, comm_s=[5.0, 0.0]).step_s
    slow_second = simulate(s, 1.0, 2.0, comm_s=[0.0, 5.0]).step_s
    assert slow_first > simulate(s, 1.0, 2.0).step_s and slow_second > simulate(s, 1.0, 2.0).step_s
    with pytest.raises(ValueError, match="boundary"):
        simulate(s, 1.0, 2.0, comm_s=[1.0])
    with pytest.raises(ValueError, match="chunk"):
        simulate(s, [1.0, 1.0], 2.0)
    with pytest.raises(ValueError, match="exceed"):
        simulate(build_schedule("zb-h1", 3, 2), 1.0, 2.0, weight_s=3.0)


def test_timeline_respects_dependencies_and_costs():
    f, b, w = [1.0, 2.0], [3.0, 4.0], [1.0, 1.5]
    r = simulate(build_schedule("zb-h1", 2, 4), f, b, weight_s=w, comm_s=0.5)
    when = {name: (s, e) for row in r.timeline for name, s, e in row}
    assert when["1F2"][0] >= when["0F2"][1] + 0.5
    assert when["0I2"][0] >= when["1I2"][1] + 0.5
    assert when["0W2"][0] >= when["0I2"][1]
    assert when["1I0"][1] - when["1I0"][0] == pytest.approx(4.0 - 1.5)
    assert when["1W0"][1] - when["1W0"][0] == pytest.approx(1.5)
    for row in r.timeline:  # a rank runs one thing at a time
        assert all(a[2] <= bb[1] + 1e-12 for a, bb in zip(row, row[1:]))
    assert r.step_s == max(e for row in r.timeline for _, _, e in row)


def test_perfetto_json(tmp_path):
    s = build_schedule("interleaved-1f1b", 2, 4, virtual_stages=2)
    r = simulate(s, 0.001, 0.002)
    path = tmp_path / "trace.json"
    r.to_perfetto(path)
    events = json.loads(path.read_text())["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == sum(len(a) for a in s.actions)
    assert {e["tid"] for e in xs} == {0, 1} and all(e["pid"] == 0 for e in xs)
    first = next(e for e in xs if e["name"] == "1F0")
    assert first["ts"] == pytest.approx(1000.0) and first["dur"] == pytest.approx(1000.0)


def test_png_written(tmp_path):
    r = simulate(build_schedule("zb-h1", 3, 6), 1.0, 2.0)
    path = tmp_path / "timeline.png"
    assert r.to_png(path, "zb-h1 p=3 m=6") is None
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- zero bubble

COSTS = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 1.2, 0.8), (2.0, 1.0, 1.0), (1.0, 0.5, 1.0),
         (0.5, 2.0, 0.25)]   # (F, I, W) per chunk


def idle_per_rank(r):
    return [r.step_s - sum(e - b for _, b, e in row) for row in r.timeline]


def run_fiw(s, f, i, w, **kw):
    return simulate(s, f, i + w, weight_s=w, **kw)


@pytest.mark.parametrize("p", range(1, 8))
def test_zb_h1_idles_the_papers_bubble_on_every_rank(p):
    # ZB-H1 (arXiv 2401.10241): each rank idles (p-1)(F + I - W) (never less than the fill
    # (p-1)F), for every m >= p; a third of 1F1B's (p-1)(F + I + W) when F = I = W.
    for m in range(p, 3 * p + 3):
        s = build_schedule("zb-h1", p, m)
        for f, i, w in COSTS:
            want = max((p - 1) * f, (p - 1) * (f + i - w))
            assert idle_per_rank(run_fiw(s, f, i, w)) == pytest.approx([want] * p), (m, f, i, w)
        one = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
        assert idle_per_rank(run_fiw(s, 1, 1, 1)) == pytest.approx([x / 3 for x in idle_per_rank(one)])
        # in-flight: every rank holds at most 1F1B's peak (its first rank's p)
        assert run_fiw(s, 1, 1, 1).peak_inflight == [p] * p == [max(one.peak_inflight)] * p


def test_zb_h1_issue_cases_and_fewer_microbatches_than_stages():
    # the issue's table: simulate(s, forward_s=1, backward_s=2, weight_s=1)
    for p, m, idle in ((2, 7, 1.0), (3, 6, 2.0)):
        r = simulate(build_schedule("zb-h1", p, m), 1.0, 2.0, weight_s=1.0)
        assert idle_per_rank(r) == pytest.approx([idle] * p)
    for p in range(2, 8):
        for m in range(1, p):   # the fill cannot be covered: (p-1) + (p-m) units, still < 1F1B
            s = build_schedule("zb-h1", p, m)
            r = run_fiw(s, 1, 1, 1)
            assert idle_per_rank(r) == pytest.approx([(p - 1) + (p - m)] * p)
            assert r.peak_inflight == [m] * p
            assert r.step_s < simulate(build_schedule("1f1b", p, m), 1.0, 2.0).step_s


@pytest.mark.parametrize("p", range(1, 7))
def test_zb_h2_memory_knob_trades_inflight_for_bubble(p):
    # x = max_inflight - p extra microbatches per rank take x weight-gradients off ZB-H1's
    # bubble per rank, down to the fill (p-1)F: max((p-1)F, (p-1)(F+I-W) - x W).
    for m in sorted({p, p + 1, 2 * p - 1, 2 * p, 3 * p + 1}):
        for cap in range(p, 2 * p):
            s = build_schedule("zb-h2", p, m, max_inflight=cap)
            x = min(cap - p, m - p)
            h1 = build_schedule("zb-h1", p, m)
            for f, i, w in COSTS:
                got = idle_per_rank(run_fiw(s, f, i, w))
                assert got == pytest.approx([max((p - 1) * f, (p - 1) * (f + i - w) - x * w)] * p)
                assert max(got) <= min(idle_per_rank(run_fiw(h1, f, i, w))) + 1e-9
            assert run_fiw(s, 1, 1, 1).peak_inflight == [min(m, p + x)] * p
    # the default is the paper's H2: 2p - 1 in flight, only the fill left when I <= 2W
    s = build_schedule("zb-h2", p, 3 * p)
    assert s.max_inflight == 2 * p - 1
    assert idle_per_rank(run_fiw(s, 1.0, 1.5, 0.75)) == pytest.approx([p - 1.0] * p)


@pytest.mark.parametrize("p", range(1, 7))
def test_zbv_idles_only_the_fill_at_1f1b_memory(p):
    # ZB-V with equal per-chunk F = I = W: each rank idles only the fill, p - 1 chunk
    # forwards (half of ZB-H1's bubble on the same model: a chunk is half a stage), and holds
    # 2p chunk activations, i.e. 1F1B's p microbatches of a whole stage.
    for m in range(2 * p - 1, 4 * p + 2):
        s = build_schedule("zbv", p, m, virtual_stages=2)
        for f in (1.0, 0.5):
            r = run_fiw(s, f, f, f)
            assert idle_per_rank(r) == pytest.approx([(p - 1) * f] * p)
            assert r.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
            h1 = run_fiw(build_schedule("zb-h1", p, m), 2 * f, 2 * f, 2 * f)
            assert idle_per_rank(h1) == pytest.approx([2 * x for x in idle_per_rank(r)])
        assert r.peak_inflight == [2 * p] * p
        assert 2 * max(simulate(build_schedule("1f1b", p, m), 1, 2).peak_inflight) == 2 * p


def test_same_rank_hand_off_is_free():
    # zbv's turn (chunk p-1 -> p) stays on rank p-1: its boundary's transfer time is never paid
    p, m = 3, 6
    s = build_schedule("zbv", p, m, virtual_stages=2)
    comm = [0.0] * (2 * p - 1)
    base = simulate(s, 1.0, 2.0, weight_s=1.0, comm_s=comm).step_s
    comm[p - 1] = 100.0
    assert simulate(s, 1.0, 2.0, weight_s=1.0, comm_s=comm).step_s == base
    comm[p - 2] = 100.0   # a real link: paid
    assert simulate(s, 1.0, 2.0, weight_s=1.0, comm_s=comm).step_s > base + 100


def test_shared_cores_time_share_the_computing_ranks():
    """gpipe, p = 2, m = 2, F = B = 1 on one core: F0 of microbatch 1 and F1 of microbatch 0
    run together at half speed (1 -> 3), and the step is the whole work done serially."""
    s = build_schedule("gpipe", 2, 2)
    alone = simulate(s, 1.0, 1.0)
    one = simulate(s, 1.0, 1.0, cores=1)
    assert alone.step_s == 6.0 and one.step_s == 8.0
    assert ("0F1", 1.0, 3.0) in [(n, b, e) for n, b, e in one.timeline[0]]
    assert ("1F0", 1.0, 3.0) in [(n, b, e) for n, b, e in one.timeline[1]]


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zbv"])
def test_shared_cores_bounds(name):
    """With cores >= ranks nothing changes; one core runs the total work serially (comm 0:
    some rank can always go on); in between, the step is at least the unshared step and the
    total work over the cores."""
    v = 2 if name in ("interleaved-1f1b", "zbv") else 1
    s = build_schedule(name, 3, 6, v)
    f, b, w = [1.0, 1.5, 0.5, 1.0, 2.0, 0.7][:3 * v], 2.5, 1.0
    alone = simulate(s, f, b, w)
    assert simulate(s, f, b, w, cores=3).timeline == alone.timeline
    total = sum(e - a for row in alone.timeline for _, a, e in row)
    assert simulate(s, f, b, w, cores=1).step_s == pytest.approx(total)
    two = simulate(s, f, b, w, cores=2).step_s
    assert two >= alone.step_s - 1e-9 and two >= total / 2 - 1e-9
    with pytest.raises(ValueError, match="cores"):
        simulate(s, f, b, w, cores=0)


def test_a_steps_tail_is_time_shared_work():
    """1f1b, p = 3, m = 1, F = 1, B = 2, a tail of 1 per rank. On its own processor each rank
    ends at its last B + 1: rank 0's B ends at 9, so 10. On one core: F0 F1 F2 B2 run alone
    (0-5); rank 2's tail and B1 then share the core from 5: the tail (1 of work) ends at 7, B1
    at 8; rank 1's tail and B0 share it from 8: 10 and 11; rank 0's tail alone 11-12 (the total
    work, 12, serially). Without ``tail_s`` nothing changes."""
    s = build_schedule("1f1b", 3, 1)
    own = simulate(s, 1.0, 2.0, tail_s=[1.0] * 3)
    one = simulate(s, 1.0, 2.0, cores=1, tail_s=[1.0] * 3)
    assert own.step_s == 10.0 and own.tails == [[(9.0, 10.0)], [(7.0, 8.0)], [(5.0, 6.0)]]
    assert one.step_s == pytest.approx(12.0)
    assert [t[0] for t in one.tails] == [pytest.approx((11.0, 12.0)), pytest.approx((8.0, 10.0)),
                                         pytest.approx((5.0, 7.0))]
    assert simulate(s, 1.0, 2.0, cores=1).step_s == pytest.approx(9.0) and simulate(s, 1.0, 2.0).tails == []
    three = simulate(s, 1.0, 2.0, steps=2, cores=1, tail_s=[1.0] * 3)
    assert three.steps_s == [pytest.approx(12.0)] * 2
    with pytest.raises(ValueError, match="tail_s"):
        simulate(s, 1.0, 2.0, tail_s=[1.0])
