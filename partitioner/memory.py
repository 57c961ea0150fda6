"""Per-rank memory model: what the run holds at its peak, term by term.

A rank holds, at the peak of one of two phases (``engine.footprint`` states what the optimizer
backend keeps, from the run's precision, optimizer, ZeRO stage and replicas):

* forward/backward: ``parameters`` + ``gradients`` + ``optimizer_state`` (fp32 masters and
  moments, sharded by ZeRO) + ``activations`` (per chunk, the microbatches in flight at the
  rank's peak, read from the engine's schedule, times the bytes each saves for backward; a
  recomputing chunk keeps its input per microbatch plus one microbatch's activations while it
  recomputes) + ``communication`` (the boundary buffers: the gradient sent back and the one
  received per chunk) + ``temporary`` (the backend's backward transient, e.g. a 16-bit
  gradient and its fp32 copy, ZeRO-2's reduce bucket; plus the largest layer's backward
  workspace; plus, under a split-backward schedule (zb-h1, zb-h2, zbv), the gradients each
  microbatch keeps between its I and its deferred W, times the microbatches pending). Held
  and pending counts are taken at the same moment: the rank's peak of held activations +
  pending gradients (:func:`held_and_pending`), not two separate maxima;
* the step: ``parameters`` + the gradients held at the step + ``optimizer_state`` + the step's
  temporaries (the flattened reduce bucket, ZeRO's flat partition and its fp32 copy).

For the split search a stage costs (additive over its layers, as :mod:`partitioner.solve`
needs)::

    per_param_bytes * params(s, e)                 # the forward/backward phase's state
    + inflight[j] * (activation_bytes(s, e)        # saved-for-backward, per held microbatch
                     + shared_input_bytes[s])      #   (+ the input copy at a cut, see LayerCost)
    + pending[j] * pending_grad_bytes(s, e)        # kept from I to W (split backward, not recomputing)
    + output_bytes[s-1] + output_bytes[e-1]        # boundary buffers (gradient in / out)

and what does not add over layers (the largest parameter's transient, the backward workspace)
is taken off the limit before the search.

Example::

    from partitioner.memory import MemorySettings, inflight_per_chunk
    mem = MemorySettings(precision="bf16", optimizer="adamw", zero_stage=1, data_parallel=2)
    mem.per_param_bytes()                # 2 + 4 + 12 / 2 = 12
    inflight_per_chunk("1f1b", 4, 8)     # [4, 3, 2, 1]
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, NamedTuple

from engine.choices import OPTIMIZERS, PRECISIONS, ZERO_STAGES, check_grad_accum_dtype
from engine.footprint import (GRAD_BUCKET_MB, Footprint, ZeroTensors, backend_of, optimizer_state_bytes_per_param,
                              state_footprint)
from engine.schedules import SCHEDULE_INFO, SCHEDULES, build_schedule, chunk_ranks

if TYPE_CHECKING:
    from .costs import LayerCost

__all__ = ["loss_split", "static_factor", "inflight_per_chunk", "inflight_from_schedule", "rank_totals",
           "schedule_states", "peak_state", "held_and_pending", "State",
           "OPTIMIZER_STATE_BYTES", "SCHEDULES", "MemorySettings", "BREAKDOWN_KEYS",
           "rank_breakdown", "ChunkBytes", "RankPeak", "RankPeaks", "program_peaks", "kept_output_bytes",
           "layer_transient"]

# Optimizer state in bytes per parameter (kept in fp32), for each of engine.choices.OPTIMIZERS
# (SGD: its momentum buffer, when momentum > 0).
OPTIMIZER_STATE_BYTES: dict[str, int] = {name: optimizer_state_bytes_per_param(name, 0.0)
                                         for name in OPTIMIZERS}
BREAKDOWN_KEYS: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations",
                                   "communication", "temporary")
_REF_NUMEL = 1_000_000   # below every bucket cap: per-parameter costs are their uncapped bound


@dataclass(frozen=True)
class MemorySettings:
    """What a run's memory per parameter depends on (``precision`` None: fp32 for a 4-byte
    profile, bf16 for a 16-bit one)."""

    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float = 0.0
    zero_stage: int = 1
    data_parallel: int = 1
    grad_accum_dtype: str = "fp32"
    backend: str = "auto"
    overlap_grad_reduce: bool = True     # the torch backend's data-parallel reduction (engine.overlap)
    grad_bucket_mb: float = GRAD_BUCKET_MB
    step_sync: str = "global"            # post_validate: the rollback snapshot (engine.footprint)
    grad_clip: bool = True               # post_validate keeps the gradients for a clipped redo
    # ZeRO-3 (FSDP2, engine.fsdp): a chunk's layers are resharded after each of its actions (True)
    # or stay gathered for the step (False)
    reshard_after_forward: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; use one of {PRECISIONS}")
        if self.optimizer.lower() not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of {list(OPTIMIZERS)}")
        if self.zero_stage not in (*ZERO_STAGES, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 (DeepSpeed) or 3 (FSDP2), got {self.zero_stage}")
        if self.zero_stage == 3 and self.backend not in ("auto", "fsdp"):
            raise ValueError(f"zero_stage=3 runs on FSDP2, not backend={self.backend!r}; use backend='auto'")
        if self.data_parallel < 1:
            raise ValueError(f"data_parallel must be >= 1, got {self.data_parallel}")
        check_grad_accum_dtype(self.grad_accum_dtype, self.precision)

    @property
    def zero3(self) -> bool:
        return self.zero_stage == 3

    def gathered_bytes_per_param(self) -> float:
        """Under ZeRO-3, the bytes of a gathered (unsharded) parameter in the compute dtype; 0
        otherwise (a whole-weight rank's parameters are all in :attr:`Footprint.parameters`)."""
        if not self.zero3:
            return 0.0
        from engine.choices import weight_bytes

        return float(min(weight_bytes(self.precision), 4))

    def footprint(self, numel: float, largest: float = 0, zero_overlap: "float | ZeroTensors | None" = None
                  ) -> Footprint:
        """The optimizer backend's bytes for a rank of ``numel`` parameters (ZeRO-3: every layer
        gathered, :func:`partitioner.zero3.zero3_footprint`; ``zero_overlap``: ZeRO-2's
        :class:`engine.footprint.ZeroTensors`, or their overlap alone; None: the partition's
        own)."""
        if self.zero3:
            from .zero3 import zero3_footprint

            return zero3_footprint(numel, largest, data_parallel=self.data_parallel, precision=self.precision,
                                   optimizer=self.optimizer, momentum=self.momentum)
        return state_footprint(int(numel), int(largest), precision=self.precision,
                               optimizer=self.optimizer, momentum=self.momentum,
                               zero_stage=self.zero_stage, data_parallel=self.data_parallel,
                               grad_accum_dtype=self.grad_accum_dtype, backend=self.backend,
                               overlap_grad_reduce=self.overlap_grad_reduce, grad_bucket_mb=self.grad_bucket_mb,
                               step_sync=self.step_sync, grad_clip=self.grad_clip, zero_overlap=zero_overlap)

    def per_param_bytes(self, numel: float = _REF_NUMEL) -> float:
        """Forward/backward-phase bytes per parameter of a rank holding ``numel`` parameters
        (weights, gradients, optimizer state and the backend's backward transient that grows
        with the parameters; the default: below every bucket cap)."""
        f = self.footprint(numel)
        return (f.parameters + f.gradients + f.optimizer_state + f.backward_temporary
                + f.rollback_gradients) / max(numel, 1.0)

    @functools.lru_cache(maxsize=64)
    def made_gradient_bytes_per_param(self) -> float:
        """Bytes per parameter of the gradients the backend makes per parameter at the step's
        first backward that reaches it (``Footprint.gradients_from_first_backward``); 0 where it
        holds them whole from its first weight gradients on (DeepSpeed's flat buffers)."""
        f = self.footprint(_REF_NUMEL)
        return f.gradients / _REF_NUMEL if f.gradients_from_first_backward else 0.0

    def step_per_param_bytes(self, numel: float = _REF_NUMEL) -> float:
        """Step-phase bytes per parameter of a rank holding ``numel`` parameters."""
        f = self.footprint(numel)
        return (f.parameters + f.optimizer_state + f.step_gradients + f.step_temporary) / max(numel, 1.0)

    @property
    def node_split(self) -> bool:
        """Whether the engine splits I/W at the autograd nodes (the torch backend) or, when the
        backend cannot take gradient edges as backward roots (DeepSpeed's), at each layer."""
        if self.zero3:   # FSDP2 (engine.fsdp: accepts_gradient_edges)
            return True
        return backend_of(self.precision, self.zero_stage, self.backend) == "torch"

    def pending_grad_bytes(self, cost: "LayerCost") -> int:
        """Bytes a layer keeps per microbatch between its I and its W: the gradients at its
        weight-owning nodes (``LayerCost.pending_bytes``) under the node split; under the
        per-layer cut the gradient at the output of a layer with parameters."""
        if self.node_split:
            return cost.pending_bytes
        if cost.loss_input_bytes:   # the loss layer: the gradient of the head's output (its segment's root)
            return int(cost.loss_input_bytes)
        return cost.output_bytes if cost.param_bytes > 0 else 0

    def loss_cut_bytes(self, cost: "LayerCost") -> tuple[float, float]:
        """Under the per-layer cut (not :attr:`node_split`), for the layer profiled with the loss
        (``LayerCost.loss_input_bytes`` / ``loss_saved_bytes``): the bytes its output keeps per
        microbatch held for backward (the root of the layer's segment, which the loss's segment
        does not save) and the bytes the loss's segment frees at I (its saved tensors: the graph
        of a segment without parameters is not kept for W). (0, 0) under the node split, for a
        fused head (its loss is in its segment) and for any other layer.

        >>> from partitioner.costs import LayerCost
        >>> c = LayerCost(1.0, 1.0, 8, 10, 4, loss_input_bytes=4, loss_saved_bytes=8)
        >>> MemorySettings("bf16").loss_cut_bytes(c), MemorySettings("fp32", zero_stage=0).loss_cut_bytes(c)
        ((4.0, 8.0), (0.0, 0.0))
        """
        if self.node_split or not cost.loss_input_bytes:
            return 0.0, 0.0
        return float(cost.loss_input_bytes), float(cost.loss_saved_bytes or 0)

    def largest_param_bytes(self, largest: float) -> float:
        """The backward transient that follows the largest parameter tensor (its gradient being
        accumulated, its fp32 copy), beyond :meth:`per_param_bytes`."""
        return (self.footprint(_REF_NUMEL, largest).backward_temporary
                - self.footprint(_REF_NUMEL, 0).backward_temporary)

    def to_dict(self) -> dict:
        return asdict(self)


def rank_breakdown(settings: MemorySettings, *, numel: float, largest: float, activations: float,
                   communication: float, workspace: float, pending: float = 0.0,
                   microbatch_activations: float = 0.0, in_backward: bool = True,
                   gradients_made: bool = True,
                   layer_transient: tuple[float, float] | None = None,
                   weight_grads: bool = True, gathered: float | None = None,
                   zero_overlap: "float | ZeroTensors | None" = None,
                   loss_transient: tuple[tuple[float, float], tuple[float, float]] | None = None,
                   split_weight: bool = False, unmade_gradients: float = 0.0) -> dict[str, float]:
    """The rank's memory at its peak, by :data:`BREAKDOWN_KEYS` (bytes; they sum to the peak;
    under ZeRO-3 ``parameters`` are the fp32 shards and ``gathered_parameters``, after it, the
    unsharded copies in the compute dtype of the ``gathered`` elements held then, None: all):
    the larger of the forward/backward phase and the step phase. ``pending``: the gradients
    kept between I and W at the peak (split-backward schedules), booked as ``temporary``:
    gradients of intermediate tensors made by a backward, as MemTracker books them.
    ``microbatch_activations``: one microbatch's activations on the rank (its largest chunk);
    a transient that exists only during a bucket reduce (``Footprint.reduce_temporary``) meets
    the activations less the share that microbatch's backward has freed by then.
    ``in_backward``: the figures are those of a moment inside a backward action (False: a
    forward, when no backward transient or workspace exists). ``gradients_made``: the rank has
    run a backward this step (False: a backend that makes its gradients at the first backward,
    ``Footprint.gradients_from_first_backward``, holds none yet, and that backward takes each
    gradient as it is made, with no accumulation transient). ``layer_transient``: the largest
    transient of one layer's backward beyond what that backward has freed by then (with and
    without the accumulation transient of the layer's largest parameter,
    :func:`layer_transient`); None: the rank's largest parameter's transient plus
    ``workspace``, as if they met the microbatch's activations all held. ``weight_grads``: the
    moment makes weight gradients (False: a split backward's I, where the backend's gradient
    transients, its buckets and copies, do not exist; ``layer_transient`` is then I's own).
    ``zero_overlap``: ZeRO-2's buffers that follow the rank's tensors
    (:class:`engine.footprint.ZeroTensors`, or their whole-parameter overlap alone; None: the
    partition's own); its zeros for chunks not yet back-propagated are held once the rank has
    run a backward. ``split_weight``: the moment is a split backward's W (a tensor larger than the
    bucket that W reduces first meets all of the microbatch's held activations).
    ``loss_transient``: ``layer_transient`` split into the other layers' and the loss layer's own
    (:func:`loss_split`): ZeRO-2 (``Footprint.freed_at_step``) builds its bucket at a backward's
    first parameter hook, after the loss's backward (fp32 its ``second_buffer`` too), so the
    loss's meets none of them. ``unmade_gradients``: the gradients of the rank's chunks not yet
    back-propagated then (:attr:`RankPeak.unmade`)."""
    f = settings.footprint(numel, largest, zero_overlap)
    fresh = not gradients_made and f.gradients_from_first_backward
    unmade = 0.0 if gradients_made else f.second_buffer   # no previous buffer at the first backward
    # what does not follow one layer's parameters (buckets, flat copies) stays whole
    buckets = (settings.footprint(numel, 0, zero_overlap).backward_temporary - unmade
               if layer_transient is not None or f.freed_at_step else 0.0)
    idx = 1 if fresh else 0

    def transient(level: float) -> float:
        """The backward's transient with ``level`` bytes of the backend's own held (the loss's
        own backward meets none of them where they are built after it)."""
        if not in_backward:
            return 0.0
        if layer_transient is None:
            return level + workspace
        if loss_transient is not None and f.freed_at_step:   # ZeRO-2: buckets built at the first hook
            others, loss = loss_transient
            return max(level + others[idx], loss[idx])
        return level + layer_transient[idx]

    if layer_transient is None:
        level = 0.0 if fresh else f.backward_temporary - unmade
    else:
        level = 0.0 if fresh or not weight_grads else buckets
    backward = {"parameters": f.parameters,
                "gradients": ((0.0 if fresh else max(0.0, f.gradients - unmade_gradients)) + f.rollback_gradients
                              + (f.unreached_gradients if gradients_made else 0.0)),
                "optimizer_state": f.optimizer_state, "activations": activations,
                "communication": communication, "temporary": transient(level) + pending}
    at_reduce_only = f.reduce_temporary - unmade
    unbuilt = f.freed_at_step and not gradients_made   # no gradient buffer before the first reduce
    if in_backward and weight_grads and not fresh and (at_reduce_only > 0 or unbuilt) and microbatch_activations > 0:
        before = dict(backward, temporary=transient(level - at_reduce_only) + pending)
        if unbuilt:
            before["gradients"] = f.rollback_gradients
        backward = max([before, *_reduce_moments(f, backward, buckets + pending, microbatch_activations, split_weight)],
                       key=lambda d: sum(d.values()))
    elif unbuilt and not (in_backward and weight_grads):
        backward["gradients"] = f.rollback_gradients
    return _larger_than_step(settings, f, numel, gathered, backward)


def _larger_than_step(settings: MemorySettings, f: Footprint, numel: float, gathered: float | None,
                      backward: dict[str, float]) -> dict[str, float]:
    """The larger of the forward/backward moment ``backward`` and the step's (ZeRO-3: each with
    its shards and gathered copies apart, :func:`_zero3_terms`)."""
    step = {"parameters": f.parameters, "gradients": f.step_gradients,
            "optimizer_state": f.optimizer_state, "activations": 0.0, "communication": 0.0,
            "temporary": f.step_temporary}
    if settings.zero3:
        backward, step = _zero3_terms(settings, numel, gathered, backward), _zero3_terms(settings, numel, 0.0, step)
    return backward if sum(backward.values()) >= sum(step.values()) else step


def _reduce_moments(f: Footprint, backward: dict[str, float], held: float, microbatch_activations: float,
                    split_weight: bool) -> list[dict[str, float]]:
    """A backward's moments at a reduce (``backward``: the moment's terms; ``held``: what the
    backend holds then beyond the reduce's own, its buckets and the pending gradients): a bucket's
    reduce, with the microbatch's activations less the share its backward has freed, and a
    tensor larger than the bucket reduced apart, at the share its position leaves."""
    acts = backward["activations"]
    at_reduce = dict(backward, activations=max(0.0, acts - f.reduce_after * microbatch_activations))
    if f.freed_at_step:   # a reduce runs after its gradients' layers are done: no layer workspace then
        at_reduce["temporary"] = held + f.reduce_gradient
    if f.reduce_moments and f.freed_at_step:   # each reduce walked, at the activations freed by then
        out = [dict(at_reduce, temporary=held - f.reduce_temporary + own + f.reduce_gradient,
                    activations=max(0.0, acts - min(freed, microbatch_activations)))
               for own, freed in f.reduce_moments]
    else:
        out = [at_reduce]
    if f.large_gradient > 0:
        share = 0.0 if split_weight and f.large_reduced_first else f.large_reduce_after
        out.append(dict(at_reduce, temporary=held + f.large_gradient,
                        activations=max(0.0, acts - share * microbatch_activations)))
    return out


def _zero3_terms(settings: MemorySettings, numel: float, gathered: float | None, d: dict[str, float]
                 ) -> dict[str, float]:
    """``d`` (whose ``parameters`` hold every layer gathered) with ZeRO-3's parameters as two
    terms: the shards and the ``gathered`` elements' unsharded copies (None: all)."""
    w = settings.gathered_bytes_per_param()
    g = numel if gathered is None else min(float(gathered), numel)
    out = dict(d, parameters=d["parameters"] - w * numel)
    return {"parameters": out.pop("parameters"), "gathered_parameters": w * g, **out}


def layer_transient(settings: MemorySettings, largest: list[float], workspace: list[float],
                    freed: list[float], loss_at: int | None = None) -> tuple[float, float]:
    """The largest transient of one layer's backward that meets the rank's held memory, with
    and without the accumulation transient of its largest parameter (``largest``: elements;
    as :meth:`MemorySettings.largest_param_bytes`, on a rank holding at least that tensor): each layer's parameter transient and backward
    workspace, less ``freed``, what the same backward has already freed of the microbatch's
    activations when it reaches the layer (the activations of the layers after it in its chunk;
    0 where a split backward keeps them until W). A chunk's first layer (an embedding with a
    large table) runs its backward last, when the rest of the chunk's activations are gone.
    ``loss_at``: the index of the layer profiled with the loss. Its workspace is the loss's
    backward transient (the fp32 gradient of the logits and its casts), freed before the head's
    weight gradient is accumulated, so the two are a maximum there, not a sum (MemTracker:
    experiments.memcheck's large-vocabulary rows).

    >>> s = MemorySettings("fp32", "adamw", zero_stage=0)
    >>> layer_transient(s, [100.0, 10.0], [50.0, 50.0], [300.0, 0.0])   # the first layer: 400 + 50 - 300
    (150.0, 50.0)
    >>> layer_transient(s, [100.0], [500.0], [0.0], loss_at=0)   # max(400, 500), not 400 + 500
    (500.0, 500.0)
    """
    def param(big: float) -> float:   # a rank holding the tensor holds at least its elements
        n = max(big, 1.0)
        return settings.footprint(n, big).backward_temporary - settings.footprint(n, 0).backward_temporary

    rows = [(param(big) + ws - fr, ws - fr) for big, ws, fr in zip(largest, workspace, freed)]
    if loss_at is not None:  # the loss's workspace is gone before the head's weight gradient lands
        big, ws, fr = largest[loss_at], workspace[loss_at], freed[loss_at]
        rows[loss_at] = (max(param(big), ws) - fr, ws - fr)
    return max(0.0, max(r[0] for r in rows)), max(0.0, max(r[1] for r in rows))


def loss_split(settings: MemorySettings, largest: list[float], workspace: list[float], freed: list[float],
               loss_at: int | None) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """:func:`layer_transient` of the layers other than the loss's, and of the loss's layer alone
    (None without a loss layer on the rank).

    >>> s = MemorySettings("bf16", "adamw", zero_stage=2, data_parallel=2)
    >>> loss_split(s, [10.0, 10.0], [5.0, 50.0], [0.0, 0.0], loss_at=1)
    ((5.0, 5.0), (50.0, 50.0))
    """
    if loss_at is None:
        return None
    rest = [j for j in range(len(largest)) if j != loss_at]
    others = layer_transient(settings, [largest[j] for j in rest], [workspace[j] for j in rest],
                             [freed[j] for j in rest]) if rest else (0.0, 0.0)
    own = layer_transient(settings, [largest[loss_at]], [workspace[loss_at]], [freed[loss_at]], loss_at=0)
    return others, own


def static_factor(itemsize: int, optimizer: str = "adamw", zero_stage: int = 1, data_parallel: int = 1,
                  precision: str | None = None, momentum: float = 0.0,
                  grad_accum_dtype: str = "fp32") -> float:
    """Forward/backward-phase bytes of state per byte of profiled parameters
    (:meth:`MemorySettings.per_param_bytes` / ``itemsize``; ``precision`` None: fp32 for a
    4-byte profile, bf16 for a 2-byte one).

    >>> static_factor(4, "adamw", zero_stage=1, data_parallel=2)   # (4 + 4 + (8 + 4) / 2) / 4
    3.5
    """
    precision = precision or ("fp32" if itemsize >= 4 else "bf16")
    mem = MemorySettings(precision, optimizer, momentum, zero_stage, data_parallel, grad_accum_dtype)
    return mem.per_param_bytes() / itemsize


def _interleaved_forward_order(p: int, m: int, v: int) -> list[int]:
    """Local chunk index of each forward a rank runs, in Megatron's interleaved order."""
    return [(k // p) % v for k in range(m * v)]


def inflight_per_chunk(schedule: str, num_stages: int, microbatches: int, virtual_stages: int = 1,
                       max_inflight: int | None = None) -> list[int]:
    """Microbatches whose activations each chunk holds at its rank's peak (chunk order).

    - gpipe: m on every stage.
    - 1f1b: min(p - j, m).
    - zb-h1: min(p, m) on every stage: a microbatch is held until its W, and H1 caps every
      rank at 1F1B's pipeline peak (its first stage's count), so later ranks hold more than
      under 1F1B while the largest rank does not (the engine's zb-h1 builds exactly this).
    - zb-h2: min(max_inflight, m) on every stage (max_inflight defaults to 2p - 1).
    - interleaved-1f1b: rank r runs min((p - r - 1) * 2 + (v - 1) * p, m * v) warm-up
      forwards (Megatron) and one more before its first backward; each chunk holds the
      forwards of that prefix that belong to it.
    - zbv (V placement, rank r holds chunks r and 2p-1-r): with m >= 2p - 1, rank r peaks at
      2p chunk activations, 2p-1-r of chunk r and r+1 of chunk 2p-1-r; fewer microbatches are
      read from the engine's schedule.
    - zb-auto (built from unit costs when none are given) and dualpipev: read from the
      engine's schedule.
    """
    p, m, v = num_stages, microbatches, virtual_stages
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"num_stages, microbatches, virtual_stages must be >= 1 (got {p}, {m}, {v})")
    info = SCHEDULE_INFO[schedule]
    if info.chunks_per_rank is not None and v != info.chunks_per_rank:
        raise ValueError(f"schedule={schedule!r} runs {info.chunks_per_rank} chunk(s) per rank; "
                         f"pass virtual_stages={info.chunks_per_rank} (got {v})")
    if schedule == "gpipe":
        return [m] * p
    if schedule == "1f1b":
        return [min(p - j, m) for j in range(p)]
    if schedule == "zb-h1":
        return [min(p, m)] * p
    if schedule == "zb-h2":
        cap = build_schedule(schedule, p, m, max_inflight=max_inflight).max_inflight
        return [min(cap, m)] * p
    if schedule in ("zb-auto", "dualpipev"):   # read from the engine's schedule
        return inflight_from_schedule(build_schedule(schedule, p, m, v, max_inflight=max_inflight))
    if schedule == "zbv":
        if m < 2 * p - 1:
            return inflight_from_schedule(build_schedule(schedule, p, m, v))
        return [2 * p - 1 - c if c < p else 2 * p - c for c in range(2 * p)]
    out = [0] * (p * v)
    order = _interleaved_forward_order(p, m, v)
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        for local in order[: min(warm + 1, m * v)]:
            out[local * p + r] += 1
    return out


State = tuple[tuple[int, ...], tuple[int, ...]]   # (held, pending) per chunk of a rank


def schedule_states(schedule) -> list[list[State]]:  # noqa: ANN001 - an engine.schedules.Schedule
    """Per rank, the microbatches each of its chunks (``stages_of`` order) holds and has pending
    after each of its actions, read from the action lists: F adds a held one; I a pending one
    (its input gradient done, its weight gradient deferred); W releases both; B a held one.
    Only the states no other state of the rank dominates are kept (a peak is one of them), in
    order of first appearance.

    >>> from engine.schedules import build_schedule
    >>> schedule_states(build_schedule("zb-h1", 2, 4))
    [[((2,), (1,))], [((2,), (2,))]]
    """
    out = []
    for r, acts in enumerate(schedule.actions):
        mine = schedule.stages_of(r)
        held, pend = dict.fromkeys(mine, 0), dict.fromkeys(mine, 0)
        seen: dict[State, None] = {}   # insertion-ordered set
        for a in acts:
            if a.kind in ("F", "I"):
                (held if a.kind == "F" else pend)[a.stage] += 1
            elif a.kind in ("B", "W"):
                held[a.stage] -= 1
                pend[a.stage] -= a.kind == "W"
            else:
                continue
            seen[(tuple(held[c] for c in mine), tuple(pend[c] for c in mine))] = None
        front = _undominated([h + g for h, g in seen])
        out.append([st for st, keep in zip(seen, front) if keep])
    return out


def _undominated(flat: list[tuple[int, ...]]) -> list[bool]:
    """For each (distinct) vector, whether no other vector is >= it in every component.
    A vector dominated by another is dominated by an undominated one with a larger sum, so
    scanning by decreasing sum compares each only with the maxima found so far (a front of a
    few states, not all of them: schedules of many ranks and microbatches have thousands).

    >>> _undominated([(1, 0), (2, 1), (0, 3), (2, 0)])
    [False, True, True, False]
    """
    keep = [False] * len(flat)
    front: list[tuple[int, ...]] = []
    for i in sorted(range(len(flat)), key=lambda i: -sum(flat[i])):
        x = flat[i]
        if not any(all(b >= a for a, b in zip(x, y)) for y in front):
            front.append(x)
            keep[i] = True
    return keep


def peak_state(states: list[State], held_bytes: list[float], pending_bytes: list[float]) -> State:
    """The state of one rank with the most ``sum(held * held_bytes + pending * pending_bytes)``
    over its chunks (the first such): the peak of the combined quantity, not two maxima.

    >>> peak_state([((3, 1), (0, 1)), ((4, 0), (1, 0))], [1.0, 1.0], [0.0, 5.0])
    ((3, 1), (0, 1))
    """
    def total(st: State) -> float:
        return sum(h * a + g * b for h, g, a, b in zip(st[0], st[1], held_bytes, pending_bytes))
    best = states[0]
    for st in states[1:]:
        if total(st) > total(best):
            best = st
    return best


def held_and_pending(schedule, held_bytes: list[float] | None = None,  # noqa: ANN001
                     pending_bytes: list[float] | None = None) -> tuple[list[int], list[int]]:
    """Per chunk, the microbatches held and pending (I done, W not yet) at its rank's peak of
    ``held * held_bytes[c] + pending * pending_bytes[c]`` summed over the rank's chunks
    (per-chunk bytes per microbatch; default 1 and 0: the peak count of held microbatches).

    >>> from engine.schedules import build_schedule
    >>> held_and_pending(build_schedule("zb-h1", 4, 8), [1.0] * 4, [0.5] * 4)
    ([4, 4, 4, 4], [1, 2, 3, 4])
    """
    k = schedule.num_chunks
    a = [1.0] * k if held_bytes is None else list(held_bytes)
    g = [0.0] * k if pending_bytes is None else list(pending_bytes)
    held, pend = [0] * k, [0] * k
    for r, states in enumerate(schedule_states(schedule)):
        mine = schedule.stages_of(r)
        h, p = peak_state(states, [a[c] for c in mine], [g[c] for c in mine])
        for i, c in enumerate(mine):
            held[c], pend[c] = h[i], p[i]
    return held, pend


def inflight_from_schedule(schedule) -> list[int]:  # noqa: ANN001 - an engine.schedules.Schedule
    """Per chunk, the microbatches it holds when its rank first reaches its peak count, read
    from a schedule's action lists (F adds one; B, or W for split backwards, releases one).
    This is what the engine runs, so the planner prefers it to the closed forms above."""
    return held_and_pending(schedule)[0]


def rank_totals(per_chunk: list, schedule: str, num_stages: int, virtual_stages: int = 1) -> list:
    """Sum a per-chunk figure over each rank's chunks (the schedule's placement).

    >>> rank_totals([1, 2, 3, 4], "zbv", 2, 2), rank_totals([1, 2, 3, 4], "interleaved-1f1b", 2, 2)
    ([5, 5], [4, 6])
    """
    out = [0] * num_stages
    for c, r in enumerate(chunk_ranks(schedule, num_stages, virtual_stages)):
        out[r] += per_chunk[c]
    return out


@dataclass(frozen=True)
class ChunkBytes:
    """What one chunk holds, per microbatch, for :func:`program_peaks` (bytes):
    ``held``: a held microbatch (saved activations and the output the engine keeps for its
    backward, :func:`kept_output_bytes`); ``pending``: a microbatch between its I and its W;
    ``input`` / ``output``: the tensors crossing its cuts (its input and, sent back, the input's
    gradient; its output and, received, the output's gradient), 0 at the model's ends or where
    the neighbouring chunk is on the same rank (a hand-off in memory); ``gradients``: its
    gradients, where the backend makes them per parameter at the step's first backward that
    reaches them (``Footprint.gradients_from_first_backward``; else 0: a rank's gradients are
    booked whole from its first weight gradients on)."""

    held: float
    pending: float = 0.0
    input: float = 0.0
    output: float = 0.0
    gradients: float = 0.0


@dataclass(frozen=True)
class RankPeak:
    """One rank's peak in :func:`program_peaks`: per chunk of the rank (``stages_of`` order)
    the microbatches held and pending, and the bytes of the transfer buffers alive then
    (``communication``: receives posted ahead or arrived and not yet used, gradients being
    received and sent, sends not yet waited whose tensor nothing else holds); ``unmade``: the
    :attr:`ChunkBytes.gradients` of the rank's chunks whose first B or W has not run yet (after
    the rank's first weight gradients: a chunk of a rank of several makes its own later)."""

    held: tuple[int, ...]
    pending: tuple[int, ...]
    communication: float
    total: float
    unmade: float = 0.0


class RankPeaks(NamedTuple):
    """A rank's peaks (:func:`program_peaks`) inside forward (F), whole backward (B),
    input-gradient (I) and weight-gradient (W) actions, before its first weight gradients
    (``*_early``) and from then on; a moment that never occurs has ``total`` -1. A split
    backward's I and W meet different transients (I: the input gradients' workspace; W: the
    weight gradients), hence their own moments."""

    forward_early: RankPeak
    backward_early: RankPeak
    forward: RankPeak
    backward: RankPeak
    input_early: RankPeak
    input: RankPeak
    weight_early: RankPeak
    weight: RankPeak

    def moments(self) -> list[tuple[str, bool, RankPeak]]:
        """``(action kind, after the first weight gradients, peak)`` of each moment that occurs."""
        kinds = (("F", False), ("B", False), ("F", True), ("B", True), ("I", False), ("I", True),
                 ("W", False), ("W", True))
        return [(k, made, pk) for (k, made), pk in zip(kinds, self) if pk.total >= 0]


def kept_output_bytes(output_bytes: float, output_saved_bytes: float, recompute: bool) -> float:
    """Bytes of a chunk's output that the engine keeps per held microbatch beyond its saved
    activations: ``engine.stage.Chunk.forward`` keeps each microbatch's output tensors (the roots
    of its backward, ``_MbState.outputs``) from its forward until its backward frees the state
    (B, or W under a split backward). A layer that saved its own output for backward (e.g. a
    ReLU) already counts that part in its activations (``LayerCost.output_saved_bytes``); a
    recomputing chunk saves nothing but its input, so its whole output counts.

    >>> kept_output_bytes(100, 0, False), kept_output_bytes(100, 100, False), kept_output_bytes(100, 100, True)
    (100.0, 0.0, 100.0)
    """
    return float(output_bytes if recompute else max(0.0, output_bytes - output_saved_bytes))


def program_peaks(schedule, chunks: list[ChunkBytes], *, lookahead: int,  # noqa: ANN001
                  send_wait: str) -> list[RankPeaks]:
    """Per rank, the peaks of held activations + pending gradients + transfer buffers over its
    lowered program, in forward and in backward actions, before its first weight gradients
    are made (the actions up to and including its first B or W: a backend that drops
    gradients between steps has none yet) and from then on (:class:`RankPeaks`),  (``engine.schedules.lower``), walked as ``engine.executor`` runs it:
    receives are posted up to ``lookahead`` ahead after each compute (their buffers alive from
    then), a received gradient lives until its backward ends and the input gradient a backward
    makes until its send is waited, and every send is waited before each compute
    (``send_wait="compute"``) or only at the step's end ("yield", "step": the sent tensors stay
    referenced until then, so an output whose microbatch was freed still counts). Measured
    inside each compute action (a backward still holds its microbatch).

    >>> from engine.schedules import build_schedule
    >>> cb = [ChunkBytes(10.0, 0.0, 0.0, 1.0), ChunkBytes(10.0, 0.0, 1.0, 0.0)]
    >>> [(pk.backward.held, pk.backward.communication) for pk in program_peaks(
    ...     build_schedule("1f1b", 2, 4), cb, lookahead=0, send_wait="compute")]
    [((2,), 1.0), ((1,), 1.0)]
    """
    from engine.schedules import lower

    if send_wait not in ("compute", "yield", "step"):
        raise ValueError(f"send_wait must be 'compute', 'yield' or 'step', got {send_wait!r}")
    return [_walk_rank(schedule.stages_of(r), ops, chunks, lookahead, send_wait == "compute")
            for r, ops in enumerate(lower(schedule))]


def _walk_rank(mine: list[int], ops: list, chunks: list[ChunkBytes], lookahead: int,
               wait_each: bool) -> RankPeaks:
    """:func:`program_peaks` for one rank's lowered program ``ops``."""
    held, pend = dict.fromkeys(mine, 0), dict.fromkeys(mine, 0)
    freed: set[tuple[int, int]] = set()      # (chunk, microbatch) whose state was freed
    posted: dict[tuple[str, int, int], float] = {}   # receive buffers posted or arrived
    ahead: set[tuple[str, int, int]] = set()          # posted, their RECV not reached yet
    # sends not yet waited: their bytes held, SEND_B's at once, a SEND_F's once its state is freed
    unwaited_b, unwaited_freed = 0.0, 0.0
    unwaited_f: dict[tuple[int, int], float] = {}     # (chunk, microbatch) -> SEND_F bytes not yet freed
    recv_at = [k for k, op in enumerate(ops) if op.kind.startswith("RECV")]
    recv_index = {k: n for n, k in enumerate(recv_at)}
    nxt, best = 0, [RankPeak(tuple(held.values()), tuple(pend.values()), 0.0, -1.0)] * 8
    slots = {"F": (0, 2), "B": (1, 3), "I": (4, 5), "W": (6, 7)}   # RankPeaks' order
    phase = 0   # 1 once the rank's first weight gradients exist (after its first B or W)
    unmade = {s: chunks[s].gradients for s in mine}   # chunks without their gradients yet

    def size(kind: str, c: int) -> float:
        return chunks[c].input if kind in ("RECV_F", "SEND_B") else chunks[c].output

    for k, op in enumerate(ops):
        key = (op.kind, op.stage, op.microbatch)
        if op.kind.startswith("RECV"):
            posted.setdefault(key, size(op.kind, op.stage))
            ahead.discard(key)
            nxt = max(nxt, recv_index[k] + 1)
            continue
        if op.kind.startswith("SEND"):
            nbytes = size(op.kind, op.stage)
            if op.kind == "SEND_B":
                unwaited_b += nbytes
            elif (op.stage, op.microbatch) in freed:
                unwaited_freed += nbytes
            else:
                unwaited_f[(op.stage, op.microbatch)] = unwaited_f.get((op.stage, op.microbatch), 0.0) + nbytes
            continue
        if wait_each:
            unwaited_b, unwaited_freed = 0.0, 0.0
            unwaited_f.clear()
        c, i = op.stage, op.microbatch
        made = chunks[c].input if op.kind in ("B", "I") else 0.0   # the input gradient it makes
        if op.kind == "F":
            posted.pop(("RECV_F", c, i), None)   # the input is held by the chunk from now on
            held[c] += 1
        comm = sum(posted.values()) + made + unwaited_b + unwaited_freed
        total = comm + sum(held[s] * chunks[s].held + pend[s] * chunks[s].pending for s in mine)
        slot = slots[op.kind][phase]
        missing = sum(unmade.values()) if phase else 0.0
        if best[slot].total < 0 or total - missing > best[slot].total - best[slot].unmade:
            best[slot] = RankPeak(tuple(held.values()), tuple(pend.values()), comm, total, missing)
        if op.kind in ("B", "I"):
            posted.pop(("RECV_B", c, i), None)
        if op.kind == "I":
            pend[c] += 1
        elif op.kind in ("B", "W"):
            held[c] -= 1
            pend[c] -= op.kind == "W"
            freed.add((c, i))
            unwaited_freed += unwaited_f.pop((c, i), 0.0)
            unmade.pop(c, None)
        phase = max(phase, int(op.kind in ("B", "W")))
        while nxt < len(recv_at) and len(ahead) < lookahead:   # posted after compute
            r = ops[recv_at[nxt]]
            posted[(r.kind, r.stage, r.microbatch)] = size(r.kind, r.stage)
            ahead.add((r.kind, r.stage, r.microbatch))
            nxt += 1
    return RankPeaks(*best)
