"""Schedules as data: generators, lowering and the validator (pure data, no processes)."""

from __future__ import annotations

import pytest

from engine.schedules import (
    SCHEDULE_INFO,
    SCHEDULES,
    Action,
    Comm,
    Schedule,
    ScheduleError,
    build_schedule,
    chunk_rank,
    chunk_ranks,
    depends_on,
    lower,
    message_ends,
    sends_can_block,
    send_mode,
    peak_inflight,
    validate,
)
from engine.simulate import simulate


def names(acts) -> list[str]:
    return [str(a) for a in acts]


def acts(text: str) -> list[Action]:
    return [Action.parse(t) for t in text.split()]


def valid_grid():
    for p in range(1, 6):
        for m in range(1, 10):
            for name in SCHEDULES:
                info = SCHEDULE_INFO[name]
                if info.chunks_per_rank is None:
                    if m % p == 0:
                        for v in (2, 3):
                            yield name, p, m, v, None
                elif info.memory_knob:
                    for cap in sorted({p, (3 * p - 1) // 2, 2 * p - 1}):
                        yield name, p, m, 1, cap
                elif name != "dualpipev" or m >= 2 * p:
                    yield name, p, m, info.chunks_per_rank, None


GRID = list(valid_grid())


# ----------------------------------------------------------------------------- Action


def test_action_str_and_parse_round_trip():
    a = Action("F", 2, 0)
    assert str(a) == "2F0"
    assert Action.parse("12W34") == Action("W", 12, 34)
    assert Action.parse(str(Action("I", 3, 7))) == Action("I", 3, 7)
    with pytest.raises(ValueError, match="2F0"):
        Action.parse("F2")
    with pytest.raises(ValueError, match="kind"):
        Action("X", 0, 0)


# ----------------------------------------------------------------------------- literal orders


def test_1f1b_p3_m4_literal():
    s = build_schedule("1f1b", 3, 4)
    assert [names(a) for a in s.actions] == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3".split(),
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3".split(),
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3".split(),
    ]


def test_gpipe_p2_m3_literal():
    s = build_schedule("gpipe", 2, 3)
    assert [names(a) for a in s.actions] == [
        "0F0 0F1 0F2 0B0 0B1 0B2".split(),
        "1F0 1F1 1F2 1B0 1B1 1B2".split(),
    ]


def test_interleaved_p2_m4_v2_literal():
    # Megatron: chunks 0,2 on rank 0 and 1,3 on rank 1; rank 0 warms up
    # (p - r - 1) * 2 + (v - 1) * p = 4 forwards, rank 1 two; groups of p microbatches.
    s = build_schedule("interleaved-1f1b", 2, 4, virtual_stages=2)
    assert [names(a) for a in s.actions] == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3".split(),
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3".split(),
    ]


def test_zb_h1_small_case_rules():
    p, m = 3, 5
    s = build_schedule("zb-h1", p, m)
    validate(s)
    for r, row in enumerate(s.actions):
        assert {a.kind for a in row} == {"F", "I", "W"}
        assert len(row) == 3 * m
        assert all(a.stage == r for a in row)
        # same warm-up as 1F1B: its warm-up forwards plus the first steady forward
        warm = min(p - r, m)
        assert [a.kind for a in row[:warm]] == ["F"] * warm
        # forwards and input-gradients in microbatch order (keeps links FIFO)
        assert [a.microbatch for a in row if a.kind == "F"] == list(range(m))
        assert [a.microbatch for a in row if a.kind == "I"] == list(range(m))
        for i in range(m):
            assert row.index(Action("I", r, i)) < row.index(Action("W", r, i))
    # the last rank defers its W's (it would otherwise idle waiting for the next forward)
    assert names(s.actions[p - 1][:4]) == "2F0 2I0 2F1 2I1".split()


# ----------------------------------------------------------------------------- in-flight


@pytest.mark.parametrize("p,m", [(1, 3), (2, 5), (3, 4), (4, 2), (5, 9)])
def test_inflight_gpipe_and_1f1b(p, m):
    g = simulate(build_schedule("gpipe", p, m), 1.0, 2.0)
    o = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    z = simulate(build_schedule("zb-h1", p, m), 1.0, 2.0, weight_s=1.0)
    assert g.peak_inflight == [m] * p
    assert o.peak_inflight == [min(p - r, m) for r in range(p)]
    # H1: the pipeline's peak (first rank's) is 1F1B's; later ranks may hold up to it
    assert max(z.peak_inflight) == max(o.peak_inflight) == min(p, m)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 8, 3), (3, 6, 2), (4, 4, 2), (4, 12, 3)])
