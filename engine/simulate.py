"""Event-driven simulation of a pipeline schedule: step time, bubble, memory, timeline.

Every rank runs its actions in order; an action starts when its rank is free and its
inputs are ready. Data crossing ranks arrives ``comm_s`` after the producer finishes (the
transfer delays the receiver but occupies no rank); data between chunks on one rank is
local and free.

Example::

    >>> from engine.schedules import build_schedule
    >>> r = simulate(build_schedule("1f1b", 4, 8), forward_s=1.0, backward_s=2.0)
    >>> r.step_s, round(r.bubble_fraction, 4), r.peak_inflight
    (33.0, 0.2727, [4, 3, 2, 1])
    >>> r.to_perfetto("trace.json"); r.to_png("timeline.png", "1f1b")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence, Union

from engine.schedules import Action, Schedule, depends_on, peak_inflight, validate

__all__ = ["SimResult", "simulate"]

Cost = Union[float, Sequence[float]]

_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
_LABELS = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}


@dataclass
class SimResult:
    """Outcome of :func:`simulate`; times in seconds from the start of the step."""

    step_s: float
    bubble_fraction: float
    peak_inflight: list[int]
    timeline: list[list[tuple[str, float, float]]]
    steps_s: list[float] = field(default_factory=list)   # per step (``simulate(steps=N)``)
    bubbles: list[float] = field(default_factory=list)   # per step
    tails: list[list[tuple[float, float]]] = field(default_factory=list)   # per rank, per step (``tail_s``)

    def __post_init__(self) -> None:
        self.steps_s = self.steps_s or [self.step_s]
        self.bubbles = self.bubbles or [self.bubble_fraction]

    def to_perfetto(self, path: str | os.PathLike[str]) -> None:
        """Write a Chrome trace (open in ui.perfetto.dev or chrome://tracing)."""
        events: list[dict] = []
        for rank, row in enumerate(self.timeline):
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rank,
                           "args": {"name": f"rank {rank}"}})
            for name, start, end in row:
                a = Action.parse(name)
                events.append({
                    "name": name, "cat": a.kind, "ph": "X", "pid": 0, "tid": rank,
                    "ts": start * 1e6, "dur": (end - start) * 1e6,
                    "args": {"stage": a.stage, "microbatch": a.microbatch},
                })
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)

    def to_png(self, path: str | os.PathLike[str], title: str = "") -> None:
        """Draw the timeline as a Gantt chart (one row per rank) into a PNG file."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        p = len(self.timeline)
        fig = Figure(figsize=(max(6.0, min(24.0, 0.25 * sum(map(len, self.timeline)) / max(p, 1))),
                              0.5 * p + 1.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        span = self.step_s or 1.0
        kinds_seen: list[str] = []
        for rank, row in enumerate(self.timeline):
            for name, start, end in row:
                kind = Action.parse(name).kind
                if kind not in kinds_seen:
                    kinds_seen.append(kind)
                ax.broken_barh([(start, end - start)], (rank - 0.4, 0.8),
                               facecolors=_COLOURS[kind], edgecolors="white", linewidth=0.5)
                if (end - start) / span > 0.025:
                    ax.text((start + end) / 2, rank, name, ha="center", va="center",
                            fontsize=6, color="white")
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_xlim(0, span)
        ax.set_xlabel("time (s)")
        ax.set_title(title or f"step {self.step_s:.4g} s, bubble {self.bubble_fraction:.1%}")
        ax.legend(handles=[Patch(color=_COLOURS[k], label=_LABELS[k]) for k in _KINDS_ORDER
                           if k in kinds_seen], loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  fontsize=7, frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=120)


_KINDS_ORDER = ("F", "B", "I", "W")


def _per_chunk(value: Cost | None, n: int, name: str) -> list[float]:
    values = [float(value)] * n if isinstance(value, (int, float)) else [float(x) for x in value]
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries but the schedule has {n}; give one "
                         f"float for all, or one per {'boundary' if name == 'comm_s' else 'chunk'}")
    if any(x < 0 for x in values):
        raise ValueError(f"{name} must be >= 0, got {values}")
    return values


def simulate(
    schedule: Schedule,
    forward_s: Cost,
    backward_s: Cost,
    weight_s: Cost | None = None,
    comm_s: Cost = 0.0,
    steps: int = 1,
    cores: float | None = None,
    tail_s: Sequence[float] | None = None,
    validate_schedule: bool = True,
) -> SimResult:
    """Simulate ``steps`` consecutive training steps of ``schedule``.

    ``forward_s``, ``backward_s`` (full backward) and ``weight_s`` (its weight-gradient
    part) are one float or one per chunk; ``comm_s`` is one float or one per boundary
    between chunk s and s + 1. An I costs ``backward - weight`` and a W ``weight``; if
    ``weight_s`` is None and the schedule splits backwards, half the backward is assumed.
    Activations count from a chunk's F until its B (or W).

    ``steps > 1``: each rank runs its action list ``steps`` times back to back, with a
    rank-local optimizer step between (the runtime's ``optimizer.step_sync="post_validate"``;
    no synchronisation across ranks: a rank starts step
    k + 1 once it has finished step k and its inputs are there), so step k + 1's warm-up
    overlaps step k's cool-down. ``steps_s[k]`` is step k's time (the largest, over ranks, of
    the time between the rank's ends of steps k - 1 and k), ``bubbles[k]`` its bubble;
    ``step_s`` and ``bubble_fraction`` are the last step's, the steady state. This is the
    paper's bubble rate (arXiv 2401.10241, Table 5), which counts each rank from its own first
    action.

    ``cores``: the ranks share this many processors (a CPU host running more ranks than it has
    cores). When more than ``cores`` ranks compute at once, each progresses at ``cores / busy``
    of its speed (processor sharing, as the OS scheduler time-slices them); None or ``cores >=``
    the rank count: every rank has its own processor (the GPU case). A ``timeline`` entry then
    spans the action's wall time, stretched where it shared.

    ``tail_s``: per rank, seconds of CPU work each rank runs after its last action of every step
    (its optimizer update and the step's bookkeeping), time-shared like an action when the ranks
    share ``cores``; a rank's step then ends at its tail's end (``tails[r][k]``: (start, end)
    of rank r's tail in step k). None: no tail (a rank's step ends with its last action).

    ``validate_schedule=False``: the caller validated it, or a schedule that differs only in where
    its W's sit (a W sends nothing; ``engine.autoschedule``); a deadlock still raises.

    >>> from engine.schedules import build_schedule
    >>> r = simulate(build_schedule("zb-h2", 4, 8), 1.0, 2.0, 1.0, steps=3)
    >>> r.steps_s, r.bubbles[-1]
    ([27.0, 24.0, 24.0], 0.0)
    """
    _check_steps_and_cores(schedule, steps, cores, validate_schedule)
    n = schedule.num_chunks
    fwd = _per_chunk(forward_s, n, "forward_s")
    bwd = _per_chunk(backward_s, n, "backward_s")
    wgt = [b / 2 for b in bwd] if weight_s is None else _per_chunk(weight_s, n, "weight_s")
    if any(w > b for w, b in zip(wgt, bwd)):
        raise ValueError("weight_s is part of backward_s, so it cannot exceed it; check the costs")
    comm = _per_chunk(comm_s, n - 1, "comm_s")
    cost = {"F": fwd, "B": bwd, "W": wgt, "I": [b - w for b, w in zip(bwd, wgt)]}
    m = schedule.microbatches
    actions = [[Action(a.kind, a.stage, a.microbatch + k * m) for k in range(steps) for a in acts]
               for acts in schedule.actions] if steps > 1 else schedule.actions
    kinds = {(s, i + k * m): x for (s, i), x in schedule.backward_kind.items() for k in range(steps)}
    p = schedule.num_stages
    per_rank = [len(acts) for acts in schedule.actions]
    tail = [0.0] * p if tail_s is None else [float(x) for x in tail_s]
    if len(tail) != p or any(x < 0 for x in tail):
        raise ValueError(f"tail_s needs one seconds >= 0 per rank ({p}), got {tail_s!r}")
    tails: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    shared = cores is not None and cores < schedule.num_stages
    timeline = (_run_shared(schedule, actions, kinds, cost, comm, float(cores), (per_rank, tail, tails)) if shared
                else _run(schedule, actions, kinds, cost, comm, (per_rank, tail, tails)))
    busy = sum(e - b for row in timeline for _, b, e in row) / steps
    ends = [[tails[r][k][1] if tail_s is not None and tails[r] else row[(k + 1) * per_rank[r] - 1][2] if per_rank[r] else 0.0
             for k in range(steps)] for r, row in enumerate(timeline)]
    steps_s = [max(e[k] - (e[k - 1] if k else 0.0) for e in ends) for k in range(steps)]
    bubbles = [1.0 - busy / (p * t) if t > 0 else 0.0 for t in steps_s]
    return SimResult(steps_s[-1], bubbles[-1], peak_inflight(schedule), timeline, steps_s, bubbles,
                     tails if tail_s is not None else [])


def _check_steps_and_cores(schedule: Schedule, steps: int, cores: float | None, validate_schedule: bool) -> None:
    """:func:`simulate`'s argument checks (the schedule's validator unless told it ran)."""
    if validate_schedule:
        validate(schedule)
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if cores is not None and cores <= 0:
        raise ValueError(f"cores must be > 0, got {cores!r}")


_Tails = tuple[list[int], list[float], list[list[tuple[float, float]]]]
"""(actions per rank and step, tail seconds per rank, the tails' (start, end) per rank, filled in)."""


def _ends_step(tails: _Tails, r: int, done: int) -> bool:
    """Whether rank ``r``'s ``done``-th action (counting from 1) is its last of a step."""
    per = tails[0][r]
    return per > 0 and done % per == 0


def _run(schedule: Schedule, actions: list[list[Action]], bwd_kind: dict[tuple[int, int], str],
         cost: dict[str, list[float]], comm: list[float], tails: _Tails
         ) -> list[list[tuple[str, float, float]]]:
    """The event-driven run: each rank's actions in order, each as soon as its rank is free and
    its inputs are there; after a step's last action the rank runs its tail (``tails``). Raises
    ``ValueError`` if some rank can never go on (a deadlock)."""
    n, p = schedule.num_chunks, schedule.num_stages
    end: dict[tuple[str, int, int], float] = {}
    waiting: dict[tuple[str, int, int], list[int]] = {}
    free = [0.0] * p
    ptr = [0] * p
    timeline: list[list[tuple[str, float, float]]] = [[] for _ in range(p)]
    queue = deque(range(p))
    while queue:
        r = queue.popleft()
        acts = actions[r]
        while ptr[r] < len(acts):
            a = acts[ptr[r]]
            deps = depends_on(a, n, bwd_kind)
            missing = next((key for key in deps if key not in end), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            start = max([free[r]] + [end[key] + _transfer(schedule, key[1], a.stage, comm)
                                     for key in deps])
            finish = start + cost[a.kind][a.stage]
            key = (a.kind, a.stage, a.microbatch)
            end[key] = finish
            free[r] = finish
            timeline[r].append((str(a), start, finish))
            queue.extend(waiting.pop(key, []))
            ptr[r] += 1
            if _ends_step(tails, r, ptr[r]):
                free[r] = finish + tails[1][r]
                tails[2][r].append((finish, free[r]))
    if any(ptr[r] < len(actions[r]) for r in range(p)):
        raise ValueError("the ranks' action lists deadlock when repeated over steps")
    return timeline


def _run_shared(schedule: Schedule, actions: list[list[Action]], bwd_kind: dict[tuple[int, int], str],
                cost: dict[str, list[float]], comm: list[float], cores: float, tails: _Tails
                ) -> list[list[tuple[str, float, float]]]:
    """:func:`_run` with the ranks sharing ``cores`` processors: a time-ordered (fluid) run in
    which the computing ranks (an action or a step's tail under way) progress at
    ``min(1, cores / computing)`` each. Raises ``ValueError`` on a deadlock, as :func:`_run`."""
    n, p = schedule.num_chunks, schedule.num_stages
    end: dict[tuple[str, int, int], float] = {}
    free, ptr = [0.0] * p, [0] * p
    running: dict[int, list] = {}                   # rank -> [action (None: its tail), work left, start]
    timeline: list[list[tuple[str, float, float]]] = [[] for _ in range(p)]
    t = 0.0
    while True:
        ready = {r: _ready_at(schedule, actions[r][ptr[r]], n, bwd_kind, end, comm, free[r])
                 for r in range(p) if r not in running and ptr[r] < len(actions[r])}
        for r, at in ready.items():
            if at is not None and at <= t:
                a = actions[r][ptr[r]]
                running[r] = [a, cost[a.kind][a.stage], t]
        if not running:
            later = [at for r, at in ready.items() if at is not None and at > t]
            if not later:
                break
            t = min(later)
            continue
        rate = min(1.0, cores / len(running))
        step = min(w for _, w, _ in running.values()) / rate
        later = [at - t for r, at in ready.items() if r not in running and at is not None and at > t]
        step = min([step] + later)
        t += step
        for r in list(running):
            a, left, start = running[r]
            left -= step * rate
            if left > 1e-12 * max(1.0, t):
                running[r][1] = left
                continue
            del running[r]
            free[r] = t
            if a is None:               # the step's tail
                tails[2][r].append((start, t))
                continue
            end[(a.kind, a.stage, a.microbatch)] = t
            timeline[r].append((str(a), start, t))
            ptr[r] += 1
            if _ends_step(tails, r, ptr[r]):
                if tails[1][r] > 0:
                    running[r] = [None, tails[1][r], t]
                else:
                    tails[2][r].append((t, t))
    if any(ptr[r] < len(actions[r]) for r in range(p)):
        raise ValueError("the ranks' action lists deadlock when repeated over steps")
    return timeline


def _ready_at(schedule: Schedule, a: Action, n: int, bwd_kind: dict[tuple[int, int], str],
              end: dict[tuple[str, int, int], float], comm: list[float], free: float) -> float | None:
    """When action ``a`` can start on its free rank (None: an input is not produced yet)."""
    deps = depends_on(a, n, bwd_kind)
    if any(key not in end for key in deps):
        return None
    return max([free] + [end[key] + _transfer(schedule, key[1], a.stage, comm) for key in deps])


def _transfer(schedule: Schedule, src: int, dst: int, comm: list[float]) -> float:
    """Delay between producing chunk ``src``'s data and chunk ``dst`` using it: the boundary's
    transfer time across ranks, nothing within a chunk or between chunks on one rank."""
    if src == dst or schedule.rank_of(src) == schedule.rank_of(dst):
        return 0.0
    return comm[min(src, dst)]
