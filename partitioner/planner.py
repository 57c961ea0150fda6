"""``partition``: profile in, :class:`~partitioner.plan.Plan` out.

Example::

    from partitioner import LayerCost, Profile, partition
    prof = Profile([LayerCost(1e-3, 2e-3, 4 << 20, 8 << 20, 1 << 20)] * 16)
    plan = partition(prof, 4, microbatches=8, memory_limit_bytes=200 << 20)
    print(plan.summary())

How it decides (``method="optimal"``): the exact min-bottleneck contiguous split
(:func:`partitioner.solve.optimal_split`) where a stage's time is forward + backward (+ one
more forward when it recomputes) + twice its outgoing boundary transfer (activation forward,
gradient back) on its boundary's link (:mod:`partitioner.transfers`: the rate given, the one
measured with the fixed costs, or the device spec's NVLink / NIC by whether the two ranks share a
node; each stage's cut time its own), and a stage's memory is its static state
plus in-flight activations for the schedule plus boundary buffers (see ``memory.py``). The
plan's ``step_s`` and ``bubble_fraction`` then come from ``engine.simulate`` on the same
costs (:meth:`Plan.simulate`). Many splits tie or nearly tie on the bottleneck while the
schedule runs them at different speeds (a V's two chunks per rank, interleaving's fill, a
split backward's deferred W), so the min-bottleneck split is then refined on that predicted
step: every split when there are at most ``_REFINE_BUDGET``, else a local search from it (a
layer moved between two chunks, or two cuts moved apart), keeping only splits that fit. For ``virtual_stages > 1`` with loop placement
(interleaved-1f1b) the search runs over the ``p * v`` chunks: it is exact for the largest chunk
time under the per-chunk limit ``rank limit / v``, a sufficient condition for the rank to fit (a
split that fits only by giving one chunk of a rank more than 1/v of its memory is not found); the
reported rank memory is the exact sum of its chunks. For the V placement (zbv, rank r holds
chunks r and 2p-1-r) the search is exact for the rank's time and memory, each the sum of its two
chunks (:func:`partitioner.vsplit.optimal_v_split`). Which rank runs which chunk comes from
``engine.schedules`` (``chunk_ranks``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import numpy as np

from engine.choices import check_recompute_granularity
from engine.footprint import GRAD_BUCKET_MB, ZeroTensors, zero_tensors
from engine.schedules import SCHEDULE_INFO, build_schedule, chunk_ranks, message_ends, peak_inflight, send_mode

from .batchsim import compile_schedule, simulate_many
from .collectives import Links, group_link, megatron_allreduces
from .costs import FixedCosts, Profile
from .memory import (SCHEDULES, ChunkBytes, MemorySettings, RankPeaks, held_and_pending, inflight_from_schedule,
                     inflight_per_chunk, kept_output_bytes, layer_transient, loss_split, peak_state, program_peaks, rank_breakdown,
                     rank_totals, schedule_states)
from .plan import PartitionError, Plan
from .transfers import Transfers, transfer_model
from .solve import (Infeasible, fits_any, greedy_split, min_memory_scale, optimal_split, parameter_split,
                    pipeline_lower_bound, split_costs, uniform_split)
from .vsplit import min_v_memory_scale, optimal_v_split

__all__ = ["partition", "METHODS", "CHECKPOINTING", "checkpointing_mode", "recompute_follows", "without_stage_advice"]

_STAGE_ADVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("stage_advice", default=True)


@contextlib.contextmanager
def without_stage_advice() -> Iterator[None]:
    """Within it, a :class:`PartitionError` leaves out ", or use N stages" (which builds the
    schedule at other stage counts: seconds for zb-auto): for callers that discard the message
    (``partition``'s reshard choice, ``partitioner.search`` until it reports). The smallest limit
    that works is still named."""
    token = _STAGE_ADVICE.set(False)
    try:
        yield
    finally:
        _STAGE_ADVICE.reset(token)

METHODS: tuple[str, ...] = ("optimal", "uniform", "parameters", "greedy")

CHECKPOINTING: tuple[str, ...] = ("off", "on", "auto")
"""The activation-checkpointing modes, the one rule that :func:`partition`, ``partitioner.search``
and the experiments follow: ``off`` (False): no chunk recomputes, only splits that fit without
recomputation are considered; ``on`` (True): every chunk recomputes; ``auto``: the planner
recomputes per chunk where the memory limit needs it."""

_CHECKPOINTING_NAMES = {"false": "off", "off": "off", "true": "on", "on": "on", "auto": "auto"}


def checkpointing_mode(value: Any) -> str:
    """``activation_checkpointing`` (False, True, "auto" or their names) as one of
    :data:`CHECKPOINTING`; ValueError otherwise.

    >>> checkpointing_mode(False), checkpointing_mode("true"), checkpointing_mode("auto")
    ('off', 'on', 'auto')
    """
    mode = _CHECKPOINTING_NAMES.get(str(value).strip().lower()) if isinstance(value, (bool, str)) else None
    if mode is None:
        raise ValueError(f"activation_checkpointing must be False (no chunk recomputes), True (every chunk "
                         f"recomputes) or 'auto' (the planner recomputes per chunk where memory needs it), "
                         f"got {value!r}")
    return mode


def recompute_follows(activation_checkpointing: Any, recompute: Sequence[bool]) -> bool:
    """Whether a per-chunk recompute choice (``Plan.stage_recompute``) is one the mode allows:
    none recompute (off), all (on), any (auto).

    >>> recompute_follows(False, [False, False]), recompute_follows(True, [True, False])
    (True, False)
    """
    mode, chosen = checkpointing_mode(activation_checkpointing), [bool(x) for x in recompute]
    return mode == "auto" or chosen == [mode == "on"] * len(chosen)

_BASELINE_NOTES = {
    "uniform": "uniform: equal layer counts (Megatron); memory limits not used to choose",
    "parameters": "parameters: balanced parameter bytes (DeepSpeed's default); memory limits not used to choose",
    "greedy": "greedy: torchgpipe block-partition local search on time; memory limits not used to choose",
}


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f} GiB"


@dataclass
class _Problem:
    """One partitioning problem: per-layer cost arrays, the layout and the memory caps."""

    p: int
    m: int
    v: int
    schedule: str
    max_inflight: int | None                  # zb-h2's memory knob (None: its default)
    ckpt: str                                 # "off" | "on" | "auto"
    link: float | None                        # the plan's link figure (Transfers.link_bytes_per_s)
    f: np.ndarray                             # forward seconds per layer
    b: np.ndarray                             # backward seconds per layer (split: I + W)
    w: np.ndarray                             # weight-gradient seconds per layer
    b_whole: np.ndarray                       # the unsplit backward (recomputing chunks, chunk 0 w/o input grad)
    static: np.ndarray                        # per layer: its parameters' state (the search's view)
    act: np.ndarray
    out: np.ndarray
    shared: np.ndarray
    comm_layer: np.ndarray                    # (rows, n): transfer seconds of a cut after each layer, per link
    comm_of: np.ndarray                       # per boundary (k - 1), its row of comm_layer
    inflight: list[int]                       # microbatches held per chunk (the search's view)
    pend: np.ndarray                          # per layer: gradients kept from I to W (0: no split)
    pending: list[int]                        # microbatches pending (I done, W not) per chunk
    states: list | None                       # per rank, its (held, pending) states (split backward)
    input_grad: bool                          # the model input requires grad (else chunk 0 defers all to W)
    limits: list[float] | None                # the memory limit per rank
    names: list[str]
    param: np.ndarray                         # parameter bytes per layer
    fixed: FixedCosts | None                  # the runtime's fixed costs (None: compute only)
    memory: MemorySettings                    # what the run holds per parameter
    numel: np.ndarray                         # parameters per layer
    largest: np.ndarray                       # elements of each layer's largest parameter
    workspace: np.ndarray                     # each layer's backward transient, bytes
    reserve: list[float]                      # per rank, bytes taken off the limit before the search
    loss_variants: dict = field(default_factory=dict)   # name -> () -> this problem with another loss head
    _sums: dict = field(default_factory=dict, repr=False)
    has_loss: bool = False                    # the last layer was profiled with the loss
    out_saved: np.ndarray | None = None       # per layer: bytes of its output it saved itself
    transfers: tuple[int, str] = (0, "step")  # the runtime's receive lookahead and send_wait
    loss_cut: tuple[float, float] = (0.0, 0.0)  # per-layer cut: the loss input kept, the loss's saved freed at I
    explain: bool = True                      # an infeasible search says why (and what would fit)
    ag: np.ndarray | None = None              # per layer: ZeRO-3's all-gather of its weights, seconds
    param_numels: list | None = None          # per layer: its parameter tensors' elements (None: unknown)
    rs: np.ndarray | None = None              # per layer: ZeRO-3's reduce-scatter of its gradients, seconds
    granularity: str = "chunk"                # a recomputing chunk's checkpoints: the chunk, or each layer
    act_layer: np.ndarray | None = None       # per layer, checkpointed on its own: what it keeps (its input)
    ws_layer: np.ndarray | None = None        # ... and its backward's transient (recompute + workspace)
    xfer: Transfers = Transfers("free")       # where the transfer costs come from

    @property
    def n(self) -> int:
        return len(self.f)

    @functools.cached_property
    def ranks(self) -> list[int]:
        """The rank of each chunk (the schedule's placement)."""
        return chunk_ranks(self.schedule, self.p, self.v)

    def sums(self, a: int, e: int) -> tuple[float, float, float, float, float]:
        """Layers ``a:e``'s forward, whole backward, backward, W and parameter bytes (each
        ``float(arr[a:e].sum())``, cached: the refinement prices many splits sharing chunks)."""
        got = self._sums.get((a, e))
        if got is None:
            got = self._sums[(a, e)] = tuple(float(x[a:e].sum()) for x in (self.f, self.b_whole, self.b, self.w,
                                                                              self.param))
        return got  # type: ignore[return-value]

    @property
    def vee(self) -> bool:
        return SCHEDULE_INFO[self.schedule].placement == "v"

    @property
    def k(self) -> int:
        return self.p * self.v

    @functools.cached_property
    def cut_time(self) -> np.ndarray:
        """Per cut position (n + 1), a stage's outgoing transfers (activation forward, gradient
        back): one row for every stage, or one per stage (``(k, n + 1)``) when boundaries differ."""
        rows = np.zeros((len(self.comm_layer), self.n + 1))
        rows[:, 1:-1] = 2 * self.comm_layer[:, :-1]
        if len(rows) == 1:
            return rows[0]
        return np.vstack([rows[self.comm_of], np.zeros((1, self.n + 1))])

    def boundary_comm(self, cuts: np.ndarray) -> np.ndarray:
        """Transfer seconds per boundary (rows) of splits whose cut positions are the columns of
        ``cuts`` (``(k - 1, splits)``)."""
        return self.comm_layer[self.comm_of[:, None], np.asarray(cuts, dtype=np.int64) - 1]

    @property
    def rank_caps(self) -> list[float] | None:
        """The limits the search works with: each rank's limit less its reserve (what does not
        add over layers: the largest parameter's transient, the backward workspace)."""
        if self.limits is None:
            return None
        return [max(c - r, 1.0) for c, r in zip(self.limits, self.reserve)]

    @property
    def chunk_caps(self) -> list[float] | None:
        return None if self.rank_caps is None else [self.rank_caps[r] / self.v for r in self.ranks]

    @property
    def common(self) -> dict[str, Any]:
        return dict(static=self.static, act=self.act, out=self.out, inflight=self.inflight, shared=self.shared,
                    pend=self.pend, pending=self.pending, recompute_act=self.act_layer)

    def arrays(self, recompute: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per layer, the saved activations and backward workspace of a chunk as the engine runs
        it: a chunk recomputing layer by layer has its layers' checkpointed costs
        (:func:`partitioner.recompute.checkpoint_each_layer`), any other chunk the profile's."""
        if recompute and self.act_layer is not None:
            return self.act_layer, self.ws_layer   # type: ignore[return-value]
        return self.act, self.workspace


def partition(profile: Profile, num_stages: int, *, schedule: str = "1f1b", microbatches: int,
              virtual_stages: int = 1, data_parallel: int = 1, zero_stage: int = 1, optimizer: str = "adamw",
              memory_limit_bytes: "float | Sequence[float] | None" = None, method: str = "optimal",
              link_bytes_per_s: float | None = None, activation_checkpointing: "bool | str" = False,
              simulate: bool = True, max_inflight: int | None = None, precision: str | None = None,
              momentum: float = 0.0, grad_accum_dtype: str = "fp32", backend: str = "auto",
              overlap_grad_reduce: bool = True, grad_bucket_mb: float = GRAD_BUCKET_MB,
              step_sync: str = "global", grad_clip: bool = True,
              reshard_after_forward: bool | None = None, tensor_parallel: int = 1,
              links: Links | None = None, recompute_granularity: str = "chunk") -> Plan:
    """Split ``profile`` into ``num_stages`` pipeline stages (see the module docstring).

    ``memory_limit_bytes``: one number for every rank, or one per rank. ``method``: "optimal" or a baseline
    ("uniform", "parameters", "greedy"; baselines ignore the limits when choosing, and the plan reports whether
    each rank fits). ``activation_checkpointing``: False, True (every stage recomputes) or "auto" (a stage
    recomputes only where the exact search needs it to fit). ``simulate``: predict the step with
    :meth:`Plan.simulate` (else the closed form). ``max_inflight``: zb-h2's memory knob. ``precision`` (None: fp32 for a 4-byte profile, bf16 for a 16-bit one),
    ``momentum`` (SGD's), ``grad_accum_dtype``, ``backend``, ``overlap_grad_reduce`` and
    ``grad_bucket_mb``: what the run keeps per parameter (:class:`partitioner.memory.MemorySettings`).
    ``step_sync`` (``optimizer.step_sync``) and ``grad_clip`` (whether it clips): with
    ``"post_validate"`` the ranks' memory holds the rollback snapshot and the step is predicted in
    the steady state of consecutive steps (:meth:`Plan.simulate`).
    ``zero_stage=3`` (FSDP2): parameters, gradients and optimizer state sharded over the
    ``data_parallel`` replicas, the layers gathered in the compute dtype, every layer for the
    step (``reshard_after_forward=False``) or resharded between a chunk's actions (True); None:
    the planner chooses (no resharding unless only resharding fits; ``Plan.reshard_after_forward``
    says which). ``tensor_parallel``: ranks per tensor-parallel group; the profile must be one tp
    rank's (``profile.meta["tensor_parallel"]``, the sharded shapes profiled: see
    docs/performance.md), its all-reduces per layer ``profile.meta["tp_allreduces"]`` (default
    :func:`partitioner.collectives.megatron_allreduces`). ``links``: the collectives' links
    (``DeviceSpec.links``; None: collectives cost nothing, noted in the plan). ``recompute_granularity``:
    "chunk" or "layer" (:func:`partitioner.recompute.checkpoint_each_layer`). Raises
    :class:`PartitionError` when no split fits, naming the smallest limit (or stage count) that would.
    """
    p, m, v = int(num_stages), int(microbatches), int(virtual_stages)
    ckpt, granularity = _check_arguments(profile, p, m, v, schedule, method, link_bytes_per_s,
                                         activation_checkpointing, max_inflight, recompute_granularity)
    _check_parallel(profile, int(tensor_parallel), int(zero_stage), reshard_after_forward)
    if int(zero_stage) == 3 and reshard_after_forward is None:   # the planner's choice
        try:
            with without_stage_advice():   # a failure here is not reported
                plan = partition(profile, p, schedule=schedule, microbatches=m, virtual_stages=v,
                                 data_parallel=data_parallel, zero_stage=3, optimizer=optimizer,
                                 memory_limit_bytes=memory_limit_bytes, method=method, link_bytes_per_s=link_bytes_per_s,
                                 activation_checkpointing=activation_checkpointing, simulate=simulate,
                                 max_inflight=max_inflight, precision=precision, momentum=momentum,
                                 grad_accum_dtype=grad_accum_dtype, backend=backend, reshard_after_forward=False,
                                 overlap_grad_reduce=overlap_grad_reduce, grad_bucket_mb=grad_bucket_mb,
                                 step_sync=step_sync, grad_clip=grad_clip, tensor_parallel=tensor_parallel,
                                 links=links, recompute_granularity=granularity)
            plan.notes.append("reshard_after_forward=false chosen: the layers stay gathered for the step "
                              "(one all-gather per layer per step)")
            return plan
        except PartitionError:
            reshard_after_forward = True
    notes: list[str] = [_RESHARD_NOTE] if reshard_after_forward else []
    memory = MemorySettings(precision or ("fp32" if profile.itemsize >= 4 else "bf16"), optimizer, momentum,
                            int(zero_stage), int(data_parallel), grad_accum_dtype, backend,
                            bool(overlap_grad_reduce), float(grad_bucket_mb), str(step_sync), bool(grad_clip),
                            reshard_after_forward=bool(reshard_after_forward) and int(zero_stage) == 3)
    xfer = transfer_model(profile.fixed, link_bytes_per_s, links, chunk_ranks(schedule, p, v), p,
                          int(data_parallel), int(tensor_parallel))
    prob = _problem(profile, p, m, v, schedule, max_inflight, ckpt, xfer, memory,
                    _rank_caps(memory_limit_bytes, p), simulate, notes,
                    _Parallel(int(tensor_parallel), links), granularity)
    bounds, recompute = _search(method, prob, notes)
    _note_recompute(recompute, ckpt, notes)
    settings = dict(method=method, data_parallel=data_parallel, zero_stage=zero_stage, optimizer=optimizer,
                    max_inflight=max_inflight, step_sync=str(step_sync), tensor_parallel=int(tensor_parallel),
                    recompute_granularity=granularity, sequence_parallel=int(profile.meta.get("sequence_parallel", 1)) > 1)
    local = False
    if method == "optimal" and simulate:
        bounds, local = _refine(prob, bounds, recompute, settings, notes)
    plan = _plan(prob, bounds, recompute, notes, **settings)
    plan.split_search = "local search" if local else "exact" if method == "optimal" else method
    plan.reshard_after_forward = memory.reshard_after_forward if memory.zero3 else None
    if simulate:
        _predict(plan, prob)
    return plan


_RESHARD_NOTE = ("reshard_after_forward=true: a chunk's layers are freed after each of its actions "
                 "(an all-gather per layer per forward and per backward)")


def _check_arguments(profile: Profile, p: int, m: int, v: int, schedule: str, method: str,
                     link: float | None, activation_checkpointing: Any, max_inflight: int | None,
                     recompute_granularity: Any = "chunk") -> tuple[str, str]:
    """Refuse bad arguments (the schedule's own rules come from ``engine.schedules``); returns
    the checkpointing mode ``"off"``, ``"on"`` or ``"auto"`` and the recompute granularity."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"num_stages, microbatches and virtual_stages must be >= 1 (got {p}, {m}, {v})")
    build_schedule(schedule, p, m, v, max_inflight=max_inflight)  # e.g. interleaving needs v >= 2
    if link is not None and link <= 0:
        raise ValueError("link_bytes_per_s must be > 0 (or None for free transfers)")
    ckpt, granularity = checkpointing_mode(activation_checkpointing), check_recompute_granularity(recompute_granularity)
    n, k = len(profile), p * v
    if k > n:
        raise PartitionError(
            f"{p} stages x {v} chunks need at least {k} layers but the profile has {n}; "
            f"use at most {n // v} stages" + (" (or fewer virtual stages)" if v > 1 else "")
            + f": the model has {n} layers")
    return ckpt, granularity


def _check_parallel(profile: Profile, tp: int, zero_stage: int, reshard: bool | None) -> None:
    """Refuse a tensor-parallel degree the profile was not made for, and a reshard policy
    without ZeRO-3."""
    if tp < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tp}")
    got = int(profile.meta.get("tensor_parallel", 1))
    if got != tp:
        raise ValueError(f"tensor_parallel={tp} but the profile is of one rank of tensor_parallel={got}: "
                         f"profile the layers with their tp-sharded shapes (experiments.partition does, from "
                         f"pipeline.tensor_parallel) and set profile.meta['tensor_parallel'] = {tp}")
    counts = profile.meta.get("tp_allreduces")
    if counts is not None and len(counts) != len(profile):
        raise ValueError(f"profile.meta['tp_allreduces'] has {len(counts)} entries; give one (forward, "
                         f"backward) pair per layer ({len(profile)})")
    if reshard is not None and zero_stage != 3:
        raise ValueError(f"reshard_after_forward={reshard!r} is ZeRO-3's (FSDP2) policy; zero_stage={zero_stage} "
                         "keeps whole weights: pass reshard_after_forward=None")


@dataclass(frozen=True)
class _Parallel:
    """The tensor-parallel degree and the collectives' links of a problem."""

    tp: int = 1
    links: Links | None = None


def _collective_times(profile: Profile, memory: MemorySettings, par: _Parallel, notes: list[str], p: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per layer: tensor-parallel all-reduce seconds in its forward and in its backward (per
    microbatch, on the critical path: no overlap with compute), and the replicas' collectives
    per step (seconds each): under ZeRO-3 the all-gather of its weights in the compute dtype and
    the reduce-scatter of its fp32 gradients; under ZeRO-0/1/2 (``ag`` zero) its gradients'
    reduction, an fp32 all-reduce (ZeRO-0) or reduce-scatter plus the all-gather of the updated
    weights (ZeRO-1/2). Each kind on the link its groups take in the ``p``-stage layout
    (:func:`partitioner.collectives.group_link`)."""
    L, n = profile.layers, len(profile)
    zeros = np.zeros(n)
    tp_f, tp_b, ag, rs = zeros.copy(), zeros.copy(), zeros.copy(), zeros.copy()
    dp = memory.data_parallel
    if (par.tp == 1 and dp == 1) or n == 0:
        return tp_f, tp_b, ag, rs
    if par.links is None:
        if par.tp > 1 or memory.zero3:
            notes.append("no links given (DeviceSpec.links): tensor-parallel and data-parallel collectives cost nothing")
        return tp_f, tp_b, ag, rs
    links = par.links
    tp_link, dp_link = (group_link(kind, p, dp, par.tp, links.gpus_per_node) for kind in ("tp", "dp"))
    _note_group_links(links, par.tp, dp, tp_link, dp_link, notes)
    if par.tp > 1:
        counts = profile.meta.get("tp_allreduces") or megatron_allreduces(n)
        for i, (nf, nb) in enumerate(counts):
            tp_f[i] = nf * links.all_reduce(L[i].output_bytes, par.tp, tp_link)
            tp_b[i] = nb * links.all_reduce(L[i - 1].output_bytes if i > 0 else L[i].output_bytes, par.tp, tp_link)
        timed = (" (the layers' times: DTensor's compute on a tp rank, partitioner.tptime, without them)"
                 if profile.meta.get("tp_time") == "dtensor" else "")
        notes.append(f"tensor parallel {par.tp}: {float(tp_f.sum() + tp_b.sum()) * 1e3:.3f} ms of all-reduces per "
                     f"microbatch (forward + backward, all layers), not overlapped with compute{timed}")
    if dp > 1:
        numel = np.array([c.param_bytes for c in L], dtype=np.float64) / profile.itemsize
        if memory.zero3:
            w = memory.gathered_bytes_per_param()
            ag = np.array([links.all_gather(w * x, dp, dp_link) if x else 0.0 for x in numel])
            rs = np.array([links.reduce_scatter(4.0 * x, dp, dp_link) if x else 0.0 for x in numel])
        elif memory.zero_stage == 0:
            rs = np.array([links.all_reduce(4.0 * x, dp, dp_link) if x else 0.0 for x in numel])
        else:
            rs = np.array([links.reduce_scatter(4.0 * x, dp, dp_link)
                           + links.all_gather(profile.itemsize * x, dp, dp_link) if x else 0.0 for x in numel])
    return tp_f, tp_b, ag, rs


def _note_group_links(links: Links, tp: int, dp: int, tp_link: str, dp_link: str, notes: list[str]) -> None:
    """One line for the plan's notes: which link the tp and dp collectives run on, and why."""
    kinds = [(what, link) for what, size, link in (("tensor-parallel", tp, tp_link), ("data-parallel", dp, dp_link))
             if size > 1]
    if not kinds:
        return
    said = "; ".join(f"{what} on the {link}-node link" for what, link in kinds)
    if links.gpus_per_node is None:
        notes.append(f"collectives: {said} (node size not known: tensor parallel taken as within a node, "
                     "data parallel as across nodes)")
    else:
        g = links.gpus_per_node
        notes.append(f"collectives: {said} ({g} GPU{'s' if g != 1 else ''} per node in the engine's rank order; "
                     "a group spanning nodes runs at the inter-node rate)")


def _rank_caps(memory_limit_bytes: "float | Sequence[float] | None", p: int) -> list[float] | None:
    """The memory limit per rank (None: no limit)."""
    if memory_limit_bytes is None:
        return None
    if np.ndim(memory_limit_bytes) == 0:
        caps = [float(memory_limit_bytes)] * p  # type: ignore[arg-type]
    else:
        caps = [float(x) for x in memory_limit_bytes]  # type: ignore[union-attr]
        if len(caps) != p:
            raise ValueError(f"memory_limit_bytes has {len(caps)} entries; give one number or {p} (one per rank)")
    if min(caps) <= 0:
        raise ValueError("memory_limit_bytes must be > 0")
    return caps


def _problem(profile: Profile, p: int, m: int, v: int, schedule: str, max_inflight: int | None, ckpt: str,
             xfer: Transfers, memory: MemorySettings, limits: list[float] | None, simulate: bool,
             notes: list[str], par: _Parallel = _Parallel(), granularity: str = "chunk") -> _Problem:
    """The profile as arrays, with the schedule's in-flight microbatches per chunk (and, under
    per-layer recompute, each layer's checkpointed costs)."""
    L = profile.layers
    numel = np.array([c.param_bytes for c in L], dtype=np.float64) / profile.itemsize
    largest = np.array([c.param_bytes if c.largest_param_bytes is None else c.largest_param_bytes
                        for c in L], dtype=np.float64) / profile.itemsize
    workspace = np.array([2 * c.output_bytes if c.workspace_bytes is None else c.workspace_bytes for c in L],
                         dtype=np.float64)
    if L and L[0].workspace_bytes is None and not profile.meta.get("input_requires_grad", True):
        workspace[0] = 0.0   # token ids in: the first layer's backward makes its weight gradient only
    rank_numel = max(float(numel.sum()) / p, 1.0)   # the per-parameter costs at a balanced rank's size
    per_param = max(memory.per_param_bytes(rank_numel), memory.step_per_param_bytes(rank_numel))
    if memory.zero3 and memory.reshard_after_forward and not SCHEDULE_INFO[schedule].splits_backward:
        # one of a rank's v chunks gathered at a time, as the search sees it (each chunk books 1/v of
        # its gathered copy; the exact peak, _rank_moments, corrects the split when it is more)
        per_param -= memory.gathered_bytes_per_param() * (1.0 - 1.0 / v)
    # the loss's backward transient (the last layer's workspace) only on the rank holding it
    # (under per-layer recompute a recomputing layer's transient is larger: the exact peaks of
    # _search take what the search's view leaves out off the limit and search again)
    layered = _layer_checkpointed(profile, granularity, workspace)
    rest = float(workspace[:-1].max()) if len(L) > 1 else 0.0
    last_rank = chunk_ranks(schedule, p, v)[-1]
    reserve = [memory.largest_param_bytes(float(largest.max())) + (float(workspace.max()) if r == last_rank else rest)
               for r in range(p)]
    out = np.array([c.output_bytes for c in L], dtype=np.float64)
    comm_layer, comm_of = xfer.rows(out)
    if not comm_of.size:
        comm_of = np.zeros(max(p * v - 1, 0), dtype=np.int64)
    if p * v > 1:
        notes.append(xfer.note())
    act = np.array([c.activation_bytes for c in L], dtype=np.float64)
    pend = np.zeros(len(L))
    inflight, pending, states = _counts(profile, schedule, p, m, v, max_inflight, memory, simulate, act, pend)
    source = "engine schedule" if simulate or states else "closed form"
    notes.append(f"in-flight microbatches per stage {inflight} (from the {source})")
    if profile.meta.get("caches") == "cold":   # the bound, not the default (engine.caches)
        notes.append("layer times measured with cold caches (partitioner.caches=cold): every layer's data read "
                     "from memory, an upper bound on what the caches cost a step")
    tp_f, tp_b, ag, rs = _collective_times(profile, memory, par, notes, p)
    whole = np.array([c.backward_s for c in L]) + tp_b
    fwd = np.array([c.forward_s for c in L]) + tp_f
    if memory.reshard_after_forward:   # an all-gather per layer per action, overlapped with its compute
        fwd, whole = np.maximum(fwd, ag), np.maximum(whole, ag)
    if SCHEDULE_INFO[schedule].splits_backward:
        notes.append(f"microbatches with weight gradients pending (I done, W not) per stage {pending}, "
                     f"at the peak of activations + kept gradients")
        b = np.array([c.split_backward_s for c in L]) + tp_b
        if memory.reshard_after_forward:
            b = np.maximum(b, ag)
        if b.sum() > whole.sum() * 1.001:
            notes.append(f"split backward (I + W) costs {b.sum() / whole.sum():.3f}x the whole backward "
                         "(measured on the engine's split)")
    else:
        b = whole
    return _Problem(
        p=p, m=m, v=v, schedule=schedule, max_inflight=max_inflight, ckpt=ckpt, link=xfer.link_bytes_per_s,
        f=fwd, b=b, b_whole=whole, ag=ag, rs=rs,
        w=np.array([c.weight_s for c in L]),
        static=numel * per_param, act=act, out=out, pend=pend, pending=pending, states=states,
        input_grad=bool(profile.meta.get("input_requires_grad", True)),
        shared=np.array([c.shared_input_bytes for c in L], dtype=np.float64),
        comm_layer=comm_layer, comm_of=comm_of, xfer=xfer, inflight=inflight, limits=limits, names=[c.name for c in L],
        param=np.array([c.param_bytes for c in L], dtype=np.float64), fixed=profile.fixed, memory=memory,
        numel=numel, largest=largest, workspace=workspace, reserve=reserve,
        param_numels=[c.param_numels for c in L] if all(c.param_numels is not None for c in L) else None,
        loss_variants={name: (lambda prof=prof: _problem(prof, p, m, v, schedule, max_inflight, ckpt, xfer, memory,
                                                          limits, simulate, [], par, granularity))
                       for name, prof in _loss_variant_profiles(profile).items()},
        out_saved=np.array([c.output_saved_bytes or 0 for c in L], dtype=np.float64),
        transfers=_transfers(profile, schedule, p, m, v, max_inflight), has_loss=bool(profile.meta.get("loss")),
        loss_cut=memory.loss_cut_bytes(L[-1]) if SCHEDULE_INFO[schedule].splits_backward and profile.meta.get("loss")
        else (0.0, 0.0), granularity=granularity,
        act_layer=None if layered is None else layered[0], ws_layer=None if layered is None else layered[1])


def _layer_checkpointed(profile: Profile, granularity: str, workspace: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray] | None:
    """Under per-layer recompute, each layer's saved bytes and backward transient when
    checkpointed on its own, by the one rule of :func:`partitioner.recompute.checkpoint_each_layer`
    (every layer: the engine wraps each layer of a recomputing chunk, the last one with the loss);
    None for chunk recompute. (With ``ckpt`` off only the advice of an infeasible search reads
    them: "activation_checkpointing='auto' would also fit".)"""
    if granularity != "layer":
        return None
    from .recompute import checkpoint_each_layer

    layers = [replace(c, workspace_bytes=float(w)) for c, w in zip(profile.layers, workspace)]
    got = checkpoint_each_layer(replace(profile, layers=layers), range(len(profile))).layers
    return (np.array([c.activation_bytes for c in got], dtype=np.float64),
            np.array([c.workspace_bytes for c in got], dtype=np.float64))


def _loss_variant_profiles(profile: Profile) -> dict[str, Profile]:
    """The profile with its last layer (and loss) replaced by each of ``meta["loss_variants"]``
    (``partitioner.profile(loss_variants=...)``: e.g. the chunked LM head of a full one)."""
    from .costs import LayerCost

    out = {}
    for name, cost in (profile.meta.get("loss_variants") or {}).items():
        meta = {k: val for k, val in profile.meta.items() if k != "loss_variants"}
        out[name] = replace(profile, layers=[*profile.layers[:-1], LayerCost(**cost)], meta=meta)
    return out


def _transfers(profile: Profile, schedule: str, p: int, m: int, v: int, max_inflight: int | None
               ) -> tuple[int, str]:
    """The receive lookahead and send wait the runtime will use (``engine.policy``'s defaults)
    on the backend of the profiled device: NCCL for a CUDA measurement or a GPU preset, gloo
    for the CPU."""
    from engine.policy import default_recv_lookahead, default_send_wait, default_transport_threads

    device = str(profile.meta.get("device", "")) if profile.meta.get("mode") == "measure" else \
        str(profile.meta.get("device_spec", "cpu"))
    backend = "gloo" if device in ("", "cpu") or device.startswith("cpu") else "nccl"
    sched = build_schedule(schedule, p, m, v, max_inflight=max_inflight)
    return (default_recv_lookahead(backend, sched),
            default_send_wait(backend, sched, default_transport_threads(backend, sched)))


def _counts(profile: Profile, schedule: str, p: int, m: int, v: int, max_inflight: int | None,
            memory: MemorySettings, simulate: bool, act: np.ndarray, pend: np.ndarray
            ) -> tuple[list[int], list[int], list | None]:
    """Per chunk, the microbatches held and pending for the search, and (split-backward
    schedules, several chunks per rank) each rank's states; fills ``pend`` (bytes kept from I to
    W per layer). The search's state of a rank is its peak with every chunk costing the
    profile's mean layer."""
    k, split = p * v, SCHEDULE_INFO[schedule].splits_backward
    if split:
        pend[:] = [memory.pending_grad_bytes(c) for c in profile.layers]
    if not (simulate or split or v > 1):
        return inflight_per_chunk(schedule, p, m, v, max_inflight=max_inflight), [0] * k, None
    sched = build_schedule(schedule, p, m, v, max_inflight=max_inflight)   # what the engine will run
    if not split and v == 1:   # one chunk per rank, nothing pending: its peak is its peak count
        return peak_inflight(sched), [0] * k, None
    # several chunks per rank or a split backward: which state is a rank's peak depends on the
    # split's bytes, so the plan re-reads it for the split found (``_chunk_counts``)
    states = schedule_states(sched)
    inflight, pending = [0] * k, [0] * k
    for r, mine in enumerate(sched.stages_of(r) for r in range(p)):   # as ``held_and_pending``, states read once
        h, q = peak_state(states[r], [float(act.mean())] * len(mine), [float(pend.mean())] * len(mine))
        for i, c in enumerate(mine):
            inflight[c], pending[c] = h[i], q[i]
    return inflight, pending, states


def _search(method: str, prob: _Problem, notes: list[str]) -> tuple[list[tuple[int, int]], list[bool]]:
    """The split (and where to recompute). The search sees additive per-layer costs; when the
    exact per-rank peak of its answer exceeds a rank's limit (the step phase, bucket caps), the
    shortfall is taken off that rank's limit and the search runs again."""
    for attempt in range(4):
        found: list[str] = []
        if method == "optimal":
            bounds, recompute = _optimal(prob, found)
        else:
            bounds, recompute = _baseline(method, prob, found)
        if method != "optimal" or prob.limits is None:
            break
        peaks = _rank_peaks(prob, bounds, recompute)
        over = [max(0.0, peaks[r] - prob.limits[r]) for r in range(prob.p)]
        if not any(over):
            break
        prob.reserve = [res + o * 1.001 + 1.0 for res, o in zip(prob.reserve, over)]
    notes.extend(found)
    if attempt:
        notes.append(f"searched {attempt + 1} times: each rank's limit less what its exact peak showed "
                     f"beyond the per-layer costs ({[_gib(x) for x in prob.reserve]})")
    return bounds, recompute


def _chunk_bytes(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool]) -> list[ChunkBytes]:
    """Per chunk, what it holds per held and per pending microbatch and its cut tensors (0 at
    the model's ends and at a hand-off between two chunks of one rank)."""
    ranks, out = prob.ranks, []
    grad_bytes = prob.memory.made_gradient_bytes_per_param()
    for c, (a, e) in enumerate(bounds):
        local_in = c > 0 and ranks[c - 1] == ranks[c]
        local_out = c < prob.k - 1 and ranks[c + 1] == ranks[c]
        held = (_held_activation_bytes(prob, a, e, 1, recompute[c])
                - _held_activation_bytes(prob, a, e, 0, recompute[c]))
        if local_out:   # the hand-off's storage is the next chunk's saved input
            held -= _kept_output(prob, e, recompute[c])
        out.append(ChunkBytes(held, _pending_bytes(prob, a, e, recompute[c]) - _pending_freed(prob, e, recompute[c]),
                              0.0 if a == 0 or local_in else float(prob.out[a - 1]),
                              0.0 if e == prob.n or local_out else float(prob.out[e - 1]),
                              grad_bytes * float(prob.numel[a:e].sum())))
    return out


def _peaks(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool]) -> list[RankPeaks]:
    """Per rank, its peaks in forward and backward actions, before and after its first weight
    gradients: the engine's program walked with this split's bytes
    (:func:`partitioner.memory.program_peaks`)."""
    chunks = _chunk_bytes(prob, bounds, recompute)
    sched = build_schedule(prob.schedule, prob.p, prob.m, prob.v, max_inflight=prob.max_inflight)
    lookahead, send_wait = prob.transfers
    return program_peaks(sched, chunks, lookahead=lookahead, send_wait=send_wait)


def _rank_moments(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool]
                  ) -> list[tuple[dict[str, float], list[int], list[int]]]:
    """Each rank's memory at its peak (the largest of its moments: forward, backward, or a split
    backward's I or W, before or after its first weight gradients, and the step), with its
    chunks' held and pending microbatches then (a recomputing chunk keeps no gradients to W)."""
    out = []
    ranks = prob.ranks
    for r, peaks in enumerate(_peaks(prob, bounds, recompute)):
        mine = [c for c, rank in enumerate(ranks) if rank == r]
        layers = [i for c in mine for i in range(*bounds[c])]
        transients = _transients(prob, bounds, recompute, mine)
        overlap = _zero_tensors(prob, bounds, mine, recompute)
        best = None
        for kind, made, pk in peaks.moments():
            held = dict(zip(mine, pk.held))
            pend = {c: 0 if recompute[c] else q for c, q in zip(mine, pk.pending)}
            per_mb = max((_held_activation_bytes(prob, *bounds[c], 1, recompute[c]) for c in mine if held[c]),
                         default=0.0)
            # a recomputing chunk's one microbatch of activations exists only while it recomputes:
            # in a backward, and on one chunk of the rank at a time
            redo = [float(prob.act[slice(*bounds[c])].sum()) if recompute[c] and prob.act_layer is None else 0.0
                    for c in mine]
            held_acts = sum(_held_activation_bytes(prob, *bounds[c], held[c], recompute[c])
                            - pend[c] * _pending_freed(prob, bounds[c][1], recompute[c]) for c in mine) - sum(redo)
            in_backward = kind != "F"
            d = rank_breakdown(
                prob.memory, numel=float(prob.numel[layers].sum()), largest=float(prob.largest[layers].max()),
                activations=float(held_acts + (max(redo) if in_backward else 0.0)),
                communication=float(pk.communication), workspace=float(prob.workspace[layers].max()),
                pending=float(sum(pend[c] * _pending_bytes(prob, *bounds[c], recompute[c]) for c in mine)),
                microbatch_activations=float(per_mb), in_backward=in_backward, gradients_made=made,
                layer_transient=transients[kind], weight_grads=kind != "I" or any(recompute[c] for c in mine),
                gathered=_gathered(prob, bounds, mine, pk.pending), zero_overlap=overlap,
                loss_transient=transients.get(kind + " loss"), split_weight=kind == "W",
                unmade_gradients=pk.unmade)
            if best is None or sum(d.values()) > sum(best[0].values()):
                best = (d, [held[c] for c in mine], [pend[c] for c in mine])
        if _resharding(prob) and len(mine) > 1:   # the step's last backward: every chunk gathered
            d = _last_backward(prob, bounds, recompute, mine, layers, transients["B"])
            if sum(d.values()) > sum(best[0].values()):
                best = (d, [int(c == mine[0]) for c in mine], [0] * len(mine))
        out.append(best)
    return out


def _zero_tensors(prob: _Problem, bounds: list[tuple[int, int]], mine: list[int],
                  recompute: list[bool]) -> ZeroTensors | None:
    """ZeRO-2's buffers that follow the rank's parameter tensors (its chunks ``mine`` in order,
    :func:`engine.footprint.zero_tensors`); None without ZeRO-2, without the profile's tensor
    sizes, or where they do not add up to the rank's parameters (a sharded profile). Each
    reduce is walked at the activations its backward has freed by then (not on a rank with a
    recomputing chunk, whose activations are its recomputation's)."""
    if prob.memory.zero_stage != 2 or prob.param_numels is None:
        return None
    chunks = [[n for i in range(*bounds[c]) for n in prob.param_numels[i]] for c in mine]
    if sum(map(sum, chunks)) != round(float(sum(prob.numel[slice(*bounds[c])].sum() for c in mine))):
        return None
    freed = None if any(recompute[c] for c in mine) else [
        ([x for i in range(*bounds[c]) for x in _freed_at_tensors(prob, i, bounds[c][1])],
         _held_activation_bytes(prob, *bounds[c], 1, False)) for c in mine]
    return zero_tensors(chunks, prob.memory.data_parallel, freed)


def _freed_at_tensors(prob: _Problem, i: int, e: int) -> list[float]:
    """Per parameter tensor of layer ``i`` (a chunk ending before ``e``), the bytes of one
    microbatch's activations its backward has freed when that tensor's gradient arrives: the
    layers' after ``i``, and of layer ``i``'s own the share of its tensors after that one (their
    gradients, made in reverse, came first; an assumption: activations in proportion to them)."""
    sizes = [float(n) for n in prob.param_numels[i]]
    after = np.cumsum(sizes[::-1])[::-1] - np.asarray(sizes) if sizes else np.zeros(0)
    total = sum(sizes)
    later = float(prob.act[i + 1:e].sum())
    return [later + (float(prob.act[i]) * a / total if total else 0.0) for a in after]


def _rank_collective_s(prob: _Problem, bounds: list[tuple[int, int]]) -> list[float]:
    """Per rank, the replicas' collectives exposed once per step. ZeRO-0/1/2: the gradients'
    reduction (and ZeRO-1/2's all-gather of the updated weights), after the schedule, not
    overlapped (an upper bound where the backend overlaps buckets with the backward). ZeRO-3:
    the reduce-scatter of every layer's
    gradients after the schedule (``engine.fsdp.sync_gradients``, nothing left to overlap) and,
    when the layers stay gathered for the step, their one all-gather at the step's first
    forward: a chunk's first layer in full, each later one beyond the forward of the layer
    before it (FSDP2 issues a layer's all-gather while the previous layer computes). Resharding
    layers gather again in each of the chunk's ``2 m`` forward and backward actions: the first
    layer's all-gather in full each time, counted here on the rank's path (the later layers'
    beyond their compute are in the actions' times, ``_problem``). Zeros with one replica or
    without links."""
    out = [0.0] * prob.p
    if prob.rs is None or not prob.rs.any():
        return out
    for c, (a, e) in enumerate(bounds):
        t = float(prob.rs[a:e].sum())
        if not prob.memory.zero3:
            pass
        elif prob.memory.reshard_after_forward:
            t += 2 * prob.m * float(prob.ag[a])
        else:
            t += float(prob.ag[a]) + float(np.maximum(prob.ag[a + 1:e] - prob.f[a:e - 1], 0.0).sum())
        out[prob.ranks[c]] += t
    return out


def _resharding(prob: _Problem) -> bool:
    """ZeRO-3 with the layers resharded between a chunk's actions (``reshard_after_forward``)."""
    return prob.memory.zero3 and prob.memory.reshard_after_forward


def _gathered(prob: _Problem, bounds: list[tuple[int, int]], mine: list[int], pending: Sequence[int]
              ) -> float | None:
    """ZeRO-3's gathered parameters (elements) of the rank holding chunks ``mine`` at a moment
    with ``pending`` microbatches between I and W per chunk: every layer without resharding
    (None); with it (``engine.fsdp``: a chunk's layers are gathered from its action's first
    layer to the action's end and stay gathered while a microbatch waits for its W), the
    largest chunk (the one computing, at most) and every chunk with a pending W."""
    if not _resharding(prob):
        return None
    size = [float(prob.numel[slice(*bounds[c])].sum()) for c in mine]
    held = [x for x, q in zip(size, pending) if q > 0]
    rest = [x for x, q in zip(size, pending) if q <= 0]
    return sum(held) + (max(rest) if rest else 0.0)


def _last_backward(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool], mine: list[int],
                   layers: list[int], transient: tuple[float, float]) -> dict[str, float]:
    """The rank's memory in its step's last backward under ZeRO-3 with resharding: the chunks
    whose backward work is done stay gathered until the step's reduce-scatter
    (``engine.fsdp.after_compute``), so every layer is gathered while the last microbatch of its
    first chunk is back-propagated (one microbatch's activations held)."""
    c = mine[0]
    return rank_breakdown(
        prob.memory, numel=float(prob.numel[layers].sum()), largest=float(prob.largest[layers].max()),
        activations=float(_held_activation_bytes(prob, *bounds[c], 1, recompute[c])), communication=0.0,
        workspace=float(prob.workspace[layers].max()), in_backward=True, layer_transient=transient,
        gathered=None)


