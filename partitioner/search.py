"""``search``: the planner chooses the schedule, its chunks, the microbatches and the split.

For one pipeline (``num_stages`` ranks) and one batch per replica, :func:`search` lists every
layout the schedules accept (:func:`candidate_layouts`): each schedule of
``engine.schedules.SCHEDULES``; its virtual stages (interleaved: 2 .. ``max_virtual_stages``,
zbv: 2); microbatch counts that divide the batch (at least ``num_stages``); zb-h2's
``max_inflight`` at a few values from zb-h1's memory (p) to ZB-H2's (2p - 1). Each layout is
solved by :func:`partitioner.partition` (the exact split under the memory limit, per-stage
recomputation where the limit needs it under ``activation_checkpointing="auto"``, the step predicted by ``Plan.simulate`` with the
profile's fixed costs) and the layouts are ranked by predicted step; the fastest that fits is
the choice. The partitioner is a black box here, so its memory and cost models flow through.
With ``recompute_granularity="auto"`` each layout is solved at both granularities (a recomputing
chunk checkpointed whole, or layer by layer: :func:`partitioner.recompute.checkpoint_each_layer`;
only "chunk" where no chunk may recompute), and with ``sequence_parallel="auto"`` and more than
one tp rank with and without sequence parallelism (the profile given whole, divided once by
:func:`partitioner.recompute.sequence_parallel_profile`); the plan records both
(``Plan.recompute_granularity``, ``Plan.sequence_parallel``).

Costs depend on the microbatch size, and not linearly: a layer's time is a fixed part (per-op
launch and dispatch, which a small microbatch does not amortise) plus a part that grows with the
samples. So the search never extrapolates a profile down to a smaller microbatch. Give
``profile`` as a callable ``size -> Profile`` (profiled at each size searched, once per size: the
experiments do this), or as profiles at some sizes (a ``{size: Profile}`` dict, or one
:class:`Profile` taken at ``profile_microbatch`` samples). With ``scaling="bounded"`` (the
default) a size between two profiled ones is interpolated per layer on a fixed part plus a
per-sample part (:func:`affine_profile`, exact under that model), a size above the largest is
scaled linearly from it (an upper bound under that model), and a size below the smallest is not
searched (``skipped``, with a note). ``scaling="linear"`` scales the nearest profile linearly to
every size (no fixed cost: it under-predicts small microbatches); it must be asked for. Each
candidate's ``profile`` field, and the table, say which of these priced it.

Branch and bound keeps it fast: a layout whose lower bound (its compute spread over the ranks,
or its largest layer, or with one chunk per rank its busiest stage's work plus the pipeline's fill
over every split, plus the fixed cost of its actions) is no better than the
``top + 1``-th best predicted step cannot enter the table, and is marked ``pruned`` unsolved.
zbv's exact V split costs O(p n^4) (``partitioner.vsplit``); above ``v_split_budget`` it is
``skipped``, with a note. Two layouts that run one program (the same split, recompute and
per-rank actions under two names, e.g. zb-auto building zb-h2's order) are listed once: the
other is ``skipped``, naming the one kept, so the table's alternatives are different programs.

Example::

    from partitioner import LayerCost, Profile, search
    prof = Profile([LayerCost(1e-3, 2e-3, 4 << 20, 8 << 20, 1 << 20)] * 16)
    res = search(prof, 4, 32, profile_microbatch=4, memory_limit_bytes=1 << 30)   # m <= 8: sizes >= 4
    res.plan                   # the chosen Plan; res.plan.search is the record for plan.json
    print(res.table())         # the choice and the next best: predicted step and memory
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

from engine.choices import check_recompute_granularity
from engine.footprint import GRAD_BUCKET_MB
from engine.schedules import SCHEDULE_INFO, SCHEDULES, build_schedule

from .costs import LayerCost, Profile  # noqa: F401 - LayerCost: the doctests
from .plan import PartitionError, Plan, format_search
from .planner import checkpointing_mode, partition, without_stage_advice
from .recompute import sequence_parallel_profile
from .solve import pipeline_lower_bound

__all__ = ["AUTO", "Candidate", "SearchResult", "search", "search_parallel", "parallel_layouts", "candidate_layouts", "microbatch_counts",
           "inflight_values", "scale_profile", "affine_profile", "V_SPLIT_BUDGET", "SCALINGS",
           "granularity_choices", "sequence_parallel_choices"]

AUTO = "auto"
"""The config value that asks the planner to choose (``pipeline.schedule`` / ``pipeline.microbatches``)."""

V_SPLIT_BUDGET = 2e8
"""Largest ``p * n**4 / 4`` for which zbv's exact V split is solved (about two seconds)."""

SCALINGS: tuple[str, ...] = ("bounded", "linear")
"""How profiles taken at some microbatch sizes price the others (see the module docstring)."""

_STATUS = ("ok", "pruned", "infeasible", "skipped")
_SAME = "the same program as"
ProfileSource = Union[Profile, Mapping[int, Profile], Callable[[int], Profile]]


