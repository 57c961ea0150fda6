"""Pipeline schedules as data.

A schedule is, for every pipeline rank, the ordered list of compute actions it runs:
``F`` (forward), ``B`` (full backward), or ``I`` / ``W`` (the input-gradient and
weight-gradient halves of a backward, for zero-bubble schedules), and the placement of
its model chunks on ranks (:meth:`Schedule.rank_of`). Communication is not part of a
schedule; :func:`lower` derives it (a hand-off between two chunks on one rank is local),
and :func:`validate` proves that the derived program is complete, respects data
dependencies (:func:`depends_on`, the one rule the simulator also uses), cannot deadlock
and keeps message order consistent at both ends of every link.

Per-schedule facts (placement, chunks per rank, split backward, memory knob) are in
:data:`SCHEDULE_INFO`; read them instead of copying tables.

Example::

    >>> s = build_schedule("1f1b", num_stages=2, microbatches=3)
    >>> [str(a) for a in s.actions[0]]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    >>> validate(s)  # raises ScheduleError (with a grid) if anything is wrong
    >>> v = build_schedule("zbv", 2, 4, virtual_stages=2)
    >>> [v.rank_of(c) for c in range(4)], v.stages_of(0)
    ([0, 1, 1, 0], [0, 3])
"""

from __future__ import annotations

import functools
import operator
import re
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence, Union

__all__ = [
    "ActionKind",
    "Action",
    "Schedule",
    "Comm",
    "SCHEDULES",
    "SCHEDULE_INFO",
    "ScheduleInfo",
    "PLACEMENTS",
    "chunk_rank",
    "chunk_ranks",
    "depends_on",
    "peak_inflight",
    "message_ends",
    "sends_can_block",
    "sends_waited_before_compute",
    "send_mode",
    "build_schedule",
    "validate",
    "ScheduleError",
    "lower",
    "register_cost_builder",
]

ActionKind = Literal["F", "B", "I", "W"]
Cost = Union[float, Sequence[float]]
_KINDS = ("F", "B", "I", "W")
_ACTION_RE = re.compile(r"^\s*(\d+)([FBIW])(\d+)\s*$")

PLACEMENTS: tuple[str, ...] = ("loop", "v")


@dataclass(frozen=True)
class ScheduleInfo:
    """What a schedule needs and does, for code that must not copy per-schedule tables.

    ``placement``: ``"loop"`` (chunk s on rank s % p, Megatron) or ``"v"`` (chunk s on rank
    s for s < p, on rank 2p-1-s after: the first and last chunks share rank 0).
    ``chunks_per_rank``: a fixed number of model chunks per rank, or None when
    ``virtual_stages`` (>= 2) chooses it. ``splits_backward``: runs I and W separately
    (dualpipev: some; its overlapped F+B pairs take full backwards).
    ``memory_knob``: accepts ``max_inflight`` (microbatches a rank may hold).
    ``microbatch_multiple``: microbatches must be a multiple of the stage count.

    >>> SCHEDULE_INFO["zbv"].chunks_per_rank, SCHEDULE_INFO["zbv"].placement
    (2, 'v')
    """

    name: str
    placement: str = "loop"
    chunks_per_rank: int | None = 1
    splits_backward: bool = False
    memory_knob: bool = False
    microbatch_multiple: bool = False

    def virtual_stages(self, requested: int = 1) -> int:
        """Chunks per rank this schedule runs when ``virtual_stages=requested`` is asked for."""
        return self.chunks_per_rank or requested


SCHEDULE_INFO: dict[str, ScheduleInfo] = {i.name: i for i in (
    ScheduleInfo("gpipe"),
    ScheduleInfo("1f1b"),
    ScheduleInfo("interleaved-1f1b", chunks_per_rank=None, microbatch_multiple=True),
    ScheduleInfo("zb-h1", splits_backward=True),
    ScheduleInfo("zb-h2", splits_backward=True, memory_knob=True),
    ScheduleInfo("zbv", placement="v", chunks_per_rank=2, splits_backward=True),
    ScheduleInfo("zb-auto", splits_backward=True, memory_knob=True),
    ScheduleInfo("dualpipev", placement="v", chunks_per_rank=2, splits_backward=True),
)}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_INFO)


def chunk_rank(placement: str, num_stages: int, chunk: int) -> int:
    """The rank that holds model chunk ``chunk`` under ``placement`` with ``num_stages`` ranks.

    >>> [chunk_rank("v", 3, c) for c in range(6)], [chunk_rank("loop", 3, c) for c in range(6)]
    ([0, 1, 2, 2, 1, 0], [0, 1, 2, 0, 1, 2])
    """
    lap, pos = divmod(chunk, num_stages)
    if placement == "loop":
        return pos
    if placement == "v":
        return pos if lap % 2 == 0 else num_stages - 1 - pos
    raise ValueError(f"unknown placement {placement!r}; use one of {PLACEMENTS}")


def chunk_ranks(name: str, num_stages: int, virtual_stages: int = 1) -> list[int]:
    """Rank of every chunk of schedule ``name`` (chunk order), e.g. for a planner that has no
    ``Schedule`` at hand.

    >>> chunk_ranks("zbv", 2, 2), chunk_ranks("interleaved-1f1b", 2, 2)
    ([0, 1, 1, 0], [0, 1, 0, 1])
    """
    info = _info(name)
    n = num_stages * info.virtual_stages(virtual_stages)
    return [chunk_rank(info.placement, num_stages, c) for c in range(n)]