def _transients(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool], mine: list[int]
                ) -> dict[str, Any]:
    """Per action kind (F, B, I, W), the largest transient of one layer's backward on the rank
    holding chunks ``mine`` (:func:`partitioner.memory.layer_transient`). B: each layer's
    parameter transient and workspace, less what its backward has freed (:func:`_freed`). A
    split backward's I makes no weight gradient: the workspaces only, nothing freed (the graph is
    kept for W). Its W makes the weight gradients: under the node split only the weight kernels
    run (the parameter transients); under the per-layer cut each layer's graph is walked again
    and freed as it goes (the workspaces too, less the later layers' activations; the loss's
    segment is not walked). A recomputing chunk runs its whole backward at I (layer by layer:
    each layer's workspace its recomputed activations too); a first chunk without an input
    gradient under the node split runs it at W."""
    layers = [i for c in mine for i in range(*bounds[c])]
    loss_at = layers.index(prob.n - 1) if prob.has_loss and prob.n - 1 in layers else None
    largest = [float(prob.largest[i]) for i in layers]
    workspace = [float(prob.arrays(recompute[c])[1][i]) for c in mine for i in range(*bounds[c])]
    freed = _freed(prob, bounds, recompute, mine)
    after = _freed(prob, bounds, recompute, mine, as_it_goes=True)   # a backward that frees as it goes
    node = prob.memory.node_split
    rows: dict[str, list[tuple[float, float, float]]] = {"I": [], "W": []}
    k = 0
    for c in mine:
        a, e = bounds[c]
        whole_at_w = a == 0 and not prob.input_grad and node
        for i in range(a, e):
            big, ws, fr = largest[k], workspace[k], after[k]
            if recompute[c]:
                rows["I"].append((big, ws, fr))
                rows["W"].append((0.0, 0.0, 0.0))
            elif whole_at_w:
                rows["I"].append((0.0, 0.0, 0.0))
                rows["W"].append((big, ws, fr))
            else:
                rows["I"].append((0.0, ws, 0.0))
                rows["W"].append((big, 0.0 if node or i == prob.n - 1 else ws, 0.0 if node else fr))
            k += 1
    split = loss_at if prob.memory.zero_stage == 2 else None   # only ZeRO-2 tells the loss's transient apart
    out = {"F": (0.0, 0.0), "B": layer_transient(prob.memory, largest, workspace, freed, loss_at),
           "B loss": loss_split(prob.memory, largest, workspace, freed, split)}
    for kind, got in rows.items():
        out[kind] = layer_transient(prob.memory, *map(list, zip(*got)), loss_at) if got else (0.0, 0.0)
        out[kind + " loss"] = loss_split(prob.memory, *map(list, zip(*got)), split) if got else None
    return out


