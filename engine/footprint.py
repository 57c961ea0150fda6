"""What a rank's optimizer backend holds in memory (pure Python, no torch).

The one place that states the engine's memory layout per parameter: the torch backend
(``engine.optim``) and the DeepSpeed backend (``engine.zero``, DeepSpeed 0.19's ZeRO-1/2 and bf16
optimizers as driven there). The partitioner's memory model adds activations to it.

A rank holding ``N`` parameters (``L`` elements in its largest parameter tensor) is in one of
two phases at its peak:

* forward/backward: weights, the gradients held through backward, the optimizer state, the
  activations of the microbatches in flight and the transient of one backward
  (``backward_temporary``: the 16-bit gradient of the parameter being accumulated and its
  fp32 copy; ZeRO-2's reduce bucket (one: DeepSpeed 0.19 allocates a second only with
  ``overlap_comm``, which ``engine.zero`` leaves off); the 16-bit bucket's fp32 cast
  exists only while a full bucket is reduced, ``reduce_temporary``, by when the microbatch
  being back-propagated has freed the share ``reduce_after`` of its activations);
* the step: weights, the gradients held at the step (``step_gradients``), the optimizer state
  and the step's temporaries (``step_temporary``: the flattened reduce bucket, or with the
  torch backend's overlapped reduction (``engine.overlap``) every bucket's flat copy, held
  until the last one is reduced; ZeRO's flat
  gradient partition and its fp32 copy). The torch optimizers are fused: no per-parameter
  temporaries.

Bytes per element: weights ``w`` (4, or 2 for 16-bit weights), gradient accumulation ``a``,
optimizer state ``s`` (Adam 8, SGD with momentum 4, plain SGD 0), ZeRO partition ``N / d``,
reduce bucket ``B`` (:func:`zero_bucket_elements`).

Example::

    >>> f = state_footprint(1000, 100, precision="bf16", optimizer="adamw", zero_stage=1,
    ...                     data_parallel=2)
    >>> f.parameters, f.gradients, f.optimizer_state   # 2 + 4 + 12 / 2 bytes per parameter
    (2000.0, 4000.0, 6000.0)
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import asdict, dataclass
from typing import Sequence

__all__ = ["zero_bucket_elements", "zero_partition_overlap", "ZeroTensors", "zero_tensors", "zero_reduces", "BUCKET_ELEMENTS", "GRAD_BUCKET_MB", "TORCH_BUCKET_BYTES", "Footprint",
           "state_footprint", "optimizer_state_bytes_per_param", "backend_of"]

# DeepSpeed's default reduce / all-gather bucket, in elements.
BUCKET_ELEMENTS = 500_000_000
# The torch backend's data-parallel all-reduce bucket (closed once it holds this many bytes):
# ``OptimizerConfig.grad_bucket_mb``'s default (DDP's bucket_cap_mb).
GRAD_BUCKET_MB = 25.0
TORCH_BUCKET_BYTES = int(GRAD_BUCKET_MB * 2**20)
_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bf16-autocast": 4, "fp16-autocast": 4}
_ACCUM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def zero_bucket_elements(numel: int, data_parallel: int) -> int:
    """DeepSpeed's reduce and all-gather bucket for a rank holding ``numel`` parameters: one
    replica's partition (``numel / data_parallel``), at most DeepSpeed's default, even.

    >>> zero_bucket_elements(1001, 2), zero_bucket_elements(10**12, 8)
    (502, 500000000)
    """
    part = -(-int(numel) // max(1, int(data_parallel)))
    return max(2, min(BUCKET_ELEMENTS, part + part % 2))


def zero_partition_overlap(numels: Sequence[int], data_parallel: int) -> int:
    """The elements of whole parameters overlapping a rank's ZeRO partition, the largest over
    the ``data_parallel`` ranks: what DeepSpeed 0.19's ZeRO-2 gradient buffer holds when it
    keeps gradients in the weight dtype (``grads_in_partition``: each parameter that overlaps
    the partition is copied whole). ``numels``: the rank's parameter tensors in the order
    DeepSpeed flattens them (``module.parameters()``); the flat group is padded to a multiple
    of ``2 * data_parallel`` elements and cut into equal partitions.

    >>> zero_partition_overlap([100, 1000, 100], 2)   # the 1000 straddles the cut at 600
    1100
    >>> zero_partition_overlap([300, 300], 2), zero_partition_overlap([300, 300], 1)
    (300, 600)
    """
    sizes = [int(n) for n in numels if int(n) > 0]
    starts = list(itertools.accumulate(sizes, initial=0))
    return max((starts[last + 1] - starts[first] for first, last in _partition_spans(sizes, data_parallel)),
               default=0)


def _partition_elements(total: int, data_parallel: int) -> int:
    """DeepSpeed's partition of a flat group of ``total`` elements: padded to a multiple of
    ``2 * data_parallel``, cut into ``data_parallel`` equal parts."""
    d = max(1, int(data_parallel))
    return (-(-int(total) // (2 * d)) * 2 * d) // d


def _partition_spans(sizes: Sequence[int], data_parallel: int) -> list[tuple[int, int]]:
    """For each of DeepSpeed's ``data_parallel`` partitions of the flat group of tensors of
    ``sizes`` (padded to a multiple of ``2 * data_parallel`` elements, cut equally) that holds
    any element: the indices of the first and last tensor overlapping it."""
    d = max(1, int(data_parallel))
    starts = list(itertools.accumulate(sizes, initial=0))   # starts[i]: where tensor i begins; starts[-1]: total
    total = starts[-1]
    part = _partition_elements(total, d)
    spans = []
    for pid in range(d if total else 0):
        lo, hi = pid * part, min((pid + 1) * part, total)
        if lo < hi:
            spans.append((bisect.bisect_right(starts, lo) - 1, bisect.bisect_left(starts, hi) - 1))
    return spans


@dataclass(frozen=True)
class ZeroTensors:
    """What DeepSpeed 0.19's ZeRO-2 holds that follows a rank's parameter tensors when it keeps
    gradients in the weight dtype (fp32), from their sizes (:func:`zero_tensors`)."""

    # whole-parameter elements of the largest partition (:func:`zero_partition_overlap`)
    overlap: float
    # elements of whole parameters overlapping the partition in the rank's chunks other than its
    # last: the first backward's epilogue (``get_all_grad_tensors``) holds fp32 zeros for those
    # without a gradient yet, accumulated into until the step
    unreached: float = 0.0
    # every tensor larger than the reduce bucket is its chunk's last, the first one a backward
    # reduces: its flattened copy is freed before that backward's new gradient buffer exists
    large_first: bool = False
    # the rank has one chunk whose first tensor (an embedding) is its largest: that tensor's
    # gradient is made last in a backward, when the microbatch's activations are freed, and the
    # reduce its hook starts (or its own, when larger than the bucket) meets none of them (on a
    # rank of several chunks the freed chunk's share is not known here)
    lead_is_largest: bool = False
    # the largest tensor but that lead (the gradient that can start any other reduce); None: the
    # largest tensor
    rest: float | None = None
    # each bucket reduce a backward runs (:func:`zero_reduces`): the elements it flattens, the
    # elements of the gradient whose hook starts it (0 at the backward's end), whether it is one
    # tensor within one partition (flattened as a view) and the bytes of the microbatch's
    # activations its backward has freed by then (None: unknown); empty: unknown, a full bucket
    reduces: tuple[tuple[float, float, bool, float | None], ...] = ()


def zero_tensors(chunks: Sequence[Sequence[int]], data_parallel: int,
                 freed: Sequence[tuple[Sequence[float], float]] | None = None) -> ZeroTensors:
    """:class:`ZeroTensors` of a rank whose chunks hold parameter tensors of ``chunks``' sizes
    (each in ``module.parameters()`` order; the chunks in the rank's order, its last last;
    ``freed``: :func:`zero_reduces`').

    >>> zt = zero_tensors([[100, 1000], [100]], 2)   # the 1000 straddles the cut at 600
    >>> zt.overlap, zt.unreached, zt.large_first, zt.lead_is_largest, zt.reduces   # the 1000: reduced apart
    (1100.0, 1100.0, True, False, ((100.0, 0.0, True, None), (100.0, 0.0, True, None)))
    """
    flat = [int(n) for c in chunks for n in c if int(n) > 0]
    owner = [k for k, c in enumerate(chunks) for n in c if int(n) > 0]
    bucket = zero_bucket_elements(sum(flat), data_parallel)
    unreached = max((sum(flat[i] for i in range(first, last + 1) if owner[i] != len(chunks) - 1)
                     for first, last in _partition_spans(flat, data_parallel)), default=0)
    large = [i for i, n in enumerate(flat) if n > bucket]
    large_first = all(i + 1 == len(flat) or owner[i + 1] != owner[i] for i in large)
    lead = len(chunks) == 1 and bool(flat) and flat[0] == max(flat)
    rest = float(max(flat[1:], default=0)) if lead else None
    return ZeroTensors(float(zero_partition_overlap(flat, data_parallel)), float(unreached), large_first, lead, rest,
                       zero_reduces(chunks, data_parallel, freed))


def zero_reduces(chunks: Sequence[Sequence[int]], data_parallel: int,
                 freed: Sequence[tuple[Sequence[float], float]] | None = None
                 ) -> tuple[tuple[float, float, bool, float | None], ...]:
    """The bucket reduces DeepSpeed 0.19's ZeRO-2 runs in one backward of each chunk (tensors of
    ``chunks``' sizes, each in ``module.parameters()`` order; their gradients arrive in reverse):
    a hook whose gradient would overflow the bucket reduces it first, and the backward's
    epilogue reduces what is left (``engine.zero`` calls it after every backward). Each reduce
    is (elements flattened, elements of the gradient that started it, 0 at the epilogue, whether
    it is one tensor within one partition, the bytes of the microbatch's activations the
    backward has freed then). ``freed``: per chunk, (per tensor, those bytes once the tensor's
    gradient arrives, the layers after its own done; those at the backward's end); None:
    unknown. A tensor larger than the bucket is reduced apart (``Footprint.large_gradient``),
    not listed.

    >>> zero_reduces([[100, 300, 200]], 2)   # bucket 300: 200 then 300 overflow; 100 at the end
    ((200.0, 300.0, True, None), (300.0, 100.0, False, None), (100.0, 0.0, True, None))
    >>> zero_reduces([[100, 300, 200]], 2, freed=[([90.0, 50.0, 0.0], 100.0)])   # bytes freed
    ((200.0, 300.0, True, 50.0), (300.0, 100.0, False, 90.0), (100.0, 0.0, True, 100.0))
    """
    keep = [[k for k, n in enumerate(c) if int(n) > 0] for c in chunks]
    per_chunk = [[int(c[k]) for k in ks] for c, ks in zip(chunks, keep)]
    shares = None if freed is None else [[float(f[k]) for k in ks] for (f, _), ks in zip(freed, keep)]
    starts = list(itertools.accumulate((n for c in per_chunk for n in c), initial=0))
    bucket = zero_bucket_elements(starts[-1], data_parallel)
    part = _partition_elements(starts[-1], data_parallel)
    out: list[tuple[float, float, bool, float | None]] = []
    first = 0
    for c, sizes in enumerate(per_chunk):
        held: list[int] = []   # indices (in the rank's flat order) of the gradients in the bucket
        total = 0
        for j in reversed(range(first, first + len(sizes))):
            n = starts[j + 1] - starts[j]
            if held and total + n > bucket:
                share = None if shares is None else shares[c][j - first]
                out += _bucket_reduce(starts, held, total, bucket, part, n, share)
                held, total = [], 0
            held.append(j)
            total += n
        out += _bucket_reduce(starts, held, total, bucket, part, 0, None if freed is None else float(freed[c][1]))
        first += len(sizes)
    return tuple(out)


def _bucket_reduce(starts: Sequence[int], held: Sequence[int], total: int, bucket: int, part: int,
                   trigger: int, share: float | None) -> list[tuple[float, float, bool, float | None]]:
    """The reduce of the bucket holding tensors ``held`` (``total`` elements), none where it is
    empty or holds a tensor larger than the bucket (reduced apart)."""
    if not held or total > bucket:
        return []
    j = held[0]
    one = len(held) == 1 and starts[j] // part == (starts[j + 1] - 1) // part
    return [(float(total), float(trigger), one, share)]


def optimizer_state_bytes_per_param(optimizer: str, momentum: float = 0.0) -> int:
    """fp32 state the torch optimizer keeps per parameter: Adam's two moments, SGD's momentum
    buffer (only with momentum > 0).

    >>> optimizer_state_bytes_per_param("adamw"), optimizer_state_bytes_per_param("sgd", 0.9)
    (8, 4)
    """
    name = optimizer.lower()
    if name in ("adam", "adamw"):
        return 8
    if name == "sgd":
        return 4 if momentum else 0
    raise ValueError(f"unknown optimizer {optimizer!r}; use sgd, adam or adamw")


def backend_of(precision: str, zero_stage: int, backend: str = "auto") -> str:
    """``"torch"`` or ``"deepspeed"``: the backend ``engine.optim.make_optimizer`` picks."""
    if backend != "auto":
        return backend
    return "deepspeed" if zero_stage > 0 or _WEIGHT_BYTES[precision] < 4 else "torch"


@dataclass(frozen=True)
class Footprint:
    """Bytes a rank's optimizer backend holds (see the module docstring for the phases)."""

    parameters: float
    gradients: float            # held through forward / backward
    optimizer_state: float      # moments, momentum, fp32 masters (partitions under ZeRO)
    backward_temporary: float   # one backward's transient, beyond the activations
    step_gradients: float       # gradients held at the step's peak
    step_temporary: float       # the step's transient
    # The part of ``backward_temporary`` alive only while a full reduce bucket is reduced, and
    # the share of a backward's gradients made by then (so of its activations freed): ZeRO-2
    # with 16-bit buckets casts the bucket to the fp32 communication dtype.
    reduce_temporary: float = 0.0
    reduce_after: float = 0.0
    # ZeRO-2 with 16-bit weights, the reduces walked (:func:`zero_reduces`): each one's transient
    # beside the bucket and the bytes of the microbatch's activations freed by then; empty (the
    # tensors or what their backward frees unknown): one reduce, ``reduce_temporary`` at
    # ``reduce_after``
    reduce_moments: tuple[tuple[float, float], ...] = ()
    # Whether ``gradients`` first exist at the step's first backward: the torch backend's
    # ``zero_grad`` sets every ``.grad`` to None, so a rank's forwards before its first backward
    # (gpipe's whole forward phase) run without them. DeepSpeed's buffers are kept (False).
    gradients_from_first_backward: bool = False
    # ``step_sync="post_validate"`` (torch backend, with clipping): the previous step's gradients,
    # kept for a clipped redo until the step is validated at the end of this step's backward
    # work; held through forward / backward, freed before the step. (Its snapshot of parameters
    # and optimizer state, held through both phases, is part of ``optimizer_state``.)
    rollback_gradients: float = 0.0
    # ZeRO-2 with gradients in the weight dtype: the next backward's gradient buffer, alive
    # beside the previous one from a backward's first reduce to its end, from the step's second
    # backward on (the step frees the previous one). Part of ``backward_temporary`` and
    # ``reduce_temporary``.
    second_buffer: float = 0.0
    # DeepSpeed's ZeRO-2 builds its gradient buffer at a backward's first reduce and frees it at
    # the step: none is held before the rank's first backward reduces (a forward, a split
    # backward's I, or that backward before its reduce).
    freed_at_step: bool = False
    # ZeRO-2 with gradients in the weight dtype: the gradient of the parameter whose hook starts
    # a reduce, alive through it (at most the rank's largest tensor), beyond ``reduce_temporary``.
    reduce_gradient: float = 0.0
    # ZeRO-2, a parameter larger than the bucket, reduced apart: what its reduce holds beyond
    # ``reduce_temporary`` (its gradient, its flattened copy, that copy's fp32 cast with 16-bit
    # weights), and the share of a microbatch's activations freed by then. With fp32 gradients
    # also an embedding's (:attr:`ZeroTensors.lead_is_largest`) gradient at the reduce its hook
    # starts, when the microbatch's activations are freed.
    large_gradient: float = 0.0
    large_reduce_after: float = 0.0
    # that tensor is the first a backward reduces (:attr:`ZeroTensors.large_first`): under a
    # split backward its W reduces it before any of the microbatch's held activations are freed
    large_reduced_first: bool = False
    # ZeRO-2 with gradients in the weight dtype on a rank of several chunks: the fp32 zeros held
    # from the step's first backward (:attr:`ZeroTensors.unreached`), booked as gradients.
    unreached_gradients: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def state_footprint(numel: int, largest: int, *, precision: str = "fp32", optimizer: str = "adamw",
                    momentum: float = 0.0, zero_stage: int = 0, data_parallel: int = 1,
                    grad_accum_dtype: str = "fp32", backend: str = "auto", overlap_grad_reduce: bool = True,
                    grad_bucket_mb: float = GRAD_BUCKET_MB, step_sync: str = "global",
                    grad_clip: bool = True, zero_overlap: "float | ZeroTensors | None" = None) -> Footprint:
    """What a rank holding ``numel`` parameters (largest tensor ``largest`` elements) keeps
    (``overlap_grad_reduce`` / ``grad_bucket_mb``: the torch backend's data-parallel reduction;
    ``step_sync="post_validate"``: the rollback snapshot, weights and optimizer state, in
    ``optimizer_state``, and with ``grad_clip`` the kept gradients, ``rollback_gradients``;
    ``zero_overlap``: under ZeRO-2 with gradients in the weight dtype, the rank's
    :class:`ZeroTensors` (a number: their ``overlap`` alone, :func:`zero_partition_overlap`);
    None, the tensors unknown: the partition's own elements).

    >>> f = state_footprint(1000, 100, optimizer="adamw", zero_stage=0, step_sync="post_validate")
    >>> f.optimizer_state, f.rollback_gradients   # 8 + (4 + 8) bytes per parameter; 4
    (20000.0, 4000.0)
    """
    if precision not in _WEIGHT_BYTES:
        raise ValueError(f"unknown precision {precision!r}; use one of {sorted(_WEIGHT_BYTES)}")
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero_stage must be 0, 1 or 2 (got {zero_stage})")
    if data_parallel < 1:
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    n, big, d = float(numel), float(min(largest, numel)), int(data_parallel)
    w, s = _WEIGHT_BYTES[precision], optimizer_state_bytes_per_param(optimizer, momentum)
    a = _ACCUM_BYTES[grad_accum_dtype] if w < 4 else 4
    if backend_of(precision, zero_stage, backend) == "torch":
        if d == 1:
            bucket = 0.0
        elif overlap_grad_reduce:    # the buckets' flat copies all live until the last is reduced
            bucket = n
        else:
            bucket = min(n, grad_bucket_mb * 2**20 / 4 + big)
        post = step_sync == "post_validate"
        snapshot = (4 + s) * n if post else 0.0
        return Footprint(4 * n, 4 * n, s * n + snapshot, 4 * big, 4 * n, 4 * bucket,
                         gradients_from_first_backward=True,
                         rollback_gradients=4 * n if post and grad_clip else 0.0)
    if w == 4 and zero_stage == 0:   # DeepSpeed's plain path: its all-reduce flattens
        flat = 4 * min(n, BUCKET_ELEMENTS)
        return Footprint(4 * n, 4 * n, s * n, 4 * big, 4 * n, max(flat, 8 * big))
    dz = d if zero_stage > 0 else 1          # ZeRO-0 with 16-bit weights: whole fp32 masters
    part, bucket = n / dz, float(zero_bucket_elements(numel, d))
    state = (s + 4) * part                   # moments + the fp32 master partition
    after = 2 * a * part + (4 * part if a < 4 else 0.0)  # flat partition (+ its fp32 copy)
    if w < 4 and a == 4 and zero_stage < 2 and precision == "bf16":
        # DeepSpeed's BF16_Optimizer: one flat fp32 gradient buffer, filled by hooks
        return Footprint(w * n, 4 * n, state, (w + 4) * big, 4 * n, 0.0)
    if zero_stage == 2:
        return _zero2_footprint(n, big, d, w, a, state, after, bucket, zero_overlap)
    # ZeRO-1 (and 16-bit ZeRO-0): full gradients until the step's reduce
    separate = a != w                         # 16-bit gradients moved into fp32 grad_accum
    bw = (w * n + 4 * big) if separate else w * big
    own = a * n if zero_stage == 0 and d > 1 else 0.0   # engine.zero's own all-reduce copy
    # without a separate accumulation buffer the gradients are the parameters' own ``.grad``,
    # which DeepSpeed's ``zero_grad`` drops at the step: none until the first backward makes them
    return Footprint(w * n, a * n, state, bw, a * n, max(a * bucket, own, after - a * n),
                     gradients_from_first_backward=not separate)


def _zero2_footprint(n: float, big: float, d: int, w: int, a: int, state: float, after: float, bucket: float,
                     tensors: "float | ZeroTensors | None") -> Footprint:
    """ZeRO-2 (DeepSpeed 0.19, ``contiguous_gradients``, reduced at every backward): the reduce
    bucket in the weight dtype (gradients are copied into it, no flattened copy). With an fp32
    accumulation of 16-bit weights the partition accumulates in one fp32 buffer of the
    partition's size, and the bucket is flattened and cast to fp32 while it is reduced
    (``allreduce_bucket``). Otherwise (gradients
    kept in the weight dtype) each backward's first reduce allocates a new buffer of every
    parameter overlapping the partition, whole (:func:`zero_partition_overlap`), while the
    parameters' gradients still view the previous backward's: two exist from that reduce to the
    end of the backward, from the step's second backward on (``second_buffer``; the step's
    ``zero_grad`` frees the last one). Seen in experiments.memcheck's fp32 zero2 rows: two such
    buffers alive at the last rank's peak. A parameter larger than the bucket is reduced apart
    (``extra_large_param_to_reduce``): its gradient, its flattened copy and (16-bit weights)
    that copy's fp32 cast are alive through its reduce (``large_gradient``)."""
    part, after_share = n / d, min(1.0, bucket / max(n, 1.0))
    # a parameter larger than the bucket is reduced from its own gradient, flattened (a copy: it
    # straddles partitions) and, with 16-bit weights, cast to fp32, beside the bucket
    large = big if big > bucket else 0.0
    zt = tensors if tensors is None or isinstance(tensors, ZeroTensors) else ZeroTensors(float(tensors))
    lead = zt is not None and zt.lead_is_largest
    large_after = 1.0 if lead else after_share
    first = bool(large) and zt is not None and zt.large_first
    if a != w:
        # the bucket's slices flattened (a view where one tensor) and cast to fp32 while reduced,
        # beside the gradient whose hook started the reduce
        reduces = zt.reduces if zt is not None else ()
        # walked only where each reduce's freed activations are known (not on a recomputing rank)
        known = all(freed is not None for *_, freed in reduces)
        walked = tuple(((a if one else w + a) * e + w * trigger, freed)
                       for e, trigger, one, freed in reduces) if known else ()
        flat = max(b for b, _ in walked) if walked else (w + a) * bucket
        return Footprint(w * n, a * part, state, w * bucket + flat, 0.0, after,
                         reduce_temporary=flat, reduce_after=after_share, reduce_moments=walked, freed_at_step=True,
                         large_gradient=max(0.0, (2 * w + a) * large - flat) if large else 0.0,
                         large_reduce_after=large_after, large_reduced_first=first)
    held = min(n, zt.overlap if zt is not None else part)
    # the oversized tensor's flattened copy meets the new buffer unless it is reduced first
    flat_large = max(0.0, w * (large - held)) if first else w * large
    # the largest tensor's gradient: where it is the lead, alive only when the activations are freed
    own = w * big + flat_large if lead or large else 0.0
    trigger = w * min(big, zt.rest) if lead and zt.rest is not None else w * big
    return Footprint(w * n, w * held, state, w * bucket + w * held, 0.0, after,
                     reduce_temporary=w * held, reduce_after=after_share, second_buffer=w * held,
                     freed_at_step=True, reduce_gradient=trigger,
                     large_gradient=own, large_reduce_after=large_after, large_reduced_first=first,
                     unreached_gradients=4 * zt.unreached if zt is not None else 0.0)
