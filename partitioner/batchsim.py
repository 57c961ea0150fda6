"""``engine.simulate`` of one schedule for many candidate splits at once (the planner's refinement).

:func:`engine.simulate.simulate` walks a schedule's actions one by one: an action starts at the
latest of its rank's previous action's end and each dependency's end plus the transfer between
ranks, and ends its cost later. That is a longest path on a fixed graph: only the costs change
from one split to the next. :func:`compile_schedule` builds the graph once per schedule (each
action's previous action on its rank, its dependencies and the boundary each crosses) and sorts
the actions into levels (an action's level is one more than its predecessors'), so that
:func:`simulate_many` runs a level as a few numpy operations over every action of the level and
every candidate. It performs the same additions and maxima on the same numbers as the
event-driven simulator, so the step of each candidate is the same float (checked in
tests/partitioner/test_batchsim.py).

Example::

    import numpy as np
    from partitioner.batchsim import compile_schedule, simulate_many
    sched = compile_schedule("1f1b", 2, 4)
    f = np.array([[1.0, 1.5], [1.0, 0.5]])          # per chunk (rows), per candidate (columns)
    ends = simulate_many(sched, f, 2 * f, f, np.zeros((1, 2)))
    ends.max(axis=0)                                 # each candidate's step
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from engine.schedules import build_schedule, depends_on

__all__ = ["CompiledSchedule", "compile_schedule", "simulate_many"]

_KINDS = ("F", "B", "W", "I")
_CELLS = 1 << 22        # at most this many (action, candidate) floats at once


@dataclass(frozen=True)
class CompiledSchedule:
    """A schedule as a graph: per level, the action indices and, per action, its rank's previous
    action and up to two dependencies with the boundary each crosses (index ``A``: none, a
    zero-time row). ``cost_row[i]``: the row of action ``i`` in the stacked cost table (kind
    ``F, B, W, I`` times the chunk count plus its chunk); ``last[r]``: rank ``r``'s last action."""

    num_ranks: int
    num_chunks: int
    num_actions: int
    cost_row: np.ndarray
    levels: tuple[tuple[np.ndarray, ...], ...]
    last: np.ndarray


@functools.lru_cache(maxsize=64)
def compile_schedule(name: str, num_stages: int, microbatches: int, virtual_stages: int = 1,
                     max_inflight: int | None = None) -> CompiledSchedule:
    """The graph of ``build_schedule(name, ...)`` (cached per layout).

    >>> compile_schedule("1f1b", 2, 2).num_actions
    8
    """
    sched = build_schedule(name, num_stages, microbatches, virtual_stages, max_inflight=max_inflight)
    n, bk = sched.num_chunks, sched.backward_kind
    order = [(r, a) for r, acts in enumerate(sched.actions) for a in acts]
    index = {(a.kind, a.stage, a.microbatch): i for i, (_, a) in enumerate(order)}
    A = len(order)
    prev = np.full(A, A, dtype=np.int64)
    deps = np.full((A, 2), A, dtype=np.int64)
    cross = np.full((A, 2), n - 1, dtype=np.int64)   # row n - 1 of the transfers: zeros
    last = np.full(num_stages, A, dtype=np.int64)
    rank_of = [sched.rank_of(c) for c in range(n)]
    for i, (r, a) in enumerate(order):
        if last[r] != A:
            prev[i] = last[r]
        last[r] = i
        for j, key in enumerate(depends_on(a, n, bk)):
            deps[i, j] = index[key]
            if rank_of[key[1]] != rank_of[a.stage]:
                cross[i, j] = min(key[1], a.stage)
    level = np.zeros(A + 1, dtype=np.int64)
    for i in _topological(sched.actions, prev, deps, A):
        level[i] = 1 + max(level[prev[i]], level[deps[i, 0]], level[deps[i, 1]])
    cost_row = np.array([_KINDS.index(a.kind) * n + a.stage for _, a in order], dtype=np.int64)
    levels = []
    for lv in range(1, int(level[:A].max()) + 1 if A else 1):
        idx = np.nonzero(level[:A] == lv)[0]
        levels.append((idx, prev[idx], deps[idx, 0], cross[idx, 0], deps[idx, 1], cross[idx, 1]))
    return CompiledSchedule(num_stages, n, A, cost_row, tuple(levels), last)


def _topological(actions: list, prev: np.ndarray, deps: np.ndarray, A: int) -> list[int]:
    """The actions in an order where each comes after its predecessors: the event-driven
    simulator's walk (each rank runs its list until an action waits on another rank)."""
    done = np.zeros(A + 1, dtype=bool)
    done[A] = True
    start, ptr, out = [0] * len(actions), [0] * len(actions), []
    for r, acts in enumerate(actions):
        start[r] = start[r - 1] + len(actions[r - 1]) if r else 0
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(actions):
            while ptr[r] < len(acts):
                i = start[r] + ptr[r]
                if not (done[deps[i, 0]] and done[deps[i, 1]]):
                    break
                done[i] = True
                out.append(i)
                ptr[r] += 1
                progress = True
    if len(out) != A:
        raise ValueError("the schedule's actions wait on each other in a cycle")
    return out


def simulate_many(sched: CompiledSchedule, forward: np.ndarray, backward: np.ndarray, weight: np.ndarray,
                  comm: np.ndarray) -> np.ndarray:
    """Per rank, the end of its last action, for each candidate: an array ``(ranks, candidates)``.

    ``forward``, ``backward`` (a B, or I + W), ``weight`` (a W; an I costs ``backward - weight``):
    ``(chunks, candidates)`` with every per-action charge already added, as ``engine.simulate``
    receives them; ``comm``: ``(chunks - 1, candidates)``, the transfer across each boundary."""
    n, C = sched.num_chunks, forward.shape[1]
    out = np.zeros((sched.num_ranks, C))
    step = max(1, _CELLS // max(sched.num_actions, 1))
    for lo in range(0, C, step):
        sl = slice(lo, min(C, lo + step))
        table = np.concatenate([forward[:, sl], backward[:, sl], weight[:, sl], backward[:, sl] - weight[:, sl]])
        cost = table[sched.cost_row]
        trans = np.concatenate([comm[:, sl], np.zeros((1, cost.shape[1]))]) if n > 1 else np.zeros((1, cost.shape[1]))
        end = np.zeros((sched.num_actions + 1, cost.shape[1]))
        for idx, prev, d0, c0, d1, c1 in sched.levels:
            start = np.maximum(end[prev], end[d0] + trans[c0])
            np.maximum(start, end[d1] + trans[c1], out=start)
            end[idx] = start + cost[idx]
        out[:, sl] = end[sched.last]
    return out