def _freed(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool], mine: list[int],
           as_it_goes: bool = False) -> list[float]:
    """Per layer of the rank's chunks ``mine``, the activations its chunk's backward has freed
    when it reaches the layer: those of the layers after it (none under a split backward,
    which keeps them until W, unless ``as_it_goes``)."""
    split = SCHEDULE_INFO[prob.schedule].splits_backward and not as_it_goes
    out: list[float] = []
    for c in mine:
        a, e = bounds[c]
        act = prob.arrays(recompute[c])[0]
        after = np.concatenate([np.cumsum(act[a:e][::-1])[::-1][1:], [0.0]])
        out += [0.0] * (e - a) if split and not recompute[c] else [float(x) for x in after]
    return out


def _chunk_counts(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool]
                  ) -> tuple[list[int], list[int]]:
    """Per chunk, the microbatches held and pending at its rank's peak (:func:`_rank_moments`)."""
    held, pending = [0] * prob.k, [0] * prob.k
    for r, (_, h, q) in enumerate(_rank_moments(prob, bounds, recompute)):
        for c, x, y in zip([c for c, rank in enumerate(prob.ranks) if rank == r], h, q):
            held[c], pending[c] = x, y
    return held, pending


def _rank_memory(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool]) -> list[dict[str, float]]:
    """Each rank's memory at its peak, by :data:`partitioner.memory.BREAKDOWN_KEYS`."""
    return [d for d, _, _ in _rank_moments(prob, bounds, recompute)]


