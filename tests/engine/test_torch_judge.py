"""Every pipeshard schedule checked by an outside judge: torch.distributed.pipelining.

Each schedule is translated into torch's action format (``_Action`` with a
``_ComputationType``; torch 2.13's ``schedules.py``) and checked with torch's own
``_validate_schedule`` (every chunk's F, then B or I then W, for every microbatch; each
chunk on one rank) and with its communication pass ``_add_send_recv`` followed by its
dry-run simulator ``_simulate_comms_compute``, which raises on a deadlock. torch's
communication pass also skips same-rank hand-offs, so the number of messages it inserts must
equal what ``engine.schedules.lower`` inserts. A broken schedule is shown to be caught.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")
_Action = pipelining._Action
_ComputationType = pipelining._ComputationType

from engine.schedules import (SCHEDULE_INFO, SCHEDULES, Action, Comm, Schedule,  # noqa: E402
                              build_schedule, lower)


def to_torch(schedule: Schedule) -> dict[int, list]:
    """pipeshard's per-rank compute actions as torch's ``pipeline_order``: rank -> [_Action]."""
    kind = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD,
            "I": _ComputationType.BACKWARD_INPUT, "W": _ComputationType.BACKWARD_WEIGHT}
    return {r: [_Action(a.stage, kind[a.kind], a.microbatch) for a in acts]
            for r, acts in enumerate(schedule.actions)}


def judge(schedule: Schedule) -> dict[int, list]:
    """torch's validation, communication pass and deadlock-finding dry run; returns the
    schedule with torch's communication actions."""
    n = schedule.num_chunks
    order = to_torch(schedule)
    mapping = pipelining._validate_schedule(order, schedule.num_stages, n, schedule.microbatches)
    assert mapping == {c: schedule.rank_of(c) for c in range(n)}
    with_comms = pipelining._add_send_recv(copy.deepcopy(order), schedule.rank_of, n)
    pipelining._simulate_comms_compute(copy.deepcopy(with_comms), schedule.rank_of, n)
    return with_comms


def cases():
    for name in SCHEDULES:
        info = SCHEDULE_INFO[name]
        for p in (1, 2, 3, 4, 5):
            for m in sorted({1, 2, p, p + 1, 2 * p + 1, 8} | ({2 * p, 2 * p + 2, 3 * p, 4 * p} if name == "dualpipev" else set())):
                vs = (2, 3) if info.chunks_per_rank is None else (info.chunks_per_rank,)
                caps = sorted({p, 2 * p - 1}) if info.memory_knob else (None,)
                for v in vs:
                    if info.microbatch_multiple and m % p or name == "dualpipev" and m < 2 * p:
                        continue
                    for cap in caps:
                        yield name, p, m, v, cap


CASES = list(cases())


@pytest.mark.parametrize("name", SCHEDULES)
def test_torch_validates_and_simulates_every_schedule(name):
    checked = 0
    for n_, p, m, v, cap in CASES:
        if n_ != name:
            continue
        s = build_schedule(name, p, m, v, max_inflight=cap)
        with_comms = judge(s)
        ours = lower(s)
        for r in range(p):
            theirs = [a for a in with_comms[r]
                      if a.computation_type.value.startswith(("SEND", "RECV"))]
            mine = [op for op in ours[r] if isinstance(op, Comm)]
            assert len(theirs) == len(mine), (name, p, m, v, r)
            assert sorted(str(a) for a in theirs) == sorted(
                f"{c.stage}{c.kind}{c.microbatch}" for c in mine), (name, p, m, v, r)
        checked += 1
    assert checked >= 20


def test_zbv_is_torchs_zbv():
    """pipeshard's zbv runs the same per-rank order as torch's ScheduleZBVZeroBubble."""
    for p in range(1, 6):
        for m in (1, 2, p, 2 * p - 1, 2 * p + 3):
            fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
            ours = to_torch(build_schedule("zbv", p, m, virtual_stages=2))
            for r in range(p):
                theirs = pipelining.ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, r)
                assert [str(a) for a in theirs if a is not None] == [str(a) for a in ours[r]]


def test_dualpipev_is_torchs_dualpipev():
    """pipeshard's dualpipev runs torch's ScheduleDualPipeV per-rank order, each of torch's
    overlapped F+B pairs (OVERLAP_F_B) as its two sub-actions in order."""
    for p in range(1, 6):
        for m in (2 * p, 2 * p + 1, 3 * p + 2, 8):
            if m < 2 * p:
                continue
            fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, _num_stages=2 * p)
            ours = to_torch(build_schedule("dualpipev", p, m, virtual_stages=2))
            for r in range(p):
                theirs = pipelining.ScheduleDualPipeV._calculate_single_rank_operations(fake, r)
                flat = [str(x) for a in theirs if a is not None for x in (a.sub_actions or (a,))]
                assert flat == [str(a) for a in ours[r]], (p, m, r)
                assert any(a.sub_actions for a in theirs if a is not None) == (m > 2 * p - 1 - r or p > 1)


def test_the_judge_catches_broken_schedules():
    acts = lambda text: [Action.parse(t) for t in text.split()]  # noqa: E731
    # a missing weight gradient
    with pytest.raises(AssertionError, match="I and W must have equal counts"):
        judge(Schedule("x", 2, 1, 1, [acts("0F0 0I0 0W0"), acts("1F0 1I0")]))
    # a deadlock: rank 0 waits for 1's gradient before sending what rank 1 needs first
    with pytest.raises((AssertionError, ValueError), match="can't schedule|not progressing"):
        judge(Schedule("x", 2, 2, 1, [acts("0F0 0B0 0F1 0B1"), acts("1F0 1F1 1B0 1B1")]))