@dataclass
class Candidate:
    """One layout the search considered, and what became of it.

    ``status``: ``ok`` (solved and fits), ``pruned`` (its lower bound cannot beat the table),
    ``infeasible`` (no split fits the memory limit; ``note`` says what would), ``skipped``
    (not solved, or solved and the very program of a layout ranked before it; ``note`` says
    why). ``step_s``: the predicted step (``Plan.step_s``); ``lower_bound_s``: the bound used to
    prune; ``plan``: the solved plan (not serialised).
    ``profile``: how its microbatch size's costs were obtained (profiled at that size,
    interpolated, scaled).
    """

    schedule: str
    virtual_stages: int = 1
    microbatches: int = 1
    max_inflight: int | None = None
    status: str = "pending"
    profile: str = ""
    step_s: float | None = None
    lower_bound_s: float = 0.0
    bubble_fraction: float | None = None
    rank_memory_bytes: list[int] = field(default_factory=list)
    recompute: list[bool] = field(default_factory=list)
    note: str = ""
    plan: Plan | None = field(default=None, repr=False, compare=False)
    # the 3-D layout (search_parallel): None where the search did not choose it
    tensor_parallel: int | None = None
    data_parallel: int | None = None
    zero_stage: int | None = None
    reshard_after_forward: bool | None = None
    # planned under sequence parallelism; a recomputing chunk's checkpoints (chunk / layer)
    sequence_parallel: bool = False
    recompute_granularity: str = "chunk"

    @property
    def label(self) -> str:
        """A short name: ``"zb-h2 m=8 inflight=3"``, ``"interleaved-1f1b v=3 m=8"`` (with
        ``"dp8 tp8 zero3"`` first when :func:`search_parallel` chose them, ``" sp"`` under
        sequence parallelism, ``" per-layer"`` with per-layer recompute checkpoints)."""
        out = self.schedule + (f" v={self.virtual_stages}" if SCHEDULE_INFO[self.schedule].chunks_per_rank is None
                               else "") + f" m={self.microbatches}"
        out += f" inflight={self.max_inflight}" if self.max_inflight is not None else ""
        out += " sp" if self.sequence_parallel else ""
        out += " per-layer" if self.recompute_granularity == "layer" else ""
        if self.tensor_parallel is not None:
            out = f"dp{self.data_parallel} tp{self.tensor_parallel} zero{self.zero_stage} " + out
        return out

    @property
    def peak_memory_bytes(self) -> int | None:
        return max(self.rank_memory_bytes) if self.rank_memory_bytes else None

    def to_dict(self) -> dict[str, Any]:
        """The candidate as JSON-ready values (the plan's split, not the plan)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        d["label"] = self.label
        d["stage_ranges"] = [list(r) for r in self.plan.stage_ranges] if self.plan is not None else None
        return d


@dataclass
class SearchResult:
    """The search's outcome: ``plan`` (the choice), ``candidates`` ranked (solved ones by
    predicted step, then pruned, infeasible and skipped), the wall time (``profile_seconds`` of it
    in the ``size -> Profile`` callable, e.g. measuring) and notes."""

    plan: Plan
    candidates: list[Candidate]
    seconds: float
    notes: list[str] = field(default_factory=list)
    profile_seconds: float = 0.0

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    def alternatives(self, top: int = 5) -> list[Candidate]:
        """The next best solved layouts after the choice (at most ``top``)."""
        return [c for c in self.candidates[1:] if c.status == "ok"][:top]

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.candidates)

    def record(self, top: int = 5) -> dict[str, Any]:
        """What ``plan.json`` keeps (``Plan.search``): the choice, the next ``top``, every
        candidate's row (without splits past the table), the counts and the time."""
        rows = [c.to_dict() for c in self.candidates]
        for r in rows[top + 1:]:
            r["stage_ranges"] = None
        return {"chosen": rows[0], "alternatives": [c.to_dict() for c in self.alternatives(top)],
                "candidates": rows, "considered": len(rows), "top": top, "seconds": self.seconds,
                "profile_seconds": self.profile_seconds,
                **{s: self.count(s) for s in _STATUS}, "notes": list(self.notes)}

    def table(self, top: int = 5) -> str:
        """The choice and the next best ``top`` layouts: predicted step and memory per layout."""
        return format_search(self.record(top))


def microbatch_counts(num_stages: int, batch_per_replica: int, *, microbatches: Any = None,
                      max_microbatches: int | None = None) -> list[int]:
    """The microbatch counts to consider: ``microbatches`` when given (one count or several;
    each must divide the batch), else every divisor of ``batch_per_replica`` from
    ``num_stages`` up to ``max_microbatches`` (default: the batch).

    >>> microbatch_counts(2, 12), microbatch_counts(2, 12, max_microbatches=4)
    ([2, 3, 4, 6, 12], [2, 3, 4])
    """
    B, p = int(batch_per_replica), int(num_stages)
    if B < 1 or p < 1:
        raise ValueError(f"batch_per_replica and num_stages must be >= 1 (got {B}, {p})")
    if microbatches is not None:
        ms = [int(x) for x in (microbatches if isinstance(microbatches, (list, tuple)) else [microbatches])]
        bad = [m for m in ms if m < 1 or B % m]
        if bad:
            raise ValueError(f"microbatch counts {bad} do not divide the batch of {B} per replica; "
                             f"use divisors of {B}")
        return sorted(set(ms))
    top = B if max_microbatches is None else min(B, int(max_microbatches))
    ms = [m for m in range(p, top + 1) if B % m == 0]
    if not ms:
        raise ValueError(f"no microbatch count from num_stages={p} to {top} divides the batch of {B} per replica; "
                         f"use a batch per replica that is a multiple of {p} (e.g. {p * max(1, -(-B // p))})")
    return ms