def _rank_peaks(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool]) -> list[float]:
    return [sum(d.values()) for d in _rank_memory(prob, bounds, recompute)]


def _optimal(prob: _Problem, notes: list[str]) -> tuple[list[tuple[int, int]], list[bool]]:
    """The exact min-bottleneck split under the memory caps (and where to recompute, for auto)."""
    try:
        if prob.vee:  # exact on ranks: each rank's time and memory sum its two chunks
            bounds, _, var = optimal_v_split(prob.f + prob.b, prob.p, caps=prob.rank_caps, cut_time=prob.cut_time,
                                             recompute_time=prob.f, checkpointing=prob.ckpt, return_variants=True,
                                             states=prob.states, **prob.common)
        else:
            bounds, _, var = optimal_split(prob.f + prob.b, prob.k, caps=prob.chunk_caps, cut_time=prob.cut_time,
                                           recompute_time=prob.f, checkpointing=prob.ckpt, return_variants=True,
                                           **prob.common)
    except Infeasible as e:
        if not prob.explain:   # only whether it fits is asked (``_other_loss_fits``)
            raise PartitionError(str(e)) from None
        raise PartitionError(_infeasible_message(e, prob) + _other_loss_fits(prob)) from None
    recompute = [bool(x) for x in var] if prob.ckpt == "auto" else [prob.ckpt == "on"] * prob.k
    tie_break = ("; among equal bottlenecks, the smallest sum of stage times"
                 if np.any(prob.comm_layer > 0) or prob.ckpt == "auto"
                 else "; among equal bottlenecks, later stages take as many layers as allowed")
    notes.append("optimal: exact min-bottleneck contiguous split"
                 + (" under the memory limits" if prob.rank_caps else " (no memory limit given)") + tie_break)
    if prob.vee:
        notes.append("zbv: exact over ranks (V placement: rank r holds chunks r and 2p-1-r; the largest rank "
                     "time under each rank's limit)")
    elif prob.v > 1 and prob.rank_caps:
        notes.append(f"interleaved: each chunk limited to rank limit / {prob.v} "
                     "(sufficient, not necessary, for the rank to fit)")
    return bounds, recompute