def _info(name: str) -> ScheduleInfo:
    info = SCHEDULE_INFO.get(str(name).lower())
    if info is None:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return info


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rule and shows the marked grid."""


@dataclass(frozen=True)
class Action:
    """One compute step: ``kind`` on model chunk ``stage`` for ``microbatch``.

    >>> str(Action("F", 2, 0)), Action.parse("1B3")
    ('2F0', Action(kind='B', stage=1, microbatch=3))
    """

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Action kind must be one of {_KINDS}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(
                f"Action stage and microbatch must be >= 0, got stage={self.stage}, "
                f"microbatch={self.microbatch}"
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse ``"<stage><kind><microbatch>"``, e.g. ``"2F0"``."""
        match = _ACTION_RE.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><F|B|I|W><microbatch>, e.g. '2F0'"
            )
        return cls(match.group(2), int(match.group(1)), int(match.group(3)))


@dataclass(frozen=True)
class Comm:
    """A point-to-point transfer inserted by :func:`lower`.

    ``stage`` is the chunk on the rank that runs this op whose data moves:
    SEND_F: output of ``stage`` -> ``peer``; RECV_F: input of ``stage`` <- ``peer``;
    SEND_B: grad w.r.t. input of ``stage`` -> ``peer``; RECV_B: grad w.r.t. output of
    ``stage`` <- ``peer``.
    """

    kind: str
    stage: int
    microbatch: int
    peer: int

    def __str__(self) -> str:
        arrow = "->" if self.kind.startswith("SEND") else "<-"
        return f"{self.kind}({self.stage},{self.microbatch}){arrow}r{self.peer}"

    def message(self) -> tuple[str, int, int]:
        """Identity of the message: (channel, sending chunk, microbatch)."""
        if self.kind == "SEND_F":
            return ("F", self.stage, self.microbatch)
        if self.kind == "RECV_F":
            return ("F", self.stage - 1, self.microbatch)
        if self.kind == "SEND_B":
            return ("B", self.stage, self.microbatch)
        return ("B", self.stage + 1, self.microbatch)


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions, and where each chunk lives (``placement``, see
    :data:`PLACEMENTS`; :meth:`rank_of` is the one chunk-to-rank map everything reads).

    >>> s = build_schedule("gpipe", 2, 2)
    >>> s.num_chunks, s.rank_of(1), s.stages_of(0)
    (2, 1, [0])
    >>> print(s.grid())  # doctest: +SKIP
    """

    name: str
    num_stages: int
    microbatches: int
    virtual_stages: int
    actions: list[list[Action]]
    placement: str = "loop"
    max_inflight: int | None = None   # the memory knob's bound, for schedules that have one

    @property
    def num_chunks(self) -> int:
        return self.num_stages * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The rank that runs model chunk ``stage``."""
        return chunk_rank(self.placement, self.num_stages, stage)

    def stages_of(self, rank: int) -> list[int]:
        """The chunks ``rank`` runs, in chunk order."""
        return [s for s in range(self.num_chunks) if self.rank_of(s) == rank]

    @functools.cached_property
    def checked(self) -> bool:
        """True once :func:`validate` passed (it checks a schedule once; a failure is not
        cached, so it raises again)."""
        _validate(self)
        return True

    @functools.cached_property
    def backward_kind(self) -> dict[tuple[int, int], str]:
        """``(chunk, microbatch) -> "B" | "I"``: how that backward's input gradient is made."""
        return {(a.stage, a.microbatch): a.kind for acts in self.actions for a in acts
                if a.kind in ("B", "I")}

    def grid(self, mark: tuple[int, int] | None = None) -> str:
        """Text grid: one row per rank, one column per step of that rank's list.

        ``mark=(rank, index)`` surrounds that action with ``[ ]`` (an index past the end
        of the row marks a missing action).
        """
        rows = [[str(a) for a in acts] for acts in self.actions]
        width = max((len(c) for row in rows for c in row), default=3) + 2
        ncols = max((len(row) for row in rows), default=0)
        label_w = len(f"rank {max(len(rows) - 1, 0)}") + 1
        lines = [
            f"schedule {self.name!r} p={self.num_stages} m={self.microbatches} "
            f"v={self.virtual_stages} placement={self.placement} "
            "(rows: ranks; columns: step index on that rank)",
            " " * label_w + "".join(f"{j:^{width}}" for j in range(ncols)).rstrip(),
        ]
        for r, cells in enumerate(rows):
            parts = []
            for j, cell in enumerate(cells):
                parts.append((f"[{cell}]" if mark == (r, j) else cell).center(width))
            if mark is not None and mark[0] == r and mark[1] >= len(cells):
                parts.append("[?]".center(width))
            lines.append((f"rank {r}".ljust(label_w) + "".join(parts)).rstrip())
        if mark is not None:
            lines.append(f"[...] marks rank {mark[0]}, step {mark[1]}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.grid()


def depends_on(action: Action, num_chunks: int,
               backward_kind: Mapping[tuple[int, int], str]) -> list[tuple[str, int, int]]:
    """The actions whose results ``action`` consumes, as ``(kind, chunk, microbatch)``: the
    one dependency rule (the validator and the simulator both use it). A forward needs the
    previous chunk's forward; a backward (B or I) its own forward and the next chunk's
    backward (whose kind ``backward_kind`` gives); a W its I.

    >>> depends_on(Action("I", 1, 0), 3, {(2, 0): "B"})
    [('F', 1, 0), ('B', 2, 0)]
    """
    s, i = action.stage, action.microbatch
    if action.kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if action.kind == "W":
        return [("I", s, i)]
    deps = [("F", s, i)]
    if s < num_chunks - 1:
        deps.append((backward_kind[(s + 1, i)], s + 1, i))
    return deps


def message_ends(schedule: Schedule) -> list[int]:
    """Per chunk, the cross-rank messages each of its F actions sends or receives: its input
    from the previous chunk and its output to the next, each if that chunk is on another rank.
    Its B (or I) has as many (the gradients go the other way); a W none.

    >>> message_ends(build_schedule("1f1b", 2, 4)), message_ends(build_schedule("zbv", 2, 4, 2))
    ([1, 1], [1, 1, 1, 1])
    >>> message_ends(build_schedule("interleaved-1f1b", 2, 4, 2))
    [1, 2, 2, 1]
    """
    n = schedule.num_chunks
    cross = [schedule.rank_of(s) != schedule.rank_of(s + 1) for s in range(n - 1)]
    return [int(s > 0 and cross[s - 1]) + int(s < n - 1 and cross[s]) for s in range(n)]


def peak_inflight(schedule: Schedule) -> list[int]:
    """Per rank, the most microbatch-chunks whose activations it holds at once: an F adds
    one until its B (or, for a split backward, its W) releases it.

    >>> peak_inflight(build_schedule("1f1b", 3, 8))
    [3, 2, 1]
    """
    out = []
    for acts in schedule.actions:
        held = peak = 0
        for a in acts:
            if a.kind == "F":
                held += 1
                peak = max(peak, held)
            elif a.kind in ("B", "W"):
                held -= 1
        out.append(peak)
    return out


# --------------------------------------------------------------------------- generators


def _int_arg(value: object, name: str) -> int:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def build_schedule(
    name: str, num_stages: int, microbatches: int, virtual_stages: int = 1, *,
    max_inflight: int | Sequence[int] | None = None, forward_s: Cost | None = None, backward_s: Cost | None = None,
    weight_s: Cost | None = None, comm_s: Cost | None = None, steps: int = 1,
    weight_hold: float = 1.0, max_pending: int | Sequence[int] | None = None,
) -> Schedule:
    """Build a named schedule for ``num_stages`` ranks and ``microbatches`` microbatches.

    ``virtual_stages``: chunks per rank (``interleaved-1f1b``: 2 or more; ``zbv``: 2).
    ``max_inflight`` (``zb-h2`` only): the most microbatches a rank may hold, from
    ``num_stages`` (as zb-h1) to ``2 * num_stages - 1`` (the default, ZB-H2); each one
    above ``num_stages`` removes one weight-gradient time per rank from zb-h1's bubble
    (see ``_zb_h2``).

    ``zb-auto`` (``engine.autoschedule``) is built from costs: ``forward_s``, ``backward_s``
    (the full backward), ``weight_s`` (its weight-gradient part) per chunk and ``comm_s`` per
    boundary, each one float or a list (the simulator's arguments; default 1, 2, 1 and 0, the
    paper's F = I = W), under ``max_inflight`` (default ``num_stages``, 1F1B's memory; 2p is
    the paper's ZB-2p; or one bound per rank: the schedule's ``max_inflight`` is then the
    largest), for ``steps`` consecutive steps (1: the optimizer step synchronises the
    ranks, as pipeshard's runtime does; more: the steady state of a rank-local step).
    ``weight_hold``: the part of a microbatch's memory still held between its I and its W, for
    the bound (1, pipeshard's runtime, which keeps the saved tensors until W; the paper's GPT
    accounting keeps 32h of 34h + 5as, about 0.43). ``max_pending`` (one int or one per rank,
    >= 1): the most microbatches whose I has run and W not yet (a plan bounds them by its memory
    model's). The costs are part of its identity: the same arguments build the same schedule.

    >>> build_schedule("interleaved-1f1b", 2, 4, virtual_stages=2).num_chunks
    4
    >>> build_schedule("zb-h2", 4, 8, max_inflight=6).max_inflight
    6
    """
    info = _info(name)
    p = _int_arg(num_stages, "num_stages")
    m = _int_arg(microbatches, "microbatches")
    v = _int_arg(virtual_stages, "virtual_stages")
    if p < 1:
        raise ValueError(f"num_stages must be >= 1, got {p}")
    if m < 1:
        raise ValueError(f"microbatches must be >= 1, got {m}")
    _check_virtual(info, p, m, v)
    cap = _check_inflight(info, p, max_inflight)
    costs = _auto_costs(info.name, p, forward_s, backward_s, weight_s, comm_s, steps, weight_hold,
                        max_pending)
    if costs is not None:
        return _built_auto(p, m, cap, *costs)  # type: ignore[arg-type]
    return _built(info.name, p, m, v, cap)


def _auto_costs(name: str, p: int, forward_s: Cost | None, backward_s: Cost | None,
                weight_s: Cost | None, comm_s: Cost | None, steps: int,
                weight_hold: float = 1.0, max_pending: int | Sequence[int] | None = None) -> tuple | None:
    """zb-auto's costs as hashable per-chunk tuples (None for another schedule, which takes
    none)."""
    given = [x is not None for x in (forward_s, backward_s, weight_s, comm_s)]
    if name != "zb-auto":
        if any(given) or steps != 1 or weight_hold != 1.0 or max_pending is not None:
            raise ValueError(f"forward_s, backward_s, weight_s, comm_s, steps, weight_hold and max_pending build zb-auto "
                             f"from costs; {name!r} takes none of them: drop them")
        return None

    def per(value: Cost | None, default: float, n: int, what: str) -> tuple[float, ...]:
        if value is None:
            return (default,) * n
        vals = [float(value)] * n if isinstance(value, (int, float)) else [float(x) for x in value]
        if len(vals) != n or any(not x >= 0 for x in vals):
            raise ValueError(f"zb-auto's {what} must be one float >= 0 or {n} of them "
                             f"(one per {'boundary' if what == 'comm_s' else 'chunk'}), got {value!r}")
        return tuple(vals)

    f = per(forward_s, 1.0, p, "forward_s")
    b = per(backward_s, 2.0, p, "backward_s")
    w = per(weight_s, 0.0, p, "weight_s") if weight_s is not None \
        else tuple(x / 2 for x in b)
    if any(x > y for x, y in zip(w, b)):
        raise ValueError(f"zb-auto's weight_s is part of backward_s, so it cannot exceed it: "
                         f"weight_s={list(w)}, backward_s={list(b)}")
    c = per(comm_s, 0.0, max(p - 1, 0), "comm_s")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not 0.0 <= float(weight_hold) <= 1.0:
        raise ValueError(f"weight_hold is a fraction of a microbatch's memory, in [0, 1]; got "
                         f"{weight_hold!r}")
    pend = None
    if max_pending is not None:
        pend = (tuple([_int_arg(max_pending, "max_pending")] * p) if isinstance(max_pending, int)
                else tuple(_int_arg(x, "max_pending") for x in max_pending))
        if len(pend) != p or min(pend) < 1:
            raise ValueError(f"zb-auto's max_pending must be one int >= 1 or {p} of them (one per "
                             f"rank), got {max_pending!r}")
    return f, b, w, c, int(steps), float(weight_hold), pend


@functools.lru_cache(maxsize=64)
def _built_auto(p: int, m: int, cap: int | tuple[int, ...], f: tuple[float, ...], b: tuple[float, ...],
                w: tuple[float, ...], c: tuple[float, ...], steps: int, hold: float,
                pending: tuple[int, ...] | None = None) -> Schedule:
    top = cap if isinstance(cap, int) else max(cap)
    build = _COST_BUILDERS["zb-auto"]
    return Schedule("zb-auto", p, m, 1, build(p, m, cap, f, b, w, c, steps, hold=hold, pending=pending),
                    "loop", top)


_COST_BUILDERS: dict[str, Callable[..., list[list[Action]]]] = {}


def register_cost_builder(name: str, build: Callable[..., list[list[Action]]]) -> None:
    """Install the function that builds schedule ``name`` from costs. ``engine.autoschedule``
    registers zb-auto's on import (``import engine`` imports it: this module cannot import it,
    as it scores its orders with the simulator, which imports this module)."""
    _COST_BUILDERS[name] = build


@functools.lru_cache(maxsize=256)
def _built(name: str, p: int, m: int, v: int, cap: int | None) -> Schedule:
    """A named schedule is a pure function of its arguments: built once and shared (a
    planner searching layouts asks for the same one many times; ``validate`` then checks it
    once). Treat a built schedule as read-only."""
    if name == "zb-auto":
        return _built_auto(p, m, cap, *_auto_costs(name, p, None, None, None, None, 1))  # type: ignore
    if name == "interleaved-1f1b":
        actions = _interleaved(p, m, v)
    elif name == "zb-h2":
        actions = _zb_h2(p, m, cap)  # type: ignore[arg-type]
    else:
        actions = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb-h1": _zb_h1, "zbv": _zbv,
                   "dualpipev": _dualpipev}[name](p, m)
    return Schedule(name, p, m, v, actions, SCHEDULE_INFO[name].placement, cap)