def inflight_values(num_stages: int) -> list[int]:
    """zb-h2's ``max_inflight`` values the search tries: zb-h1's memory (p), the midpoint and
    ZB-H2's (2p - 1).

    >>> inflight_values(4), inflight_values(1)
    ([4, 5, 7], [1])
    """
    p = int(num_stages)
    return sorted({p, (3 * p - 1) // 2, 2 * p - 1})


def _default_inflight(p: int, names: Sequence[str]) -> list[int]:
    """:func:`inflight_values`, less p when zb-h1 is searched too (zb-h2 bounded at p builds
    zb-h1's very actions)."""
    vals = inflight_values(p)
    return [x for x in vals if x != p] or vals if "zb-h1" in names else vals


def candidate_layouts(num_stages: int, num_layers: int, microbatches: Sequence[int], *,
                      schedules: Sequence[str] | None = None, virtual_stages: Sequence[int] | None = None,
                      max_virtual_stages: int = 4, max_inflight: Sequence[int] | None = None) -> list[Candidate]:
    """Every (schedule, virtual stages, microbatches, max_inflight) the schedules accept
    (``engine.schedules.build_schedule`` is the judge) with at least one layer per chunk.

    A rank never holds more than its ``m`` microbatches per chunk, so every cap of at least
    ``m x v`` builds the same program: only the smallest such cap is a candidate (one program,
    one entry in the search's ranking).

    >>> [c.label for c in candidate_layouts(2, 4, [2, 4], schedules=["interleaved-1f1b", "zb-h2"])]
    ['interleaved-1f1b v=2 m=2', 'interleaved-1f1b v=2 m=4', 'zb-h2 m=2 inflight=2', 'zb-h2 m=4 inflight=2', 'zb-h2 m=4 inflight=3']
    >>> [c.label for c in candidate_layouts(2, 4, [2], schedules=["zb-h1", "zb-h2"])]
    ['zb-h1 m=2', 'zb-h2 m=2 inflight=3']
    """
    p = int(num_stages)
    names = list(SCHEDULES if schedules is None else schedules)
    unknown = [s for s in names if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedules {unknown}; choose from {list(SCHEDULES)}")
    out = []
    for name in names:
        info = SCHEDULE_INFO[name]
        vs = [info.chunks_per_rank] if info.chunks_per_rank else list(virtual_stages or range(2, max_virtual_stages + 1))
        caps = sorted(set(max_inflight or _default_inflight(p, names))) if info.memory_knob else [None]
        for v in (v for v in vs if p * v <= num_layers):
            for m in microbatches:
                unbound = False  # a cap of at least m x v, already a candidate
                for cap in caps:
                    if unbound and cap >= m * v:
                        break
                    try:
                        build_schedule(name, p, m, v, max_inflight=cap)
                    except ValueError:
                        continue  # the schedule's own rule (e.g. interleaving needs m % p == 0)
                    out.append(Candidate(name, v, m, cap))
                    unbound = cap is not None and cap >= m * v
    return out


# LayerCost's byte counts that grow with the microbatch (parameters do not): one list for the
# scaling and the interpolation below.
PER_SAMPLE_BYTES = ("activation_bytes", "output_bytes", "shared_input_bytes", "pending_grad_bytes",
                    "workspace_bytes", "output_saved_bytes", "loss_input_bytes", "loss_saved_bytes")


def scale_profile(profile: Profile, factor: float) -> Profile:
    """``profile`` for a microbatch ``factor`` times as large: times, FLOPs and per-sample bytes
    (activations, outputs, shared inputs, gradients kept from I to W) scaled linearly, parameters kept. Linear time is an
    approximation (small microbatches use a device less well): measure per size when it matters."""
    if factor == 1:
        return profile
    k = float(factor)

    def scaled(c: Any) -> Any:
        per_sample = {f: None if getattr(c, f) is None else int(round(getattr(c, f) * k)) for f in PER_SAMPLE_BYTES}
        return dataclasses.replace(
            c.times_scaled(k), **per_sample,
            forward_flops=None if c.forward_flops is None else c.forward_flops * k,
            backward_flops=None if c.backward_flops is None else c.backward_flops * k)

    return Profile([scaled(c) for c in profile.layers], dtype=profile.dtype,
                   meta=dict(profile.meta, scaled_by=k), fixed=profile.fixed)


def affine_profile(low: Profile, low_size: int, high: Profile, high_size: int, size: int) -> Profile:
    """The profile at ``size`` samples between two profiles of the same model taken at
    ``low_size`` and ``high_size``: each time, FLOP count and per-sample byte count of each layer
    on the line through the two (a fixed part plus a part per sample), parameters kept.

    >>> a = Profile([LayerCost(1.0, 2.0, 8, 4, 4)]); b = Profile([LayerCost(2.0, 4.0, 8, 16, 16)])
    >>> round(affine_profile(a, 1, b, 4, 2).layers[0].forward_s, 6), affine_profile(a, 1, b, 4, 2).layers[0].activation_bytes
    (1.333333, 8)
    """
    if len(low) != len(high) or not low_size < size < high_size:
        raise ValueError(f"affine_profile needs two profiles of one model around the size: {len(low)} vs "
                         f"{len(high)} layers, sizes {low_size} < {size} < {high_size}")
    x = (size - low_size) / (high_size - low_size)

    def mid(u: Any, v: Any, whole: bool = False) -> Any:
        if u is None or v is None:
            return None
        y = (1 - x) * u + x * v
        return int(round(y)) if whole else y

    def layer(lo: Any, hi: Any) -> Any:
        out = dataclasses.replace(
            lo, forward_s=mid(lo.forward_s, hi.forward_s), backward_s=mid(lo.backward_s, hi.backward_s),
            weight_grad_s=mid(lo.weight_grad_s, hi.weight_grad_s), input_grad_s=mid(lo.input_grad_s, hi.input_grad_s),
            **{f: mid(getattr(lo, f), getattr(hi, f), True) for f in PER_SAMPLE_BYTES},
            forward_flops=mid(lo.forward_flops, hi.forward_flops), backward_flops=mid(lo.backward_flops, hi.backward_flops))
        if out.input_grad_s is None and out.weight_grad_s is not None:
            out = dataclasses.replace(out, weight_grad_s=min(out.weight_grad_s, out.backward_s))
        return out

    return Profile([layer(u, v) for u, v in zip(low.layers, high.layers)], dtype=low.dtype,
                   meta=dict(low.meta, interpolated_between=[low_size, high_size], microbatch_size=size),
                   fixed=low.fixed)



def _caches_label(prof: Profile) -> str:
    """"cold caches" for a profile measured so (``engine.caches``; hot, the default, goes unsaid)."""
    return "cold caches" if prof.meta.get("caches") == "cold" else ""


def _profile_source(profile: ProfileSource, profile_microbatch: int | None, scaling: str,
                    spent: list[float]) -> Callable[[int], tuple[Profile | None, str]]:
    """A cached ``size -> (Profile or None, how it was obtained)`` (module docstring); the
    seconds spent making profiles are added to ``spent[0]``."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r}: use one of {SCALINGS}")
    cache: dict[int, tuple[Profile | None, str]] = {}
    if isinstance(profile, Profile):
        known = {int(profile_microbatch): profile} if profile_microbatch is not None else None
    elif isinstance(profile, Mapping):
        known = {int(k): v for k, v in profile.items()}
        if not known:
            raise ValueError("no profiles given: pass {microbatch size: Profile}, a Profile or a callable")
    else:
        known = None

    def make(size: int) -> tuple[Profile | None, str]:
        if known is None:
            if isinstance(profile, Profile):
                return profile, "one profile (microbatch size not given)"
            prof = profile(size)   # type: ignore[operator]
            how = ", ".join(x for x in (prof.meta.get("mode"), _caches_label(prof)) if x)
            return prof, f"profiled at {size}" + (f" ({how})" if how else "")
        if size in known:
            return known[size], f"profiled at {size}"
        if scaling == "linear":
            near = min(known, key=lambda k: (abs(k - size), k))
            return scale_profile(known[near], size / near), f"scaled linearly from {near} (no fixed cost)"
        low = [k for k in known if k < size]
        high = [k for k in known if k > size]
        if low and high:
            a, b = max(low), min(high)
            return affine_profile(known[a], a, known[b], b, size), f"interpolated {a}..{b} (fixed + per sample)"
        if low:
            a = max(low)
            return scale_profile(known[a], size / a), f"scaled linearly from {a} (an upper bound)"
        return None, (f"no profile at or below {size} samples per microbatch (profiled: {sorted(known)}); "
                      "a smaller microbatch is not extrapolated: profile at that size (a callable size -> "
                      "Profile, or a {size: Profile} dict) or pass scaling='linear'")

    def get(size: int) -> tuple[Profile | None, str]:
        if size not in cache:
            t0 = time.perf_counter()
            cache[size] = make(size)
            spent[0] += time.perf_counter() - t0
        return cache[size]

    return get


def _checkpointing(mode: Any, memory_limit_bytes: Any) -> str:
    """What each layout is solved with (:func:`partitioner.planner.checkpointing_mode`): "auto"
    recomputes only where a limit needs it, so without a limit it is "off"."""
    ckpt = checkpointing_mode(mode)
    return "off" if ckpt == "auto" and memory_limit_bytes is None else ckpt


def _lower_bound(prof: Profile, c: Candidate, p: int) -> float:
    """A bound no split of this layout can beat: the busiest rank computes at least the mean
    share and the largest layer, m times; with one chunk per rank, stage j also waits for the
    first forward to reach it (and, with an atomic backward, for the last backward to return):
    :func:`partitioner.solve.pipeline_lower_bound`. Plus two fixed-cost actions per microbatch
    and chunk (F and a backward) and the per-step fixed cost."""
    info = SCHEDULE_INFO[c.schedule]
    back = [min(x.backward_s, x.split_backward_s) if info.splits_backward else x.backward_s for x in prof.layers]
    fwd = [layer.forward_s for layer in prof.layers]
    work = [f + b for f, b in zip(fwd, back)]
    fixed = prof.fixed
    # the cheapest of the runtime's modes (engine.schedules.send_mode)
    modes = ([fixed.runtime_costs(w) for w in ("compute", "yield", "step")] if fixed is not None
             else [(0.0, 0.0)])
    action, step = min(a for a, _ in modes), min(s for _, s in modes)
    m, v = c.microbatches, c.virtual_stages
    compute = m * max(sum(work) / p, max(work))
    if info.chunks_per_rank == 1 and p > 1:
        compute = max(compute, pipeline_lower_bound(work, p, m, carried=fwd if info.splits_backward else None))
    return compute + 2 * m * v * action + step


def _solve(c: Candidate, prof: Profile, p: int, kwargs: dict[str, Any], advice: bool = False) -> None:
    """Solve one layout with :func:`partition`, recording the outcome on ``c`` (an infeasible
    layout's note without the stage-count advice unless ``advice``: :func:`_nothing_fits`)."""
    try:
        with contextlib.nullcontext() if advice else without_stage_advice():
            plan = partition(prof, p, schedule=c.schedule, microbatches=c.microbatches, virtual_stages=c.virtual_stages,
                             max_inflight=c.max_inflight, **dict(kwargs, recompute_granularity=c.recompute_granularity))
    except PartitionError as exc:
        c.status, c.note = "infeasible", str(exc)
        return
    c.plan, c.step_s, c.bubble_fraction = plan, plan.step_s, plan.bubble_fraction
    c.rank_memory_bytes, c.recompute = list(plan.rank_memory_bytes), list(plan.stage_recompute)
    c.status = "ok" if plan.fits else "infeasible"
    if not plan.fits:
        c.note = "the split does not fit the memory limit"


def _rank_key(c: Candidate) -> tuple:
    """Fits first, then the predicted step; ties: less memory, the simpler schedule, fewer
    chunks and microbatches, no sequence parallelism, chunk checkpoints."""
    return (_STATUS.index(c.status) if c.status in _STATUS else len(_STATUS),
            c.step_s if c.step_s is not None else math.inf,
            c.peak_memory_bytes if c.peak_memory_bytes is not None else math.inf,
            SCHEDULES.index(c.schedule), c.virtual_stages, c.microbatches, c.max_inflight or 0,
            c.sequence_parallel, c.recompute_granularity != "chunk")


def granularity_choices(value: Any, checkpointing: Any) -> list[str]:
    """The recompute granularities the search solves each layout at: ``"auto"``, chunk and
    layer (chunk only where no chunk may recompute, ``checkpointing`` off); else the one given.

    >>> granularity_choices("auto", "auto"), granularity_choices("auto", False), granularity_choices("layer", "on")
    (['chunk', 'layer'], ['chunk'], ['layer'])
    """
    if str(value).strip().lower() != AUTO:
        return [check_recompute_granularity(value)]
    return ["chunk"] if checkpointing_mode(checkpointing) == "off" else ["chunk", "layer"]


def sequence_parallel_choices(value: Any, tensor_parallel: int) -> list[bool]:
    """Whether the search plans each layout without and / or with sequence parallelism:
    ``"auto"``, both with more than one tp rank; True or False, that one; one tp rank has no
    sequence to split (False only).

    >>> sequence_parallel_choices("auto", 4), sequence_parallel_choices("auto", 1), sequence_parallel_choices(True, 2)
    ([False, True], [False], [True])
    """
    if int(tensor_parallel) <= 1:
        return [False]
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return [False, True]
    if not isinstance(value, bool):
        raise ValueError(f"sequence_parallel={value!r}; use True, False or 'auto'")
    return [value]


def search(profile: ProfileSource, num_stages: int, batch_per_replica: int, *,
           profile_microbatch: int | None = None, schedules: Sequence[str] | None = None,
           microbatches: Any = None, max_microbatches: int | None = None,
           virtual_stages: Sequence[int] | None = None, max_virtual_stages: int = 4,
           max_inflight: Sequence[int] | None = None, data_parallel: int = 1, zero_stage: int = 1,
           optimizer: str = "adamw", memory_limit_bytes: "float | Sequence[float] | None" = None,
           link_bytes_per_s: float | None = None, activation_checkpointing: "bool | str" = "auto",
           method: str = "optimal", precision: str | None = None, momentum: float = 0.0,
           grad_accum_dtype: str = "fp32", backend: str = "auto", overlap_grad_reduce: bool = True,
           grad_bucket_mb: float = GRAD_BUCKET_MB, step_sync: str = "global", grad_clip: bool = True,
           top: int = 5, prune: bool = True,
           v_split_budget: float = V_SPLIT_BUDGET, scaling: str = "bounded",
           tensor_parallel: int = 1, reshard_after_forward: bool | None = None,
           links: Any = None, recompute_granularity: str = "chunk",
           sequence_parallel: "bool | str" = False, table_steps: list[float] | None = None) -> SearchResult:
    """Choose the layout with the smallest predicted step that fits (see the module docstring).

    ``profile``: a callable ``microbatch size -> Profile`` (profiled at each size searched), a
    ``{size: Profile}`` dict, or one Profile measured at ``profile_microbatch`` samples; ``scaling``:
    how sizes without a profile are priced (:data:`SCALINGS`, module docstring). ``schedules`` / ``microbatches`` / ``virtual_stages`` /
    ``max_inflight`` restrict the search (default: all); the other keywords go to
    :func:`partitioner.partition` (``activation_checkpointing``: False, only layouts that fit
    without recomputation; True, every chunk recomputes; "auto", recompute per chunk only where
    the memory limit needs it; ``precision`` / ``momentum`` / ``grad_accum_dtype`` / ``backend`` /
    ``overlap_grad_reduce`` / ``grad_bucket_mb`` / ``step_sync`` / ``grad_clip``: what the run keeps
    per parameter, and how its steps follow each other;
    ``recompute_granularity``: a recomputing chunk's checkpoints, the chunk or each layer, or
    "auto" (:func:`granularity_choices`); ``sequence_parallel``: True plans ``profile`` (given with
    the residual stream whole) under sequence parallelism over the tp ranks, "auto" both ways
    (:func:`sequence_parallel_choices`);
    ``tensor_parallel`` / ``reshard_after_forward`` / ``links``: the 3-D layout's, see
    :func:`partitioner.partition`; :func:`search_parallel` chooses them too). ``top``: the
    alternatives kept exact (and shown); ``prune=False`` solves every layout. ``table_steps``: the
    sorted predicted steps of layouts that fit and are ranked in the same table (another search's:
    :func:`search_parallel`), pruned against too and extended in place. Raises :class:`PartitionError` when nothing fits
    (or, with ``table_steps``, nothing that fits can enter the table).
    """
    t0 = time.perf_counter()
    p, B = int(num_stages), int(batch_per_replica)
    ms = microbatch_counts(p, B, microbatches=microbatches, max_microbatches=max_microbatches)
    spent = [0.0]
    if isinstance(profile, Profile) and profile_microbatch is None and len({B // m for m in ms}) > 1:
        raise ValueError(f"the search compares microbatch sizes {sorted({B // m for m in ms})}: pass "
                         "profile_microbatch= (the samples per microbatch the profile was taken at), or a "
                         "callable size -> Profile, or fix the microbatch count")
    profile_for = _profile_source(profile, profile_microbatch, scaling, spent)
    n = _num_layers(profile, profile_for, [B // m for m in ms])
    ckpt = _checkpointing(activation_checkpointing, memory_limit_bytes)
    cands = [dataclasses.replace(c, sequence_parallel=sp, recompute_granularity=g)
             for c in candidate_layouts(p, n, ms, schedules=schedules, virtual_stages=virtual_stages,
                                        max_virtual_stages=max_virtual_stages, max_inflight=max_inflight)
             for sp in sequence_parallel_choices(sequence_parallel, tensor_parallel)
             for g in granularity_choices(recompute_granularity, ckpt)]
    if not cands:
        raise PartitionError(f"no layout of {n} layers on {p} ranks with microbatches {ms} is accepted by the "
                             f"schedules {list(schedules or SCHEDULES)}; allow more schedules or microbatch counts")
    kwargs = dict(data_parallel=data_parallel, zero_stage=zero_stage, optimizer=optimizer,
                  memory_limit_bytes=memory_limit_bytes, link_bytes_per_s=link_bytes_per_s, method=method,
                  precision=precision, momentum=momentum, grad_accum_dtype=grad_accum_dtype, backend=backend,
                  overlap_grad_reduce=overlap_grad_reduce, grad_bucket_mb=grad_bucket_mb,
                  step_sync=step_sync, grad_clip=grad_clip,
                  tensor_parallel=tensor_parallel, reshard_after_forward=reshard_after_forward, links=links,
                  activation_checkpointing=ckpt)
    variant_for = _with_sequence_parallel(profile_for, tensor_parallel)
    notes = _run(cands, variant_for, p, B, n, kwargs, top if prune else None, v_split_budget,
                 table_steps if table_steps is not None else [])
    ranked = sorted(cands, key=_rank_key)
    if ranked[0].status != "ok":
        again = lambda c: _solve(c, variant_for(B // c.microbatches, c.sequence_parallel)[0], p, kwargs, True)  # noqa: E731
        raise PartitionError(_nothing_fits(ranked, memory_limit_bytes, again)
                             + ("" if not any(c.status == "pruned" for c in ranked) else
                                f"; {sum(c.status == 'pruned' for c in ranked)} layout(s) pruned: their lower bounds "
                                "cannot beat the table's steps"))
    result = SearchResult(ranked[0].plan, ranked, time.perf_counter() - t0, notes,  # type: ignore[arg-type]
                          profile_seconds=spent[0])
    result.plan.search = result.record(top)
    result.plan.notes.append(f"chosen by the search over {len(ranked)} layouts (schedule, chunks, microbatches, "
                             f"max_inflight, recompute and its granularity, sequence parallelism, split): see the "
                             "search table")
    return result


def _num_layers(profile: ProfileSource, profile_for: Callable[[int], tuple[Profile | None, str]],
                sizes: list[int]) -> int:
    if isinstance(profile, Profile):
        return len(profile)
    if isinstance(profile, Mapping):
        return len(next(iter(profile.values())))
    return len(profile_for(sizes[0])[0])   # type: ignore[arg-type]


def _with_sequence_parallel(profile_for: Callable[[int], tuple[Profile | None, str]], tp: int
                            ) -> Callable[[int, bool], tuple[Profile | None, str]]:
    """``(size, sequence parallel) -> (Profile or None, how)``: ``profile_for``'s profile, or
    its :func:`partitioner.recompute.sequence_parallel_profile` over ``tp`` ranks (cached)."""
    cache: dict[int, Profile] = {}

    def get(size: int, sp: bool) -> tuple[Profile | None, str]:
        prof, how = profile_for(size)
        if not sp or prof is None:
            return prof, how
        if size not in cache:
            cache[size] = sequence_parallel_profile(prof, tp)
        return cache[size], how

    return get


def _twin_key(c: Candidate) -> tuple:
    """A layout but for sequence parallelism."""
    return c.schedule, c.virtual_stages, c.microbatches, c.max_inflight, c.recompute_granularity


def _missing_twin(c: Candidate, solved: dict[tuple, Candidate]) -> Candidate | None:
    """The sequence-parallel twin of ``c`` (without sequence parallelism) when it does not fit,
    so that ``c`` cannot: the twin's profile holds no more bytes on any layer."""
    twin = solved.get(_twin_key(c))
    return twin if not c.sequence_parallel and twin is not None and twin.status == "infeasible" else None


def _program_key(c: Candidate) -> tuple:
    """What two solved layouts share when they run one program (their actions then decide)."""
    plan = c.plan
    return (c.microbatches, c.virtual_stages, tuple(map(tuple, plan.stage_ranges)),  # type: ignore[union-attr]
            tuple(plan.stage_recompute), c.recompute_granularity, c.sequence_parallel)  # type: ignore[union-attr]


def _one_of_a_program(c: Candidate, programs: dict[tuple, list[tuple[Candidate, Any]]]) -> bool:
    """Whether solved ``c`` runs the very program of a layout solved before it: the same split,
    recompute and per-rank actions under another name (zb-auto building zb-h2's order, zb-h2
    whose cap leaves no extra microbatch building zb-h1's). Then the one that ranks first stays
    and the other is ``skipped``, naming it, so the table lists each program once. Else ``c`` is
    remembered and False."""
    group = programs.setdefault(_program_key(c), [])   # (layout, its built schedule)
    sched = c.plan.build_schedule()  # type: ignore[union-attr]
    for k, (other, theirs) in enumerate(group):
        if theirs.placement == sched.placement and theirs.actions == sched.actions:
            keep, drop = sorted((other, c), key=_rank_key)
            drop.status, drop.note = "skipped", f"{_SAME} {keep.label} (its split, recompute and actions)"
            group[k] = (keep, theirs)
            return True
    group.append((c, sched))
    return False


def _run(cands: list[Candidate], profile_for: Callable[[int, bool], tuple[Profile | None, str]], p: int, B: int,
         n: int, kwargs: dict[str, Any], keep: int | None, v_split_budget: float, best: list[float]) -> list[str]:
    """Solve the layouts in order of their lower bounds (a sequence-parallel layout before its
    twin), pruning once the table is settled. ``best``: the sorted steps of the layouts that fit
    so far (this search's, and others' ranked in the same table), extended in place."""
    notes: list[str] = []
    for c in cands:
        prof, c.profile = profile_for(B // c.microbatches, c.sequence_parallel)
        if prof is None:
            c.status, c.note, c.lower_bound_s = "skipped", c.profile, math.inf
        else:
            c.lower_bound_s = _lower_bound(prof, c, p)
    sp_solved: dict[tuple, Candidate] = {}
    programs: dict[tuple, list[tuple[Candidate, Any]]] = {}
    for c in sorted(cands, key=lambda c: (c.lower_bound_s, not c.sequence_parallel, c.recompute_granularity != "chunk")):
        if c.status == "skipped":
            continue
        if keep is not None and len(best) > keep and c.lower_bound_s > best[keep]:
            c.status = "pruned"
            c.note = f"lower bound {c.lower_bound_s * 1e3:.3f} ms > the {keep + 1}th best step"
            continue
        if SCHEDULE_INFO[c.schedule].placement == "v" and p * n ** 4 / 4 > v_split_budget:
            c.status = "skipped"
            c.note = (f"zbv's exact V split of {n} layers over {p} ranks costs O(p n^4) (~{p * n ** 4 / 4:.1e} "
                      f"steps > v_split_budget {v_split_budget:.0e})")
            continue
        twin = _missing_twin(c, sp_solved)
        if twin is not None:
            c.status, c.note = "infeasible", f"not solved, as its sequence-parallel twin (no more bytes): {twin.note}"
            continue
        _solve(c, profile_for(B // c.microbatches, c.sequence_parallel)[0], p, kwargs)  # type: ignore[arg-type]
        if c.status == "ok" and c.recompute_granularity != "chunk" and not any(c.recompute):
            c.status, c.note = "skipped", ("no chunk recomputes: a plan of chunk checkpoints too (that twin is at "
                                           "least as fast)")
        if c.sequence_parallel:
            sp_solved[_twin_key(c)] = c
        if c.status == "ok" and not _one_of_a_program(c, programs):
            best.append(c.step_s)  # type: ignore[arg-type]
            best.sort()
    same = sum(c.status == "skipped" and c.note.startswith(_SAME) for c in cands)
    if same:
        notes.append(f"{same} layout(s) skipped: each {_SAME} a layout ranked before it (its note names which)")
    for why in dict.fromkeys(c.note for c in cands if c.status == "skipped" and not c.note.startswith(_SAME)):
        notes.append(f"{sum(c.note == why for c in cands)} layout(s) skipped: {why}")
    notes.append("microbatch costs: " + "; ".join(sorted({f"m={c.microbatches}: {c.profile}" for c in cands},
                                                          key=lambda x: int(x[2:].split(":")[0]))))
    if any(c.status == "pruned" for c in cands):
        notes.append("pruned: layouts whose lower bound cannot enter the table (not solved)")
    return notes


def _nothing_fits(ranked: list[Candidate], memory_limit_bytes: Any, again: Callable[[Candidate], None]) -> str:
    """Why no layout works, with the partitioner's advice for one layout of each schedule (the
    first four: an infeasible one solved ``again`` with the stage-count advice)."""
    seen, hints = set(), []
    for c in ranked:
        if c.schedule not in seen and c.note and len(hints) < 4:
            seen.add(c.schedule)
            if c.status == "infeasible":
                again(c)
            hints.append(f"{c.label}: {c.note}")
    return (f"no layout of the {len(ranked)} considered fits memory_limit_bytes={memory_limit_bytes}; "
            + " | ".join(hints[:4]))


def parallel_layouts(gpus_per_stage: int, batch: int, tensor_parallel: Sequence[int],
                     zero_stages: Sequence[int]) -> list[tuple[int, int, int]]:
    """The (tensor_parallel, data_parallel, zero_stage) triples :func:`search_parallel` solves:
    each tp degree dividing ``gpus_per_stage`` (the GPUs of one pipeline stage, dp x tp), whose
    replicas ``gpus_per_stage / tp`` divide the global ``batch``; with one replica only ZeRO-0
    (nothing to shard over).

    >>> parallel_layouts(8, 16, [1, 2, 8, 3], [1, 3])
    [(1, 8, 1), (1, 8, 3), (2, 4, 1), (2, 4, 3), (8, 1, 0)]
    """
    out = []
    for t in sorted(set(int(x) for x in tensor_parallel)):
        if t < 1 or gpus_per_stage % t:
            continue
        d = gpus_per_stage // t
        if batch % d:
            continue
        for z in sorted({0} if d == 1 else set(int(x) for x in zero_stages)):
            out.append((t, d, z))
    return out


def search_parallel(profile_for_tp: Callable[[int], ProfileSource], num_stages: int, batch: int,
                    gpus_per_stage: int, *, tensor_parallel: Sequence[int] = (1,),
                    zero_stages: Sequence[int] = (1,), top: int = 5,
                    sequence_parallel: "bool | str | Callable[[int], bool | str]" = False,
                    **kwargs: Any) -> SearchResult:
    """:func:`search` over the 3-D layouts too: on ``num_stages x gpus_per_stage`` GPUs with a
    global ``batch`` (samples per step), each (tensor parallel, data parallel, ZeRO stage) of
    :func:`parallel_layouts` is searched (``profile_for_tp(t)``: the profile source of one tp
    rank, as :func:`search` takes it; the batch per replica ``batch / dp``) and every layout of
    every triple is ranked together: with the GPUs and the batch fixed, the fastest step is the
    most tokens per second per GPU. Under ZeRO-3 the reshard policy is the planner's per layout
    (``reshard_after_forward`` None, :func:`partitioner.partition`) unless given in ``kwargs``.
    ``sequence_parallel``: :func:`search`'s, or a callable ``tp -> that`` (whether the model can
    split its sequence over ``tp`` ranks). ``kwargs``: :func:`search`'s other keywords (not
    ``data_parallel`` / ``zero_stage`` / ``tensor_parallel``). Raises :class:`PartitionError` when
    no triple has a layout that fits.
    """
    t0 = time.perf_counter()
    triples = parallel_layouts(int(gpus_per_stage), int(batch), tensor_parallel, zero_stages)
    if not triples:
        raise ValueError(f"no tensor-parallel degree of {list(tensor_parallel)} divides {gpus_per_stage} GPUs per "
                         f"stage into replicas that divide the batch of {batch}; list divisors of {gpus_per_stage}")
    cands: list[Candidate] = []
    notes: list[str] = []
    spent, steps = 0.0, []   # steps: of every triple's layouts that fit, one pruning bound for the table
    for t, d, z in sorted(triples, key=lambda x: -x[0]):   # most tp first: least compute per rank, prunes early
        reshard = kwargs.get("reshard_after_forward") if z == 3 else None
        kw = dict(kwargs, reshard_after_forward=reshard)
        try:
            sp = sequence_parallel(t) if callable(sequence_parallel) else sequence_parallel
            res = search(profile_for_tp(t), num_stages, batch // d, data_parallel=d, zero_stage=z,
                         tensor_parallel=t, top=top, sequence_parallel=sp, table_steps=steps, **kw)
        except (PartitionError, ValueError) as exc:   # nothing fits; no microbatch count divides its batch
            notes.append(f"dp{d} tp{t} zero{z}: {str(exc)[:300]}")
            continue
        spent += res.profile_seconds
        for c in res.candidates:
            c.tensor_parallel, c.data_parallel, c.zero_stage = t, d, z
            c.reshard_after_forward = c.plan.reshard_after_forward if c.plan is not None else reshard
        cands += res.candidates
    ranked = sorted(cands, key=_rank_key)
    if not ranked or ranked[0].status != "ok":
        raise PartitionError(f"no 3-D layout of {[f'dp{d} tp{t} zero{z}' for t, d, z in triples]} fits: "
                             + " | ".join(n[:400] for n in notes))
    notes.append(f"3-D layouts searched (pp{num_stages} x dp x tp on {num_stages * gpus_per_stage} GPUs, "
                 f"global batch {batch}): " + ", ".join(f"dp{d} tp{t} zero{z}" for t, d, z in triples))
    result = SearchResult(ranked[0].plan, ranked, time.perf_counter() - t0, notes,  # type: ignore[arg-type]
                          profile_seconds=spent)
    result.plan.search = result.record(top)
    result.plan.notes.append(f"chosen by the 3-D search over {len(ranked)} layouts (tensor parallel, replicas, "
                             "ZeRO stage, reshard policy, sequence parallelism, schedule, chunks, microbatches, "
                             "recompute and its granularity, split)")
    return result