_REFINE_BUDGET = 256
"""At most this many splits are simulated when refining a min-bottleneck split (every split when
there are no more than this; else a local search from the min-bottleneck one)."""


class _Pricer:
    """The predicted step of many candidate splits at once, the same float that the split's
    :func:`_plan` and :func:`_predict` give (``Plan.simulate`` + ``Plan.predicted_step_s``), by
    :func:`partitioner.batchsim.simulate_many`. Whether a split fits is asked only of the splits
    that could be chosen (:meth:`best`), in order of their step."""

    def __init__(self, prob: _Problem, recompute: list[bool], settings: dict[str, Any]) -> None:
        self.prob, self.recompute = prob, recompute
        self.graph = compile_schedule(prob.schedule, prob.p, prob.m, prob.v, prob.max_inflight)
        sched = build_schedule(prob.schedule, prob.p, prob.m, prob.v, max_inflight=prob.max_inflight)
        self.action = self.busy = self.step_fixed = 0.0
        if prob.fixed is not None:
            self.action, self.step_fixed = prob.fixed.runtime_costs(send_mode(sched))
            self.busy = prob.fixed.message_busy_s
        self.ends = np.array(message_ends(sched), dtype=np.float64)[:, None]
        self.shard = settings["data_parallel"] if settings["zero_stage"] >= 1 else 1
        self.optimizer = settings["optimizer"]
        self.splits = SCHEDULE_INFO[prob.schedule].splits_backward
        self.step: dict[tuple[int, ...], float] = {}
        self._fits: dict[tuple[int, ...], bool] = {}

    def __len__(self) -> int:
        return len(self.step)

    def __contains__(self, cuts: tuple[int, ...]) -> bool:
        return cuts in self.step

    def add(self, splits: Any) -> None:
        """Price the splits (cut positions) not priced yet."""
        new = [c for c in dict.fromkeys(tuple(x) for x in splits) if c not in self.step]
        if new:
            self.step.update(zip(new, self._steps(new)))

    def _steps(self, splits: list[tuple[int, ...]]) -> list[float]:
        prob, a = self.prob, self.action
        rows = [_chunk_times(prob, _bounds_of(c, prob.n), self.recompute) for c in splits]
        f = np.array([r[0] for r in rows]).T + a
        b = np.array([r[1] for r in rows]).T
        w = np.minimum(np.array([r[2] for r in rows]).T, b)
        b, w = (b + 2 * a, w + a) if self.splits else (b + a, w + a)
        if self.busy:
            f, b = f + self.busy * self.ends, b + self.busy * self.ends
        comm = prob.boundary_comm(np.array(splits, dtype=np.int64).T)
        ends = simulate_many(self.graph, f, b, w, comm)
        if prob.rs is not None and prob.rs.any():
            for j, c in enumerate(splits):
                ends[:, j] += _rank_collective_s(prob, _bounds_of(c, prob.n))
        if prob.fixed is not None:
            for j, c in enumerate(splits):
                param = [prob.sums(s, e)[4] / self.shard for s, e in _bounds_of(c, prob.n)]
                per_rank = rank_totals(param, prob.schedule, prob.p, prob.v)
                ends[:, j] += [prob.fixed.optimizer_s(self.optimizer, x) for x in per_rank]
        return [float(x) + self.step_fixed for x in ends.max(axis=0)]

    def fits(self, cuts: tuple[int, ...]) -> bool:
        if self.prob.limits is None:
            return True
        if cuts not in self._fits:
            peaks = _rank_peaks(self.prob, _bounds_of(cuts, self.prob.n), self.recompute)
            self._fits[cuts] = all(x <= c * (1 + 1e-12) for x, c in zip(peaks, self.prob.limits))
        return self._fits[cuts]

    def value(self, cuts: tuple[int, ...]) -> float:
        """The split's predicted step, or infinity when it does not fit."""
        return self.step[cuts] if self.fits(cuts) else math.inf

    def best(self) -> tuple[int, ...]:
        """The fastest split that fits, the first priced among equals (the first priced when none fits)."""
        keys = list(self.step)
        for i in sorted(range(len(keys)), key=lambda i: (self.step[keys[i]], i)):
            if self.fits(keys[i]):
                return keys[i]
        return keys[0]