def _check_virtual(info: ScheduleInfo, p: int, m: int, v: int) -> None:
    if info.chunks_per_rank is None:
        if v < 2:
            raise ValueError(
                f"{info.name} needs virtual_stages >= 2 (model chunks per rank), got {v}; "
                "pass virtual_stages=2 or more, or use '1f1b'")
    elif v != info.chunks_per_rank:
        if info.chunks_per_rank == 1:
            raise ValueError(
                f"virtual_stages={v} only applies to schedules with several chunks per rank "
                f"(interleaved-1f1b, zbv); pass virtual_stages=1 for {info.name!r}")
        raise ValueError(
            f"{info.name} runs exactly {info.chunks_per_rank} model chunks per rank "
            f"({info.placement} placement); pass virtual_stages={info.chunks_per_rank} and "
            f"{info.chunks_per_rank} x num_stages stage ranges, got virtual_stages={v}")
    if info.name == "dualpipev" and m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2 * num_stages microbatches (one per chunk of "
                         f"its V, as torch's ScheduleDualPipeV), got m={m}, p={p}: use m >= {2 * p}")
    if info.microbatch_multiple and m % p:
        lo, hi = (m // p) * p, (m // p + 1) * p
        hint = f"{lo} or {hi}" if lo else f"{hi}"
        raise ValueError(
            f"{info.name} needs microbatches to be a multiple of num_stages "
            f"(microbatches run in groups of p, as in Megatron); got m={m}, p={p}: use m={hint}")


def _check_inflight(info: ScheduleInfo, p: int, max_inflight: int | Sequence[int] | None
                    ) -> int | tuple[int, ...] | None:
    if info.name == "zb-auto":
        if max_inflight is not None and not isinstance(max_inflight, int):   # one per rank
            caps = tuple(_int_arg(x, "max_inflight") for x in max_inflight)  # type: ignore[union-attr]
            if len(caps) != p or min(caps) < 1:
                raise ValueError(f"zb-auto's max_inflight must be one int >= 1 or {p} of them (one "
                                 f"per rank), got {max_inflight!r}")
            return caps if len(set(caps)) > 1 else caps[0]   # type: ignore[return-value]
        cap = p if max_inflight is None else _int_arg(max_inflight, "max_inflight")
        if cap < 1:
            raise ValueError(f"zb-auto's max_inflight (microbatches a rank may hold) must be >= 1, "
                             f"got {cap}; num_stages ({p}) is 1F1B's memory, 2 * num_stages ZB-2p's")
        return cap
    if not info.memory_knob:
        if max_inflight is not None:
            knobs = [n for n, i in SCHEDULE_INFO.items() if i.memory_knob]
            raise ValueError(f"max_inflight only applies to {', '.join(knobs)}; "
                             f"drop it for {info.name!r}")
        return None
    cap = 2 * p - 1 if max_inflight is None else _int_arg(max_inflight, "max_inflight")
    if not p <= cap <= 2 * p - 1:
        raise ValueError(f"{info.name} takes max_inflight from num_stages ({p}, zb-h1's memory) "
                         f"to 2 * num_stages - 1 ({2 * p - 1}, ZB-H2's): more lets each rank "
                         f"defer no further weight gradients; got max_inflight={cap}")
    return cap


def _gpipe(p: int, m: int) -> list[list[Action]]:
    return [
        [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
        for r in range(p)
    ]


def _one_f_one_b(p: int, m: int) -> list[list[Action]]:
    out = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action("F", r, i) for i in range(warm)]
        for k in range(m - warm):
            acts += [Action("F", r, warm + k), Action("B", r, k)]
        acts += [Action("B", r, k) for k in range(m - warm, m)]
        out.append(acts)
    return out


def _interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B (looped placement, microbatch groups of size p)."""
    total = m * v

    def unit(rank: int, k: int, kind: str) -> Action:
        group, rem = divmod(k, p * v)
        chunk = rem // p
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, chunk * p + rank, group * p + rem % p)

    out = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [unit(r, k, "F") for k in range(warm)]
        for k in range(total - warm):
            acts += [unit(r, warm + k, "F"), unit(r, k, "B")]
        acts += [unit(r, k, "B") for k in range(total - warm, total)]
        out.append(acts)
    return out


def _split_backward(r: int, m: int, warm: int, lag: int) -> list[Action]:
    """One rank's zero-bubble order on chunk ``r``: ``warm`` forwards, then for each
    microbatch k its input gradient ``I``, the weight gradient of microbatch ``k - lag`` (the
    W's trail the I's by ``lag``, filling what would be bubbles), and the next forward; the
    ``lag`` deferred W's close the step. The rank holds at most ``warm + lag`` microbatches."""
    acts = [Action("F", r, i) for i in range(warm)]
    for k in range(m):
        acts.append(Action("I", r, k))
        if k >= lag:
            acts.append(Action("W", r, k - lag))
        if warm + k < m:
            acts.append(Action("F", r, warm + k))
    acts += [Action("W", r, j) for j in range(max(m - lag, 0), m)]
    return acts


def _zb_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, arXiv 2401.10241): rank r warms up with 1F1B's p - r forwards
    and lets its W's trail its I's by r, so the last rank runs its I's at once (the critical
    path back to rank 0) and defers p - 1 W's into the cool-down. Every rank holds at most
    min(p, m) microbatches (1F1B's peak, on its first rank), and with m >= p each rank idles
    max((p - 1)F, (p - 1)(F + I - W)): a third of 1F1B's bubble when F = I = W (with m < p,
    unit costs: (p - 1) + (p - m))."""
    return [_split_backward(r, m, min(p - r, m), r) for r in range(p)]


def _zb_h2(p: int, m: int, cap: int) -> list[list[Action]]:
    """ZB-H2 with a memory knob: ``x = min(cap - p, m - p)`` microbatches more per rank than
    zb-h1 (cap <= 2p - 1). Rank r spends min(x, p - 1 - r) of them on extra warm-up forwards
    (filling the wait for its first I) and the rest on a longer W lag (filling the cool-down).
    With m >= p each rank idles max((p-1)F, (p-1)(F + I - W) - x W) and holds min(m, p + x)
    microbatches: each extra microbatch takes one W off zb-h1's bubble, down to the pipeline
    fill (p-1)F (at x = p - 1, the paper's H2, when I <= 2W), which no schedule that ends the
    step with a synchronous optimizer step avoids (the paper hides it across steps)."""
    x = min(cap - p, max(m - p, 0))
    out = []
    for r in range(p):
        extra_warm = min(x, p - 1 - r)
        out.append(_split_backward(r, m, min(m, p - r + extra_warm), r + x - extra_warm))
    return out


def _zbv(p: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al., arXiv 2401.10241, section 6): 2p chunks in a V, rank r running chunk
    ``a = r`` on the way down and ``b = 2p-1-r`` on the way up, so the last chunk's loss is
    on rank 0 and its backward starts where the forward started. Per rank, in phases
    (a pattern repeated a number of times; each token takes its chunk's next microbatch):

        2p-1-2r x [Fa]              fill until the first microbatch comes back up
        r       x [Fb Fa]
        p-r     x [Fb Ib Wb]        the first backwards on the way up
        n-2p+1+r x [Fa Ia Wa Fb Ib Wb]   steady state
        p-1-r   x [Ia Wa Fb Ib Wb]
        r       x [Ia Ib]           cool-down: input gradients first (the critical path)
        p-r     x [Ia Wa]
        then the deferred Wb's and Wa's

    for n = max(m, 2p - 1) microbatches, dropping those >= m. With equal per-chunk F, I and W
    each rank idles only the fill, (p - 1) chunk-forwards, and holds at most 2p chunk
    activations: 1F1B's p microbatches of a whole stage."""
    n = max(m, 2 * p - 1)
    out = []
    for r in range(p):
        phases = [(2 * p - 1 - 2 * r, "Fa"), (r, "Fb Fa"), (p - r, "Fb Ib Wb"),
                  (n - 2 * p + 1 + r, "Fa Ia Wa Fb Ib Wb"), (p - 1 - r, "Ia Wa Fb Ib Wb"),
                  (r, "Ia Ib"), (p - r, "Ia Wa"), (r, "Wb"), (r, "Wa")]
        chunk = {"a": r, "b": 2 * p - 1 - r}
        count: dict[str, int] = {}
        acts = []
        for times, pattern in phases:
            for _ in range(times):
                for token in pattern.split():
                    i = count.get(token, 0)
                    count[token] = i + 1
                    if i < m:
                        acts.append(Action(token[0], chunk[token[1]], i))
        out.append(acts)
    return out


class _RankOrder:
    """Builds one rank's list for :func:`_dualpipev`: per (chunk, kind) microbatch counters, an
    I's W queued until asked for (a B takes the microbatch of both)."""

    def __init__(self) -> None:
        self.acts: list[Action] = []
        self.next: dict[tuple[int, str], int] = {}
        self.weights: deque[tuple[int, int]] = deque()

    def add(self, kind: str, chunk: int) -> None:
        key = (chunk, "F" if kind == "F" else "I")   # B and I share the backward counter
        i = self.next.get(key, 0)
        self.next[key] = i + 1
        self.acts.append(Action(kind, chunk, i))
        if kind == "I":
            self.weights.append((chunk, i))

    def weight(self) -> None:
        if self.weights:
            chunk, i = self.weights.popleft()
            self.acts.append(Action("W", chunk, i))


def _dualpipev(p: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V; torch 2.13's ``ScheduleDualPipeV``):
    2p chunks in a V (rank r holds ``a = r`` and ``b = 2p-1-r``), m >= 2p. Per rank, in phases:

        2(p-1-r) x [Fa]             fill
        r+1      x [Fa Fb]
        p-1-r    x [Ib W Fb]        zero-bubble start on the way up
        m-2p+1+r x [Fa Bb  Fb Ba]   main phase: each pair (an F of one chunk, a B of the
                                    other) is one overlapped step on a device; run in order here
        p-1-r    x [Bb  Fb Ba]
        r+1      x [b a]            B's, then I's from the middle (odd ranks switch before the
                                    b action, even ranks after it)
        p-1-r    x [W a]
        r+1      x [W]              the deferred weight gradients

    where W is the oldest I's weight gradient, if any. The order is torch's, with each
    overlapped pair as its forward then its full backward."""
    out = []
    for r in range(p):
        a, b, o = r, 2 * p - 1 - r, _RankOrder()
        for _ in range(2 * (p - 1 - r)):
            o.add("F", a)
        for _ in range(r + 1):
            o.add("F", a), o.add("F", b)
        for _ in range(p - 1 - r):
            o.add("I", b), o.weight(), o.add("F", b)
        for _ in range(m - 2 * p + 1 + r):
            o.add("F", a), o.add("B", b), o.add("F", b), o.add("B", a)
        for _ in range(p - 1 - r):
            o.add("B", b), o.add("F", b), o.add("B", a)
        split = False
        for k in range(r + 1):
            split = split or (k == (r + 1) // 2 and r % 2 == 1)
            o.add("I" if split else "B", b)
            split = split or (k == (r + 1) // 2 and r % 2 == 0)
            o.add("I" if split else "B", a)
        for _ in range(p - 1 - r):
            o.weight(), o.add("I" if split else "B", a)
        for _ in range(r + 1):
            o.weight()
        out.append(o.acts)
    return out


# --------------------------------------------------------------------------- lowering


def _lower_indexed(schedule: Schedule) -> list[list[tuple[Action | Comm, int]]]:
    """Like :func:`lower`, each op paired with the index of its compute action."""
    last = schedule.num_chunks - 1
    owner = [schedule.rank_of(s) for s in range(schedule.num_chunks)]
    out = []
    for r, acts in enumerate(schedule.actions):
        ops: list[tuple[Action | Comm, int]] = []
        for j, a in enumerate(acts):
            s, i = a.stage, a.microbatch
            prev_remote = s > 0 and owner[s - 1] != r
            next_remote = s < last and owner[s + 1] != r
            if a.kind == "F" and prev_remote:
                ops.append((Comm("RECV_F", s, i, owner[s - 1]), j))
            elif a.kind in ("B", "I") and next_remote:
                ops.append((Comm("RECV_B", s, i, owner[s + 1]), j))
            ops.append((a, j))
            if a.kind == "F" and next_remote:
                ops.append((Comm("SEND_F", s, i, owner[s + 1]), j))
            elif a.kind in ("B", "I") and prev_remote:
                ops.append((Comm("SEND_B", s, i, owner[s - 1]), j))
        out.append(ops)
    return out


def lower(schedule: Schedule) -> list[list[Action | Comm]]:
    """Per rank, the compute actions with explicit sends and receives inserted.

    >>> [str(op) for op in lower(build_schedule("gpipe", 2, 1))[1]]
    ['RECV_F(1,0)<-r0', '1F0', '1B0', 'SEND_B(1,0)->r0']
    """
    return [[op for op, _ in ops] for ops in _lower_indexed(schedule)]


def sends_can_block(schedule: Schedule) -> bool:
    """Whether the lowered program still completes when each rank, before every compute, waits
    for the sends it has just issued (as torch's 1F1B runtime does), with sends that complete only
    once the peer has posted the matching receive (gloo's rendezvous).

    Each rank issues the transfers held since its previous compute (its sends and the receives the
    compute needs), waits for the sends and the receives, then computes; the sends after its last
    compute are waited at the end. ``False`` means some rank would wait on a peer that waits on
    it: such a schedule must leave its sends unwaited until the step ends.

    >>> sends_can_block(build_schedule("1f1b", 4, 8))
    True
    """
    segments = []
    for ops in lower(schedule):
        sends: list[tuple[str, int, int]] = []
        recvs: list[tuple[str, int, int]] = []
        rank_segments = []
        for op in ops:
            if isinstance(op, Comm):
                (sends if op.kind.startswith("SEND") else recvs).append(op.message())
            else:
                rank_segments.append((sends, recvs))
                sends, recvs = [], []
        if sends or recvs:
            rank_segments.append((sends, recvs))
        segments.append(rank_segments)
    posted: set[tuple[str, int, int]] = set()
    issued: set[tuple[str, int, int]] = set()
    ptr = [0] * len(segments)
    moved = True
    while moved:
        moved = False
        for r, rank_segments in enumerate(segments):
            while ptr[r] < len(rank_segments):
                sends, recvs = rank_segments[ptr[r]]
                issued.update(sends)
                posted.update(recvs)
                if not (posted.issuperset(sends) and issued.issuperset(recvs)):
                    break
                ptr[r] += 1
                moved = True
    return all(ptr[r] == len(s) for r, s in enumerate(segments))


def sends_waited_before_compute(schedule: Schedule) -> bool:
    """Whether pipeshard's gloo runtime has each rank wait for its sends before its next compute,
    with gloo's transport thread under SCHED_BATCH (``engine.policy.default_send_wait``): for a
    schedule without split backwards (a blocking send would give back the bubble a W fills) that
    :func:`sends_can_block` allows. The planner charges this mode's measured fixed costs to it.

    >>> [sends_waited_before_compute(build_schedule(n, 2, 4)) for n in ("1f1b", "zb-h1")]
    [True, False]
    """
    split = "I" in schedule.backward_kind.values()   # a valid schedule's W comes with its I
    return not split and sends_can_block(schedule)


SendMode = Literal["compute", "yield", "step"]


def send_mode(schedule: Schedule) -> SendMode:
    """How pipeshard's gloo runtime treats a schedule's sends (``engine.policy.default_send_wait``),
    and so which measured fixed costs the planner charges it (``partitioner.FixedCosts``):

    - ``"compute"``: waited before each compute (:func:`sends_waited_before_compute`: gpipe, 1f1b);
    - ``"yield"``: a looped schedule with several chunks per rank and no split backward
      (interleaved-1f1b), whose receives are posted ahead: before each compute the rank gives up
      its core once while one of its sends is not yet waited, and waits them at the step's end;
    - ``"step"``: waited at the end of the step (the zero-bubble schedules).

    The first two run with gloo's transport thread under SCHED_BATCH, the last under the default
    policy (``engine.policy.default_transport_threads``).

    >>> [send_mode(build_schedule(n, 2, 4, v)) for n, v in
    ...  (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))]
    ['compute', 'yield', 'step']
    """
    if sends_waited_before_compute(schedule):
        return "compute"
    split = "I" in schedule.backward_kind.values()
    looped = schedule.virtual_stages > 1 and schedule.placement == "loop"
    return "yield" if looped and not split else "step"


# --------------------------------------------------------------------------- validation


def _fail(schedule: Schedule, message: str, mark: tuple[int, int] | None = None) -> None:
    raise ScheduleError(f"{message}\n{schedule.grid(mark)}")


def validate(schedule: Schedule) -> None:
    """Check completeness, ordering, deadlock freedom and FIFO message order.

    Raises :class:`ScheduleError` whose message explains the rule, how to fix it, and
    shows the step-by-rank grid with the offending action marked.

    >>> validate(build_schedule("zb-h1", 3, 4))
    """
    _ = schedule.checked  # runs the checks on the first call only (a failure raises every time)


def _validate(schedule: Schedule) -> None:
    p, m, v = schedule.num_stages, schedule.microbatches, schedule.virtual_stages
    if min(p, m, v) < 1:
        raise ScheduleError(
            f"num_stages, microbatches and virtual_stages must all be >= 1, got p={p}, m={m}, v={v}"
        )
    if len(schedule.actions) != p:
        raise ScheduleError(
            f"schedule has {len(schedule.actions)} action lists but num_stages={p}; "
            "give exactly one list per pipeline rank"
        )
    if schedule.placement not in PLACEMENTS:
        raise ScheduleError(f"unknown placement {schedule.placement!r}; use one of {PLACEMENTS}")
    pos = _check_membership(schedule)
    _check_complete(schedule, pos)
    _check_local_order(schedule, pos)
    program = _lower_indexed(schedule)
    _check_fifo(schedule, program)
    _check_deadlock(schedule, program)


def _check_membership(schedule: Schedule) -> dict[tuple[str, int, int], tuple[int, int]]:
    n_chunks, m = schedule.num_chunks, schedule.microbatches
    pos: dict[tuple[str, int, int], tuple[int, int]] = {}
    for r, acts in enumerate(schedule.actions):
        for j, a in enumerate(acts):
            if not isinstance(a, Action):
                _fail(schedule, f"rank {r} step {j} is {a!r}, not an Action", (r, j))
            if a.stage >= n_chunks:
                _fail(schedule, f"{a} names chunk {a.stage}, but there are only {n_chunks} "
                      f"chunks (num_stages * virtual_stages)", (r, j))
            if a.microbatch >= m:
                _fail(schedule, f"{a} names microbatch {a.microbatch}, but microbatches={m}",
                      (r, j))
            owner = schedule.rank_of(a.stage)
            if owner != r:
                _fail(schedule, f"{a} is on rank {r}, but chunk {a.stage} lives on rank {owner} "
                      f"({schedule.placement} placement); move it there", (r, j))
            key = (a.kind, a.stage, a.microbatch)
            if key in pos:
                _fail(schedule, f"{a} appears twice (first at rank {pos[key][0]} step "
                      f"{pos[key][1]}); each action must run exactly once: remove one", (r, j))
            pos[key] = (r, j)
    return pos


def _check_complete(schedule: Schedule, pos: dict[tuple[str, int, int], tuple[int, int]]) -> None:
    for s in range(schedule.num_chunks):
        r = schedule.rank_of(s)
        end = (r, len(schedule.actions[r]))
        for i in range(schedule.microbatches):
            has = {k: (k, s, i) in pos for k in _KINDS}
            where = next((pos[(k, s, i)] for k in _KINDS if has[k]), end)
            if not has["F"]:
                _fail(schedule, f"{s}F{i} is missing on rank {r}: every chunk runs a forward for "
                      "every microbatch", where)
            if has["B"] and (has["I"] or has["W"]):
                _fail(schedule, f"chunk {s} microbatch {i} has both a full backward {s}B{i} and "
                      "an I/W half; use either B, or I then W", pos[("B", s, i)])
            if not has["B"] and not (has["I"] and has["W"]):
                if has["I"] or has["W"]:
                    missing = f"{s}W{i}" if has["I"] else f"{s}I{i}"
                    hint = "an I needs its W (weight gradient) and a W its I"
                else:
                    missing, hint = f"{s}B{i}", "every forward needs a backward (B, or I and W)"
                _fail(schedule, f"{missing} is missing on rank {r}: {hint}", where)


def _check_local_order(schedule: Schedule, pos: dict[tuple[str, int, int], tuple[int, int]]) -> None:
    bwd_kind = schedule.backward_kind
    for r, acts in enumerate(schedule.actions):
        for j, a in enumerate(acts):
            for dep in depends_on(a, schedule.num_chunks, bwd_kind):
                dr, dj = pos[dep]
                if dr == r and dj > j:
                    d = f"{dep[1]}{dep[0]}{dep[2]}"
                    _fail(schedule, f"{a} runs before {d} on rank {r}, but needs its result; "
                          f"move {a} after {d}", (r, j))


def _check_fifo(schedule: Schedule, program: list[list[tuple[Action | Comm, int]]]) -> None:
    sends: dict[tuple[int, int, str], list[tuple[tuple[str, int, int], int]]] = {}
    recvs: dict[tuple[int, int, str], list[tuple[tuple[str, int, int], int]]] = {}
    for r, ops in enumerate(program):
        for op, j in ops:
            if isinstance(op, Comm):
                msg = op.message()
                if op.kind.startswith("SEND"):
                    sends.setdefault((r, op.peer, msg[0]), []).append((msg, j))
                else:
                    recvs.setdefault((op.peer, r, msg[0]), []).append((msg, j))
    for link in sorted(recvs):
        src, dst, channel = link
        sent, got = sends.get(link, []), recvs[link]
        for n, ((want, j), (have, _)) in enumerate(zip(got, sent)):
            if want != have:
                name = "forward activations" if channel == "F" else "backward gradients"
                _fail(schedule,
                      f"message order mismatch on rank {src} -> rank {dst} ({name}): message #{n} "
                      f"sent is for chunk {have[1]} microbatch {have[2]}, but rank {dst} expects "
                      f"chunk {want[1]} microbatch {want[2]} there. Point-to-point messages are "
                      "matched in order (NCCL), so both ranks must handle this link's messages in "
                      "the same order: reorder the actions on one side", (dst, j))


def _check_deadlock(schedule: Schedule, program: list[list[tuple[Action | Comm, int]]]) -> None:
    """Run the lowered program with non-blocking sends and blocking receives."""
    p = schedule.num_stages
    ptr = [0] * p
    sent: set[tuple[str, int, int]] = set()
    waiting: dict[tuple[str, int, int], list[int]] = {}
    queue = deque(range(p))
    while queue:
        r = queue.popleft()
        ops = program[r]
        while ptr[r] < len(ops):
            op, _ = ops[ptr[r]]
            if isinstance(op, Comm):
                msg = op.message()
                if op.kind.startswith("SEND"):
                    sent.add(msg)
                    queue.extend(waiting.pop(msg, []))
                elif msg not in sent:
                    waiting.setdefault(msg, []).append(r)
                    break
            ptr[r] += 1
    stuck = [r for r in range(p) if ptr[r] < len(program[r])]
    if stuck:
        lines = []
        for r in stuck:
            op, j = program[r][ptr[r]]
            lines.append(f"rank {r} waits at {schedule.actions[r][j]} for data from rank {op.peer}")
        first_j = program[stuck[0]][ptr[stuck[0]]][1]
        _fail(schedule,
              "deadlock: ranks " + ", ".join(map(str, stuck)) + " block forever ("
              + "; ".join(lines) + "). Each waits on a message its peer only sends later; "
              "reorder so every receive's message is sent before the receiver needs it",
              (stuck[0], first_j))