def test_inflight_interleaved_per_megatron(p, m, v):
    r_ = simulate(build_schedule("interleaved-1f1b", p, m, v), 1.0, 2.0)
    expected = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        expected.append(min(warm + 1, m * v))
    assert r_.peak_inflight == expected


# ----------------------------------------------------------------------------- validate accepts


@pytest.mark.parametrize("name,p,m,v,cap", GRID,
                         ids=[f"{n}-p{p}-m{m}-v{v}-c{c}" for n, p, m, v, c in GRID])
def test_every_generator_validates(name, p, m, v, cap):
    s = build_schedule(name, p, m, v, max_inflight=cap)
    assert s.num_chunks == p * v and len(s.actions) == p
    validate(s)
    for r in range(p):
        assert {a.stage for a in s.actions[r]} == set(s.stages_of(r))
    assert s.placement == SCHEDULE_INFO[name].placement
    assert {a.kind for row in s.actions for a in row} <= (
        {"F", "I", "W"} if SCHEDULE_INFO[name].splits_backward else {"F", "B"}) | (
        {"B"} if name == "dualpipev" else set())   # its overlapped pairs take full backwards


def test_placement_is_the_one_chunk_to_rank_map():
    v = build_schedule("zbv", 3, 6, virtual_stages=2)
    assert [v.rank_of(c) for c in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [v.stages_of(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert chunk_ranks("zbv", 3, 2) == [0, 1, 2, 2, 1, 0]
    loop = build_schedule("interleaved-1f1b", 3, 6, virtual_stages=2)
    assert [loop.rank_of(c) for c in range(6)] == [0, 1, 2, 0, 1, 2] == chunk_ranks(
        "interleaved-1f1b", 3, 2)
    assert [chunk_rank("v", 2, c) for c in range(8)] == [0, 1, 1, 0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="placement"):
        chunk_rank("zigzag", 2, 0)
    # a hand-written schedule on the V placement is validated against that placement
    ok = Schedule("hand-v", 1, 1, 2, [acts("0F0 1F0 1B0 0B0")], placement="v")
    validate(ok)
    with pytest.raises(ScheduleError, match="chunk 3 lives on rank 0 \\(v placement\\)"):
        validate(Schedule("hand-v", 2, 1, 2, [acts("0F0 0B0"), acts("1F0 2F0 3F0 3B0 2B0 1B0")],
                          placement="v"))
    with pytest.raises(ScheduleError, match="unknown placement"):
        validate(Schedule("x", 1, 1, 1, [acts("0F0 0B0")], placement="zigzag"))


def test_schedule_facts_table():
    assert SCHEDULES == tuple(SCHEDULE_INFO)
    assert {n for n, i in SCHEDULE_INFO.items() if i.splits_backward} == {"zb-h1", "zb-h2", "zbv", "zb-auto",
                                                                          "dualpipev"}
    assert [n for n, i in SCHEDULE_INFO.items() if i.memory_knob] == ["zb-h2", "zb-auto"]
    assert SCHEDULE_INFO["zbv"].virtual_stages() == 2
    assert SCHEDULE_INFO["interleaved-1f1b"].virtual_stages(3) == 3
    assert SCHEDULE_INFO["1f1b"].virtual_stages() == 1


def test_dependency_rule():
    kind = {(2, 0): "I", (1, 0): "B"}
    assert depends_on(Action("F", 0, 0), 3, kind) == []
    assert depends_on(Action("F", 2, 0), 3, kind) == [("F", 1, 0)]
    assert depends_on(Action("B", 1, 0), 3, kind) == [("F", 1, 0), ("I", 2, 0)]
    assert depends_on(Action("I", 2, 0), 3, kind) == [("F", 2, 0)]
    assert depends_on(Action("W", 2, 0), 3, kind) == [("I", 2, 0)]


def test_zbv_is_a_v_with_the_loss_on_rank_zero_and_local_turn():
    p, m = 3, 5
    s = build_schedule("zbv", p, m, virtual_stages=2)
    low = lower(s)
    comms = [op for row in low for op in row if isinstance(op, Comm)]
    # the turn of the V (chunk p-1 -> p, both on rank p-1) is local: no message for it
    assert not any({op.stage, op.message()[1]} == {p - 1, p} for op in comms)
    # every other boundary carries m activations and m gradients, each sent and received
    assert len(comms) == (2 * p - 2) * m * 2 * 2
    assert s.stages_of(0) == [0, 2 * p - 1]
    assert peak_inflight(s) == [2 * p] * p   # 1F1B's p whole-stage microbatches, in half chunks


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "args,match",
    [
        (("pipedream", 2, 4), "1f1b"),
        (("1f1b", 0, 4), "num_stages"),
        (("1f1b", 2, 0), "microbatches"),
        (("gpipe", 2, 4, 2), "virtual_stages=1"),
        (("zb-h1", 2, 4, 3), "virtual_stages=1"),
        (("zbv", 2, 4), "virtual_stages=2"),
        (("zbv", 2, 4, 3), "exactly 2 model chunks"),
        (("interleaved-1f1b", 2, 4, 1), "virtual_stages >= 2"),
        (("interleaved-1f1b", 4, 6, 2), "m=4 or 8"),
        (("1f1b", 2.5, 4), "integer"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)


@pytest.mark.parametrize("name,cap,match", [
    ("1f1b", 3, "only applies to zb-h2"), ("zb-h2", 2, "from num_stages"),
    ("zb-h2", 6, "no further weight gradients; got max_inflight=6"), ("zb-h2", 3.5, "integer")])
def test_bad_max_inflight(name, cap, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(name, 3, 6, max_inflight=cap)


# ----------------------------------------------------------------------------- validate rejects


def hand(p: int, m: int, rows: list[str], v: int = 1) -> Schedule:
    return Schedule("hand", p, m, v, [acts(r) for r in rows])


def rejected(s: Schedule, *needles: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(s)
    msg = str(info.value)
    assert "rank 0" in msg and "rank 1" in msg, msg  # the grid is shown
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_hand_schedule_that_is_right_passes():
    validate(hand(2, 2, ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]))


def test_rejects_backward_before_forward():
    rejected(hand(2, 2, ["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"]), "before 1F0", "[1B0]")


def test_rejects_missing_action():
    rejected(hand(2, 2, ["0F0 0F1 0B0", "1F0 1F1 1B0 1B1"]), "0B1 is missing", "[0F1]")


def test_rejects_duplicated_action():
    rejected(hand(2, 2, ["0F0 0F1 0B0 0B1 0F1", "1F0 1F1 1B0 1B1"]), "twice", "[0F1]")


def test_rejects_action_on_wrong_rank():
    rejected(hand(2, 1, ["0F0 0B0 1F0", "1B0"]), "lives on rank 1", "[1F0]")


def test_rejects_b_mixed_with_i_w():
    rejected(hand(2, 1, ["0F0 0B0 0W0", "1F0 1B0"]), "both", "[0B0]")


def test_rejects_w_before_i():
    rejected(hand(2, 1, ["0F0 0W0 0I0", "1F0 1B0"]), "before 0I0", "[0W0]")


def test_rejects_deadlock_from_one_swap():
    # GPipe with 0B0 and 0F1 swapped: rank 0 waits for 1's gradient before sending 0F1's
    # output, which rank 1 needs before it can run 1B0.
    msg = rejected(hand(2, 2, ["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]), "deadlock", "[0B0]")
    assert "rank 1 waits at 1F1" in msg


def test_rejects_fifo_mismatch():
    # No deadlock with non-blocking sends, but rank 1 receives in a different order than
    # rank 0 sends, which in-order matching (NCCL) would pair wrongly.
    rejected(hand(2, 2, ["0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"]), "order mismatch", "[1F1]")


def test_rejects_local_chunk_order_with_one_rank():
    s = hand(1, 1, ["1F0 0F0 1B0 0B0"], v=2)
    with pytest.raises(ScheduleError, match=r"before 0F0[\s\S]*\[1F0\]"):
        validate(s)


def test_grid_marks_the_action():
    g = build_schedule("1f1b", 2, 2).grid(mark=(1, 2))
    assert "[1F1]" in g and g.count("[") == 2  # the mark and the legend line


# ----------------------------------------------------------------------------- lowering


def test_lower_1f1b_two_ranks():
    low = lower(build_schedule("1f1b", 2, 1))
    assert [str(op) for op in low[0]] == ["0F0", "SEND_F(0,0)->r1", "RECV_B(0,0)<-r1", "0B0"]
    assert [str(op) for op in low[1]] == ["RECV_F(1,0)<-r0", "1F0", "1B0", "SEND_B(1,0)->r0"]


def test_lower_interleaved_edges_and_wraparound():
    s = build_schedule("interleaved-1f1b", 2, 2, virtual_stages=2)
    low = lower(s)
    comms = [op for row in low for op in row if isinstance(op, Comm)]
    # 3 boundaries x 2 microbatches x (send + recv) x (F + B)
    assert len(comms) == 3 * 2 * 2 * 2
    assert Comm("SEND_F", 1, 0, 0) in low[1] and Comm("RECV_F", 2, 0, 1) in low[0]
    assert not any(c.kind == "RECV_F" and c.stage == 0 for c in comms)
    assert not any(c.kind == "RECV_B" and c.stage == 3 for c in comms)
    assert not any(c.kind == "SEND_B" and c.stage == 0 for c in comms)
    for row in low:  # each receive sits right before the compute that needs it
        for k, op in enumerate(row):
            if isinstance(op, Comm) and op.kind.startswith("RECV"):
                nxt = row[k + 1]
                assert isinstance(nxt, Action) and nxt.stage == op.stage
                assert nxt.kind == ("F" if op.kind == "RECV_F" else "B")


def test_lower_single_rank_is_local():
    low = lower(build_schedule("interleaved-1f1b", 1, 3, virtual_stages=3))
    assert all(isinstance(op, Action) for op in low[0])


@pytest.mark.parametrize("name,p,v,ends", [
    ("gpipe", 1, 1, [0]), ("1f1b", 3, 1, [1, 2, 1]), ("zb-h2", 4, 1, [1, 2, 2, 1]),
    ("interleaved-1f1b", 2, 2, [1, 2, 2, 1]),
    ("zbv", 2, 2, [1, 1, 1, 1]),        # chunks 1 and 2 share rank 1: their hand-off is local
    ("zbv", 3, 2, [1, 2, 1, 1, 2, 1])])
def test_message_ends_count_the_cross_rank_cuts_of_each_chunk(name, p, v, ends):
    assert message_ends(build_schedule(name, p, 2 * p, v)) == ends


@pytest.mark.parametrize("name,v,blocking", [
    ("gpipe", 1, True), ("1f1b", 1, True), ("zb-h1", 1, True),
    ("zb-h2", 1, False), ("interleaved-1f1b", 2, False), ("zbv", 2, False)])
@pytest.mark.parametrize("p", [2, 4])
def test_sends_can_block_only_where_every_peer_posts_its_receive_first(name, v, p, blocking):
    assert sends_can_block(build_schedule(name, p, 2 * p, v)) is blocking



@pytest.mark.parametrize("name,v,mode", [
    ("gpipe", 1, "compute"), ("1f1b", 1, "compute"), ("interleaved-1f1b", 2, "yield"),
    ("interleaved-1f1b", 3, "yield"), ("zb-h1", 1, "step"), ("zb-h2", 1, "step"),
    ("zbv", 2, "step")])
@pytest.mark.parametrize("p", [2, 4])
def test_send_mode_waits_where_sends_can_block_and_yields_on_looped_chunks(name, v, p, mode):
    """A mode never waits where waiting could deadlock; the split-backward schedules keep their
    sends pending (a wait would give back the bubble their W fill)."""
    s = build_schedule(name, p, 2 * p, v)
    assert send_mode(s) == mode
    assert mode != "compute" or sends_can_block(s)


def test_sends_can_block_finds_a_wait_cycle_that_nonblocking_sends_avoid():
    # zb-h2, p=2, m=4: before 1W0 rank 1 would wait for SEND_B(1,2), whose receive rank 0 posts
    # after 0I1; before 0I1 rank 0 would wait for SEND_F(0,3), whose receive rank 1 posts after
    # 1W0. With sends left pending until the step ends, the same program completes.
    s = build_schedule("zb-h2", 2, 4)
    validate(s)
    assert not sends_can_block(s)
    # the same cycle cut: rank 1 runs its deferred W after receiving microbatch 3's input
    acts = [list(a) for a in s.actions]
    w0 = acts[1].index(Action("W", 1, 0))
    acts[1].insert(acts[1].index(Action("F", 1, 3)) + 1, acts[1].pop(w0))
    fixed = Schedule("custom", 2, 4, 1, acts)
    validate(fixed)
    assert sends_can_block(fixed)