def _refine(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool], settings: dict[str, Any],
            notes: list[str]) -> tuple[list[tuple[int, int]], bool]:
    """The split among those near ``bounds`` with the smallest *predicted step* that fits.

    The exact search minimises the busiest stage (or rank), which ties or nearly ties for many
    splits whose steps differ: the schedule's order (a V's chunks, the fill of interleaving, a
    split backward's W) and the per-cut transfers decide between them. The baselines' splits are
    candidates too, so ``optimal`` never predicts a slower step than one of them. Each candidate is priced
    by the same arithmetic as :meth:`Plan.simulate` (:class:`_Pricer`, all of a batch at once); each
    chunk keeps its recomputation (``auto``'s choice for the min-bottleneck split), and a candidate
    must fit with it. Every split when there are at most ``_REFINE_BUDGET`` (exact over splits
    with that recomputation), else a hill climb from the min-bottleneck split (a local search).
    Returns the split and whether it came from the local search (not proven fastest)."""
    if prob.k == 1:
        return bounds, False
    n, k = prob.n, prob.k
    pricer = _Pricer(prob, recompute, settings)
    start = tuple(e for _, e in bounds[:-1])
    pricer.add([start])
    exhaustive = math.comb(n - 1, k - 1) <= _REFINE_BUDGET
    if exhaustive:
        pricer.add(itertools.combinations(range(1, n), k - 1))
    else:   # the baselines' splits, so that no baseline predicts faster
        pricer.add(tuple(e for _, e in seed[:-1]) for seed in
                   (uniform_split(n, k), greedy_split(prob.f + prob.b, k), parameter_split(prob.static, k)))
        best = pricer.best()
        while len(pricer) < _REFINE_BUDGET:
            fresh = (c for c in _neighbours(best, n) if c not in pricer)
            pricer.add(_distinct(fresh, _REFINE_BUDGET - len(pricer)))
            nxt = pricer.best()
            if pricer.value(nxt) >= pricer.value(best):
                break
            best = nxt
    best = pricer.best()
    how = "all of them" if exhaustive else "a local search"
    if not pricer.value(best) < pricer.value(start) * (1 - 1e-3):   # ties keep the min-bottleneck split
        notes.append(f"refinement on the predicted step ({len(pricer)} splits simulated, {how}) kept the "
                     "min-bottleneck split")
        return bounds, not exhaustive
    new = _bounds_of(best, n)
    notes.append(f"refined on the predicted step ({len(pricer)} splits simulated, {how}): {new} predicts "
                 f"{pricer.value(best) * 1e3:.1f} ms, the min-bottleneck split {list(bounds)} "
                 f"{pricer.value(start) * 1e3:.1f} ms")
    return new, not exhaustive


def _distinct(items: Iterator[tuple[int, ...]], count: int) -> list[tuple[int, ...]]:
    """The first ``count`` distinct items."""
    out: dict[tuple[int, ...], None] = {}
    for x in items:
        if len(out) >= count:
            break
        out[x] = None
    return list(out)


def _bounds_of(cuts: Sequence[int], n: int) -> list[tuple[int, int]]:
    edges = [0, *cuts, n]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def _neighbours(cuts: tuple[int, ...], n: int) -> Iterator[tuple[int, ...]]:
    """Splits a move away, in a fixed order (lazily: the refinement takes only what its budget
    allows): a run of consecutive cuts shifted one layer together (a layer moves from one chunk to
    another, the chunks between keep their sizes; one cut alone is the shortest run), two cuts
    moved one layer in opposite directions, one cut moved two layers."""
    c = len(cuts)
    runs = ({t: d for t in range(i, j + 1)} for i in range(c) for j in range(i, c) for d in (-1, 1))
    pairs = ({i: d, j: -d} for i, j in itertools.combinations(range(c), 2) for d in (-1, 1))
    jumps = ({i: d} for i in range(c) for d in (-2, 2))
    for move in itertools.chain(runs, pairs, jumps):
        cand = tuple(x + move.get(i, 0) for i, x in enumerate(cuts))
        if all(a < b for a, b in zip((0, *cand), (*cand, n))):
            yield cand


