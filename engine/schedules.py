"""Pipeline schedules as data.

A schedule is, for every pipeline rank, the ordered list of compute actions it runs:
``F`` (forward), ``B`` (full backward), or ``I`` / ``W`` (the input-gradient and
weight-gradient halves of a backward, for zero-bubble schedules). Communication is not
part of a schedule; :func:`lower` derives it, and :func:`validate` proves that the
derived program is complete, respects data dependencies, cannot deadlock and keeps
message order consistent at both ends of every link.

Example::

    >>> s = build_schedule("1f1b", num_stages=2, microbatches=3)
    >>> [str(a) for a in s.actions[0]]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    >>> validate(s)  # raises ScheduleError (with a grid) if anything is wrong
"""

from __future__ import annotations

import operator
import re
from collections import deque
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ActionKind",
    "Action",
    "Schedule",
    "Comm",
    "SCHEDULES",
    "build_schedule",
    "validate",
    "ScheduleError",
    "lower",
]

ActionKind = Literal["F", "B", "I", "W"]
_KINDS = ("F", "B", "I", "W")
_ACTION_RE = re.compile(r"^\s*(\d+)([FBIW])(\d+)\s*$")

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


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
    """Per-rank ordered actions. Chunk ``s`` lives on rank ``s % num_stages``.

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

    @property
    def num_chunks(self) -> int:
        return self.num_stages * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        return stage % self.num_stages

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.num_chunks, self.num_stages))

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
            f"v={self.virtual_stages} (rows: ranks; columns: step index on that rank)",
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


# --------------------------------------------------------------------------- generators


def _int_arg(value: object, name: str) -> int:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def build_schedule(
    name: str, num_stages: int, microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """Build a named schedule for ``num_stages`` ranks and ``microbatches`` microbatches.

    >>> build_schedule("interleaved-1f1b", 2, 4, virtual_stages=2).num_chunks
    4
    """
    key = str(name).lower()
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    p = _int_arg(num_stages, "num_stages")
    m = _int_arg(microbatches, "microbatches")
    v = _int_arg(virtual_stages, "virtual_stages")
    if p < 1:
        raise ValueError(f"num_stages must be >= 1, got {p}")
    if m < 1:
        raise ValueError(f"microbatches must be >= 1, got {m}")
    if key == "interleaved-1f1b":
        if v < 2:
            raise ValueError(
                f"interleaved-1f1b needs virtual_stages >= 2 (model chunks per rank), got {v}; "
                "pass virtual_stages=2 or more, or use '1f1b'"
            )
        if m % p:
            lo, hi = (m // p) * p, (m // p + 1) * p
            hint = f"{lo} or {hi}" if lo else f"{hi}"
            raise ValueError(
                f"interleaved-1f1b needs microbatches to be a multiple of num_stages "
                f"(microbatches run in groups of p, as in Megatron); got m={m}, p={p}: use m={hint}"
            )
        actions = _interleaved(p, m, v)
    else:
        if v != 1:
            raise ValueError(
                f"virtual_stages={v} only applies to 'interleaved-1f1b'; pass virtual_stages=1 "
                f"for {key!r}"
            )
        actions = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb-h1": _zb_h1}[key](p, m)
    return Schedule(key, p, m, v, actions)


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


def _zb_h1(p: int, m: int) -> list[list[Action]]:
    """Zero-bubble H1 (Qi et al. 2023), built by list scheduling under unit costs.

    Every rank, whenever it is free, runs the first available of: the next input-gradient
    ``I`` (the critical path), the next forward (only while fewer than ``min(p, m)``
    microbatches hold activations, counted until their ``W``), then the oldest deferred
    weight-gradient ``W``. The cap is 1F1B's peak (its first rank holds ``min(p, m)``), as in
    the paper's H1: later ranks may hold more than under 1F1B, the pipeline's peak does not
    rise, and the later ranks' deferred ``W``s fill what would be bubbles. With p = 2 and
    unit F = I = W this reaches the paper's step ``m(F+I+W) + (p-1)(F+I-W)``. Ordering
    depends only on (p, m), not on costs.
    """
    cap = [min(p, m) for r in range(p)]
    f_end: list[list[int | None]] = [[None] * m for _ in range(p)]
    i_end: list[list[int | None]] = [[None] * m for _ in range(p)]
    nf, ni, held, free = [0] * p, [0] * p, [0] * p, [0] * p
    pending: list[deque[int]] = [deque() for _ in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]
    left, t = 3 * p * m, 0

    def ready(end: int | None) -> bool:
        return end is not None and end <= t

    while left:
        if t > 10 * p * m + 10:  # pragma: no cover - would be a generator bug
            raise RuntimeError(f"zb-h1 generator made no progress for p={p}, m={m}")
        for r in range(p):
            if free[r] > t:
                continue
            i, f = ni[r], nf[r]
            if i < f and ready(f_end[r][i]) and (r == p - 1 or ready(i_end[r + 1][i])):
                out[r].append(Action("I", r, i))
                i_end[r][i] = t + 1
                ni[r] += 1
                pending[r].append(i)
            elif f < m and held[r] < cap[r] and (r == 0 or ready(f_end[r - 1][f])):
                out[r].append(Action("F", r, f))
                f_end[r][f] = t + 1
                nf[r] += 1
                held[r] += 1
            elif pending[r]:
                out[r].append(Action("W", r, pending[r].popleft()))
                held[r] -= 1
            else:
                continue
            free[r] = t + 1
            left -= 1
        t += 1
    return out


# --------------------------------------------------------------------------- lowering


def _lower_indexed(schedule: Schedule) -> list[list[tuple[Action | Comm, int]]]:
    """Like :func:`lower`, each op paired with the index of its compute action."""
    last = schedule.num_chunks - 1
    out = []
    for r, acts in enumerate(schedule.actions):
        ops: list[tuple[Action | Comm, int]] = []
        for j, a in enumerate(acts):
            s, i = a.stage, a.microbatch
            prev_remote = s > 0 and schedule.rank_of(s - 1) != r
            next_remote = s < last and schedule.rank_of(s + 1) != r
            if a.kind == "F" and prev_remote:
                ops.append((Comm("RECV_F", s, i, schedule.rank_of(s - 1)), j))
            elif a.kind in ("B", "I") and next_remote:
                ops.append((Comm("RECV_B", s, i, schedule.rank_of(s + 1)), j))
            ops.append((a, j))
            if a.kind == "F" and next_remote:
                ops.append((Comm("SEND_F", s, i, schedule.rank_of(s + 1)), j))
            elif a.kind in ("B", "I") and prev_remote:
                ops.append((Comm("SEND_B", s, i, schedule.rank_of(s - 1)), j))
        out.append(ops)
    return out


def lower(schedule: Schedule) -> list[list[Action | Comm]]:
    """Per rank, the compute actions with explicit sends and receives inserted.

    >>> [str(op) for op in lower(build_schedule("gpipe", 2, 1))[1]]
    ['RECV_F(1,0)<-r0', '1F0', '1B0', 'SEND_B(1,0)->r0']
    """
    return [[op for op, _ in ops] for ops in _lower_indexed(schedule)]


# --------------------------------------------------------------------------- validation


def _fail(schedule: Schedule, message: str, mark: tuple[int, int] | None = None) -> None:
    raise ScheduleError(f"{message}\n{schedule.grid(mark)}")


def validate(schedule: Schedule) -> None:
    """Check completeness, ordering, deadlock freedom and FIFO message order.

    Raises :class:`ScheduleError` whose message explains the rule, how to fix it, and
    shows the step-by-rank grid with the offending action marked.

    >>> validate(build_schedule("zb-h1", 3, 4))
    """
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
                      f"(chunk s on rank s % {schedule.num_stages}); move it there", (r, j))
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


def _deps(a: Action, schedule: Schedule, bwd_kind: dict[tuple[int, int], str]) -> list[tuple[str, int, int]]:
    """Actions whose results ``a`` consumes."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if a.kind == "W":
        return [("I", s, i)]
    deps = [("F", s, i)]
    if s < schedule.num_chunks - 1:
        deps.append((bwd_kind[(s + 1, i)], s + 1, i))
    return deps


def _check_local_order(schedule: Schedule, pos: dict[tuple[str, int, int], tuple[int, int]]) -> None:
    bwd_kind = {(s, i): ("B" if k == "B" else "I") for (k, s, i) in pos if k in ("B", "I")}
    for r, acts in enumerate(schedule.actions):
        for j, a in enumerate(acts):
            for dep in _deps(a, schedule, bwd_kind):
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
        first_op, first_j = program[stuck[0]][ptr[stuck[0]]]
        _fail(schedule,
              "deadlock: ranks " + ", ".join(map(str, stuck)) + " block forever ("
              + "; ".join(lines) + "). Each waits on a message its peer only sends later; "
              "reorder so every receive's message is sent before the receiver needs it",
              (stuck[0], first_j))