def _baseline(method: str, prob: _Problem, notes: list[str]) -> tuple[list[tuple[int, int]], list[bool]]:
    """A baseline split (limits not used to choose; with auto, recompute where a chunk does not fit)."""
    if method == "uniform":
        bounds = uniform_split(prob.n, prob.k)
    elif method == "parameters":
        bounds = parameter_split(prob.static, prob.k)
    else:
        bounds = greedy_split(prob.f + prob.b, prob.k)
    notes.append(_BASELINE_NOTES[method])
    caps = prob.chunk_caps
    if prob.ckpt == "auto" and caps is not None:
        _, mem_plain = split_costs(bounds, time=prob.f + prob.b, cut_time=prob.cut_time, **prob.common)
        return bounds, [bool(mem_plain[c] > caps[c]) for c in range(prob.k)]
    return bounds, [prob.ckpt == "on"] * prob.k


def _note_recompute(recompute: list[bool], ckpt: str, notes: list[str]) -> None:
    if any(recompute):
        idx = [c for c, r in enumerate(recompute) if r]
        notes.append(f"activation checkpointing on stage(s) {idx}"
                     + (": their activations would not fit otherwise" if ckpt == "auto" else " (requested)"))
    elif ckpt == "auto":
        notes.append("activation checkpointing not needed: every stage fits without recomputation")


def _plan(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool], notes: list[str],
          **settings: Any) -> Plan:
    """The plan of a split: per-chunk costs and memory, per-rank fit, the closed-form step."""
    p = prob.p
    t_stage, _ = split_costs(bounds, time=prob.f + prob.b, cut_time=prob.cut_time,
                             recompute_time=prob.f, recompute=recompute, **prob.common)
    f_c, b_c, w_c = _chunk_times(prob, bounds, recompute)
    held, pending = _chunk_counts(prob, bounds, recompute)
    act_c = [_held_activation_bytes(prob, a, e, held[c], recompute[c]) for c, (a, e) in enumerate(bounds)]
    comm_b = [float(prob.comm_layer[prob.comm_of[j], e - 1]) for j, (_, e) in enumerate(bounds[:-1])]
    breakdown = _rank_memory(prob, bounds, recompute)
    rank_mem = [sum(d.values()) for d in breakdown]
    mem_stage = _chunk_shares(prob, bounds, act_c, breakdown)
    caps = prob.limits
    rank_fits = [True] * p if caps is None else [rank_mem[r] <= caps[r] * (1 + 1e-12) for r in range(p)]
    if caps is not None and not all(rank_fits):
        bad = [r for r in range(p) if not rank_fits[r]]
        notes.append(f"does NOT fit on rank(s) {bad}: predicted {[_gib(rank_mem[r]) for r in bad]} "
                     f"> limit {[_gib(caps[r]) for r in bad]}")
    # closed form: sum of stage work + (m - 1) * bottleneck (exact for gpipe / 1f1b with equal
    # stages; for other schedules only a fallback when the simulator is not used)
    closed = float(sum(f_c) + sum(b_c) + 2 * sum(comm_b) + (prob.m - 1) * float(np.max(t_stage)))
    lower, lb_b = _lower_bound(prob)
    fixed = _fixed_fields(prob, bounds, settings)
    return Plan(
        stage_ranges=[(int(a), int(e)) for a, e in bounds], stage_time_s=[float(x) for x in t_stage],
        stage_memory_bytes=[int(math.ceil(x)) for x in mem_stage], bottleneck_s=float(np.max(t_stage)),
        step_s=closed, bubble_fraction=0.0, lower_bound_s=float(lower), schedule=prob.schedule,
        num_stages=p, microbatches=prob.m, virtual_stages=prob.v, fits=all(rank_fits),
        memory_limit_bytes=None if caps is None else [int(x) for x in caps],
        link_bytes_per_s=prob.link, link_source=prob.xfer.source, boundary_links=prob.xfer.labels(),
        bottleneck_lower_bound_s=lb_b, closed_form_step_s=closed,
        predicted_by="closed form", stage_activation_bytes=[int(math.ceil(x)) for x in act_c],
        stage_inflight=held, stage_pending=pending, stage_recompute=list(recompute), stage_forward_s=f_c,
        stage_backward_s=b_c, stage_weight_s=w_c, boundary_comm_s=comm_b,
        rank_memory_bytes=[int(math.ceil(x)) for x in rank_mem], rank_fits=rank_fits,
        rank_memory_breakdown=[{k: int(math.ceil(x)) for k, x in d.items()} for d in breakdown],
        precision=prob.memory.precision, layer_names=prob.names, notes=notes + _shared_cores_note(prob, fixed, settings),
        rank_collective_s=_rank_collective_s(prob, bounds), **fixed, **settings)


def _chunk_times(prob: _Problem, bounds: list[tuple[int, int]], recompute: list[bool]
                 ) -> tuple[list[float], list[float], list[float]]:
    """Per chunk: forward, backward (with recomputation) and its W part, as the engine runs
    the chunk. A recomputing chunk does not split (its I is the whole backward, W is empty); a
    first chunk whose input does not require grad (the data) has no input gradient, so its
    whole, unsplit backward is W."""
    f_c, b_c, w_c = [], [], []
    for c, (a, e) in enumerate(bounds):
        f, whole, split, weight, _ = prob.sums(a, e)
        if recompute[c]:
            b, w = whole + f, 0.0
        elif a == 0 and not prob.input_grad and SCHEDULE_INFO[prob.schedule].splits_backward:
            b = w = whole
        else:
            b, w = split, weight
        f_c.append(f)
        b_c.append(b)
        w_c.append(min(w, b))
    return f_c, b_c, w_c


def _chunk_shares(prob: _Problem, bounds: list[tuple[int, int]], act_c: list[float],
                  breakdown: list[dict[str, float]]) -> list[float]:
    """Each chunk's share of its rank's peak (the shares of a rank sum to it): its activations and
    boundary buffers, and the rank's state and temporaries pro rata to its parameters."""
    shares = []
    for c, (a, e) in enumerate(bounds):
        d = breakdown[prob.ranks[c]]
        mine = [i for i, r in enumerate(prob.ranks) if r == prob.ranks[c]]
        total = sum(float(prob.numel[slice(*bounds[i])].sum()) for i in mine)
        frac = float(prob.numel[a:e].sum()) / total if total > 0 else float(c == mine[0])
        cut = [(prob.out[x - 1] if x > 0 else 0.0) + (prob.out[y - 1] if y < prob.n else 0.0)
               for x, y in (bounds[i] for i in mine)]
        # the rank's transfer buffers, shared by its chunks in proportion to their cut tensors
        comm = d["communication"] * (cut[mine.index(c)] / sum(cut) if sum(cut) > 0 else float(c == mine[0]))
        held = act_c[c] if d["activations"] > 0 else 0.0
        state = d["parameters"] + d["gradients"] + d["optimizer_state"] + d["temporary"]
        shares.append(frac * state + held + comm)
    return shares


def _shared_cores_note(prob: _Problem, fixed: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The plan's note when its ranks outnumber the CPU cores they share and get a measured
    fraction of their time (``FixedCosts.shared_efficiency_for`` its runtime mode) and pay a
    measured cost per compute action (``FixedCosts.shared_action_s``)."""
    cores, whole = fixed.get("shared_cores"), _rank_cores(prob.fixed, settings) if prob.fixed is not None else None
    if cores is None or whole is None:
        return []
    e, a = cores / whole, prob.fixed.shared_action_s
    if whole >= prob.p or (e == 1.0 and a == 0.0):
        return []
    per_action = f" and {a * 1e3:.2f} ms more per compute action" if a else ""
    return [f"{prob.p} ranks share {whole:g} CPU cores: simulated on {cores:.2f} of them (the fraction "
            f"{e:.3f} of the cores' time such ranks got on this machine's measured pipeline{per_action}, "
            "partitioner.shared)"]


def _rank_cores(fixed: FixedCosts, settings: dict[str, Any]) -> float | None:
    """The cores one pipeline's ranks share (None: a processor per rank). The replicas'
    pipelines, and each pipeline rank's tp ranks, run on the machine's cores at once (the local
    launcher): a simulated rank needs tensor_parallel of them."""
    return fixed.cores / (settings["data_parallel"] * settings.get("tensor_parallel", 1)) if fixed.cores else None


def _fixed_fields(prob: _Problem, bounds: list[tuple[int, int]], settings: dict[str, Any]) -> dict[str, Any]:
    """The plan's fixed-cost fields: per action, per message end on a busy CPU, per step, and
    each rank's optimizer update (its parameters, sharded over the replicas from ZeRO-1 on)."""
    fixed = prob.fixed
    if fixed is None:
        return {}
    shard = settings["data_parallel"] if settings["zero_stage"] >= 1 else 1
    param_c = [prob.sums(a, e)[4] / shard for a, e in bounds]
    per_rank = [float(x) for x in rank_totals(param_c, prob.schedule, prob.p, prob.v)]
    sched = build_schedule(prob.schedule, prob.p, prob.m, prob.v, max_inflight=prob.max_inflight)
    mode = send_mode(sched)
    action, step = fixed.runtime_costs(mode)
    cores = _rank_cores(fixed, settings)
    if cores is not None and cores < prob.p:   # ranks outnumbering the cores get less than all their time
        cores, action = cores * fixed.shared_efficiency_for(mode), action + fixed.shared_action_s
    # the CPU off the actions, charged only when the ranks outnumber the cores (Plan.shares_cores)
    shared = [fixed.shared_cpu(mode, float(prob.out[e - 1])) for _, e in bounds[:-1]]
    return {"action_s": action, "message_busy_s": fixed.message_busy_s,
            "step_fixed_s": step, "shared_cores": cores,
            "step_cpu_s": fixed.shared_cpu(mode, 0.0)[0], "boundary_cpu_s": [x for _, x in shared],
            "rank_optimizer_s": [fixed.optimizer_s(settings["optimizer"], x) for x in per_rank]}


def _held_activation_bytes(prob: _Problem, a: int, e: int, inflight: int, recompute: bool) -> float:
    """Bytes a chunk holds at its peak for ``inflight`` held microbatches: what it saved for
    backward and the output the engine keeps (a recomputing chunk keeps its input and output,
    plus one microbatch's activations while it recomputes; recomputing layer by layer, every
    layer's input and its output, the one layer recomputing being its backward's transient)."""
    if recompute and prob.act_layer is not None:   # each layer's input; one layer recomputes at a time (transient)
        return inflight * (float(prob.act_layer[a:e].sum()) + _kept_output(prob, e, True))
    if recompute:
        return inflight * ((prob.out[a - 1] if a > 0 else 0.0) + _kept_output(prob, e, True)) + prob.act[a:e].sum()
    # under the per-layer cut, the last layer's output (the loss's input) is kept as its segment's root
    loss_in = prob.loss_cut[0] if e == prob.n else 0.0
    return inflight * (prob.act[a:e].sum() + (prob.shared[a] if a > 0 else 0.0) + _kept_output(prob, e, False) + loss_in)


def _kept_output(prob: _Problem, e: int, recompute: bool) -> float:
    """Per held microbatch, the bytes of the output of a chunk ending before layer ``e`` kept
    beyond its activations (none on the last chunk: its output is the loss)."""
    if e >= prob.n:
        return 0.0
    saved = float(prob.out_saved[e - 1]) if prob.out_saved is not None else 0.0
    return kept_output_bytes(float(prob.out[e - 1]), saved, recompute)


def _pending_bytes(prob: _Problem, a: int, e: int, recompute: bool) -> float:
    """Gradients a chunk keeps per pending microbatch from I to W. A recomputing chunk runs
    I and W as one backward (none); a first chunk whose input does not require grad has no
    input gradient to compute, so the engine defers its whole backward to W and keeps only its
    output's gradient (the search counts the per-layer sum there, an upper bound)."""
    if recompute:
        return 0.0
    if a == 0 and not prob.input_grad:
        return float(prob.out[e - 1]) if e < prob.n else 0.0
    return float(prob.pend[a:e].sum())


def _pending_freed(prob: _Problem, e: int, recompute: bool) -> float:
    """What a chunk ending before layer ``e`` frees per pending microbatch at its I: under the
    per-layer cut, the loss's saved tensors (its segment, without parameters, drops its graph
    at I); 0 elsewhere (``_Problem.loss_cut``)."""
    return prob.loss_cut[1] if e == prob.n and not recompute else 0.0


def _lower_bound(prob: _Problem) -> tuple[float, float]:
    """(lower bound on the step over every split, lower bound on the bottleneck)."""
    t = prob.f + prob.b
    total = float(t.sum())
    lb_b = max(float(t.max()), total / prob.k)
    info = SCHEDULE_INFO[prob.schedule]
    if info.chunks_per_rank == 1:
        lower = pipeline_lower_bound(t, prob.k, prob.m, carried=prob.f if info.splits_backward else None)
    else:
        lower = max(prob.m * max(float(t.max()), total / prob.p), total)
    return lower, lb_b


def _predict(plan: Plan, prob: _Problem) -> None:
    """Replace the closed-form step with :meth:`Plan.simulate`'s (what the engine will run)."""
    res = plan.simulate()
    plan.step_s, plan.bubble_fraction = plan.predicted_step_s(res), res.bubble_fraction
    plan.predicted_by = "engine.simulate" + (" + fixed costs" if prob.fixed is not None else "")
    if prob.v == 1 and not SCHEDULE_INFO[prob.schedule].splits_backward:
        return   # the memory model read the same count (``_counts``)
    if prob.states:   # the states the search read (``_counts``), at their peak count
        held = [sum(peak_state(states, [1.0] * len(states[0][0]), [0.0] * len(states[0][0]))[0])
                for states in prob.states]
    else:
        sched = build_schedule(prob.schedule, prob.p, prob.m, prob.v, max_inflight=prob.max_inflight)
        held = rank_totals(inflight_from_schedule(sched), prob.schedule, prob.p, prob.v)
    if prob.schedule == "zb-auto":   # built from the plan's costs within these counts (Plan.build_schedule)
        held_ok = all(a <= h for a, h in zip(res.peak_inflight, held))
        if held_ok:
            return
    if list(res.peak_inflight) != held:  # pragma: no cover - the two models agree by construction
        plan.notes.append(f"warning: simulator's peak in-flight {res.peak_inflight} differs from the memory "
                          f"model {held}")


def _infeasible_message(err: Exception, prob: _Problem) -> str:
    n, p, v, rank_caps, chunk_caps = prob.n, prob.p, prob.v, prob.rank_caps, prob.chunk_caps
    ckpt, f, schedule, m, common = prob.ckpt, prob.f, prob.schedule, prob.m, prob.common
    k = p * v
    if chunk_caps is None:
        return str(err)
    if prob.vee:
        return _infeasible_v_message(prob)
    scalar = len(set(prob.limits)) == 1  # type: ignore[arg-type]  # (reserves differ: the last rank's loss)
    if scalar:
        need, split = min_memory_scale(k, n, recompute_time=f, checkpointing=ckpt, **common)
        need_rank = max(math.ceil(need * v + max(prob.reserve)), *_exact_need(prob, split))
        limit = prob.limits[0]  # type: ignore[index]
        msg = (f"no split of {n} layers into {p} stages fits {int(limit)} bytes ({_gib(limit)}) per rank "
               f"with {schedule}, m={m}; the smallest memory_limit_bytes that works is {need_rank} "
               f"({_gib(need_rank)})")
        if v > 1:
            msg += f" (with each chunk held to the rank limit / {v})"
        msg += _more_stages(prob) if _STAGE_ADVICE.get() else ""
    else:
        scale, split = min_memory_scale(k, n, caps=chunk_caps, recompute_time=f, checkpointing=ckpt, **common)
        need = [max(math.ceil(c * scale + res), x)
                for c, res, x in zip(rank_caps, prob.reserve, _exact_need(prob, split))]
        msg = (f"no split of {n} layers into {p} stages fits the per-rank limits {[int(c) for c in prob.limits]}; "
               f"memory_limit_bytes={need} works")
    if ckpt == "off" and fits_any(k, n, caps=chunk_caps, recompute_time=f, checkpointing="auto", **common):
        msg += "; activation_checkpointing='auto' would also fit"
    return msg


def _exact_need(prob: _Problem, split: list[tuple[int, int]]) -> list[int]:
    """Each rank's exact peak for the split the search's bound found (the search's per-layer
    costs leave out what does not add over layers: the kept outputs, the transfer buffers at
    the peak), so that a suggested limit is one that works; nothing under 'auto'."""
    if prob.ckpt == "auto":
        return [0] * prob.p
    return [math.ceil(x) for x in _rank_peaks(prob, split, [prob.ckpt == "on"] * prob.k)]


def _other_loss_fits(prob: _Problem) -> str:
    """"; it fits with the <name> loss head ..." for the first of the profile's loss variants
    under which the same layout fits the same limits (its exact per-rank peaks), or nothing."""
    for name, make in prob.loss_variants.items():
        alt = make()
        alt.explain = False
        try:
            bounds, recompute = _search("optimal", alt, [])
        except PartitionError:
            continue
        peaks = _rank_peaks(alt, bounds, recompute)
        if alt.limits is None or all(pk <= lim * (1 + 1e-12) for pk, lim in zip(peaks, alt.limits)):
            last = alt.ranks[-1]
            return (f"; it fits with the {name} loss head (model.loss={name}): last rank {_gib(peaks[last])} "
                    f"of {_gib(alt.limits[last]) if alt.limits else 'no limit'}")
    return ""


def _more_stages(prob: _Problem) -> str:
    """", or use N stages" for the first stage count that fits one scalar limit (more stages
    lower the per-stage memory), or nothing."""
    n, p, v, cap, c = prob.n, prob.p, prob.v, min(prob.rank_caps), prob.common  # type: ignore[arg-type]
    for p2 in range(p + 1, min(n // v, 4 * p) + 1):
        if not fits_any(p2 * v, n, static=c["static"], act=c["act"], out=c["out"], inflight=[0] * (p2 * v),
                        shared=c["shared"], caps=cap / v, recompute_time=prob.f, checkpointing=prob.ckpt,
                        pend=c["pend"], pending=None, recompute_act=c["recompute_act"]):
            continue   # not even the state fits (nothing in flight): skip building the schedule
        inf2, pend2 = inflight_per_chunk(prob.schedule, p2, prob.m, v), None
        if SCHEDULE_INFO[prob.schedule].splits_backward:   # the gradients kept from I to W too
            inf2, pend2 = map(list, _advice_counts(prob.schedule, p2, prob.m, v, float(prob.act.mean()),
                                                   float(prob.pend.mean())))
        if fits_any(p2 * v, n, static=c["static"], act=c["act"], out=c["out"], inflight=inf2,
                    shared=c["shared"], caps=cap / v, recompute_time=prob.f, checkpointing=prob.ckpt,
                    pend=c["pend"], pending=pend2, recompute_act=c["recompute_act"]):
            return f", or use {p2} stages"
    return ""


@functools.lru_cache(maxsize=1024)
def _advice_counts(schedule: str, p: int, m: int, v: int, act: float, pend: float
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`held_and_pending` of a schedule at another stage count, every chunk costing the
    mean layer: the layouts of one search that differ only in zb-h2's cap (the advice builds the
    default one) ask the same counts."""
    held, pending = held_and_pending(build_schedule(schedule, p, m, v), [act] * p * v, [pend] * p * v)
    return tuple(held), tuple(pending)


def _infeasible_v_message(prob: _Problem) -> str:
    """The smallest limit that fits a V split (each rank: the sum of its two chunks)."""
    n, p, rank_caps, limits = prob.n, prob.p, prob.rank_caps, prob.limits
    scalar = len(set(limits)) == 1  # type: ignore[arg-type]
    scale, _ = min_v_memory_scale(n, p, caps=None if scalar else rank_caps, recompute_time=prob.f,
                                  checkpointing=prob.ckpt, states=prob.states, **prob.common)
    if scalar:
        need = math.ceil(scale + max(prob.reserve))
        return (f"no V split of {n} layers over {p} ranks ({2 * p} chunks) fits {int(limits[0])} bytes "
                f"({_gib(limits[0])}) per rank with {prob.schedule}, m={prob.m}; the smallest memory_limit_bytes "
                f"that works is {need} ({_gib(need)})")
    need = [math.ceil(c * scale + res) for c, res in zip(rank_caps, prob.reserve)]
    return (f"no V split of {n} layers over {p} ranks fits the per-rank limits {[int(c) for c in limits]}; "
            f"memory_limit_bytes={need} works")
