"""engine.footprint against closed forms: bytes per parameter of weights, gradients and
optimizer state, for every optimizer, ZeRO stage, precision and replica count."""
from __future__ import annotations

import itertools

import pytest

from engine.footprint import state_footprint

N = 1_000_000   # below every bucket cap

OPTIMIZERS = {"adamw": (8, 0.0), "adam": (8, 0.0), "sgd-momentum": (4, 0.9), "sgd": (0, 0.0)}
WEIGHT = {"fp32": 4, "bf16-autocast": 4, "fp16-autocast": 4, "bf16": 2, "fp16": 2}


def _closed_form(prec: str, state: int, zero: int, d: int, accum: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter, written out per case:

    * torch backend (fp32 weights, no ZeRO): 4 + 4 + state;
    * DeepSpeed (ZeRO 1/2, or 16-bit weights): weights w, the fp32 master partition and the
      moments sharded over the d replicas ((state + 4) / d, whole under ZeRO-0), gradients in
      the accumulation dtype, whole (ZeRO 0/1) or one partition (ZeRO-2)."""
    w = WEIGHT[prec]
    if w == 4 and zero == 0:
        return 4, 4, state
    a = 4 if w == 4 or accum == "fp32" else 2
    shard = d if zero > 0 else 1
    return w, a / (d if zero == 2 else 1), (state + 4) / shard


CASES = [(o, prec, z, d, acc) for o, prec, z, d, acc in itertools.product(
    OPTIMIZERS, WEIGHT, (0, 1, 2), (1, 2, 4), ("fp32", "bf16"))
    if not (acc == "bf16" and WEIGHT[prec] == 4) and not (prec == "fp16" and acc == "bf16")]


@pytest.mark.parametrize("opt,prec,zero,d,accum", CASES)
def test_bytes_per_parameter(opt, prec, zero, d, accum):
    state, momentum = OPTIMIZERS[opt]
    name = "sgd" if opt.startswith("sgd") else opt
    f = state_footprint(N, 1000, precision=prec, optimizer=name, momentum=momentum, zero_stage=zero,
                        data_parallel=d, grad_accum_dtype=accum)
    got = (f.parameters / N, f.gradients / N, f.optimizer_state / N)
    assert got == pytest.approx(_closed_form(prec, state, zero, d, accum))


def test_issue_figures():
    """Issue 16's target: bf16 AdamW ZeRO-1 over 2 replicas, 2 + 4 + 12 / 2 = 12 bytes (10 with
    bf16 accumulation); the old layout (bf16-autocast, fp32 weights) 4 + 4 + 12 / 2 = 14."""
    def total(prec, accum="fp32"):
        f = state_footprint(N, 0, precision=prec, optimizer="adamw", zero_stage=1, data_parallel=2,
                            grad_accum_dtype=accum)
        return (f.parameters + f.gradients + f.optimizer_state) / N
    assert (total("bf16"), total("bf16", "bf16"), total("bf16-autocast")) == (12, 10, 14)


def test_torch_backend_reduction_temporaries():
    """The torch backend's data-parallel reduction at the step: with the overlapped buckets
    (engine.overlap) every bucket's flat copy lives until the last is reduced (a whole gradient
    copy); without, one bucket of grad_bucket_mb (plus the tensor that overflows it); one
    replica reduces nothing."""
    n, big = 50_000_000, 1000
    overlap = state_footprint(n, big, data_parallel=2)
    plain = state_footprint(n, big, data_parallel=2, overlap_grad_reduce=False, grad_bucket_mb=10)
    alone = state_footprint(n, big, data_parallel=1)
    assert overlap.step_temporary == 4 * n
    assert plain.step_temporary == 10 * 2**20 + 4 * big
    assert alone.step_temporary == 0


class _Sized:
    """A stand-in tensor for DeepSpeed's partition bookkeeping (it reads ``numel()`` only)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n


@pytest.mark.parametrize("seed", range(4))
def test_zero_partition_overlap_is_deepspeeds_partition(seed):
    """zero_partition_overlap against DeepSpeed 0.19's own ``get_partition_info`` (the parameters
    its ZeRO-2 copies whole into ``grads_in_partition``), partitions cut as DeepSpeed cuts them:
    the flat group padded to a multiple of 2 x dp."""
    import random

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from engine.footprint import zero_partition_overlap

    rng = random.Random(seed)
    for _ in range(60):
        numels = [rng.choice([1, 3, 64, 128, 1000, 4096, 65536]) for _ in range(rng.randint(1, 12))]
        d = rng.randint(1, 8)
        total = sum(numels)
        part = -(-total // (2 * d)) * 2
        tensors = [_Sized(n) for n in numels]
        want = max(sum(t.numel() for t in DeepSpeedZeroOptimizer.get_partition_info(None, tensors, part, pid)[0])
                   for pid in range(d))
        assert zero_partition_overlap(numels, d) == want, (numels, d)


@pytest.mark.parametrize("seed", range(2))
def test_zero_tensors_zeros_are_deepspeeds_params_in_partition_of_the_other_chunks(seed):
    """zero_tensors' ``unreached``: the whole tensors DeepSpeed 0.19's ``get_partition_info``
    puts in a partition (``params_in_partition``, which ``get_all_grad_tensors`` fills with
    zeros where no gradient exists yet) from every chunk but the rank's last, the largest over
    the partitions; ``overlap`` is :func:`zero_partition_overlap`."""
    import random

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from engine.footprint import zero_partition_overlap, zero_tensors

    rng = random.Random(seed)
    for _ in range(60):
        chunks = [[rng.choice([1, 3, 64, 1000, 4096, 65536]) for _ in range(rng.randint(1, 5))]
                  for _ in range(rng.randint(1, 3))]
        numels = [n for c in chunks for n in c]
        d = rng.randint(1, 8)
        part = -(-sum(numels) // (2 * d)) * 2
        tensors = [_Sized(n) for n in numels]
        last = {id(t) for t in tensors[len(numels) - len(chunks[-1]):]}
        want = max(sum(t.numel() for t in DeepSpeedZeroOptimizer.get_partition_info(None, tensors, part, pid)[0]
                       if id(t) not in last) for pid in range(d))
        got = zero_tensors(chunks, d)
        assert got.unreached == want and got.overlap == zero_partition_overlap(numels, d), (chunks, d)


def test_zero_tensors_large_first_is_a_chunks_last_tensor_over_the_bucket():
    """A tensor larger than the reduce bucket (one partition) is reduced first by a backward
    when it is its chunk's last tensor (an LM head), last when it is its first (an embedding)."""
    from engine.footprint import zero_tensors

    head, emb = zero_tensors([[100, 10, 1000]], 2), zero_tensors([[1000, 10, 100]], 2)
    assert head.large_first and not head.lead_is_largest            # the head: last, over 555
    assert emb.lead_is_largest and not emb.large_first and emb.rest == 100   # the embedding: first
    none = zero_tensors([[200, 150, 150]], 2)                       # none over the bucket (250)
    assert none.large_first and none.lead_is_largest and none.rest == 150
    assert not zero_tensors([[1000, 10], [100]], 2).lead_is_largest  # two chunks: which one is freed is unknown


def test_zero2_reduce_holds_the_flattened_bucket_and_an_oversized_gradient():
    """DeepSpeed's ``allreduce_bucket`` flattens the bucket's slices (a copy) and, with 16-bit
    weights, casts that copy to fp32; a parameter larger than the bucket is reduced apart, from
    its own gradient, flattened and cast. With fp32 gradients the oversized tensor's copy meets
    the backward's new buffer unless it is the first tensor the backward reduces."""
    from engine.footprint import ZeroTensors

    bf16 = state_footprint(1000, 600, precision="bf16", zero_stage=2, data_parallel=2)
    assert bf16.reduce_temporary == (2 + 4) * 500                 # bucket 500: copy + cast
    assert bf16.backward_temporary == 2 * 500 + (2 + 4) * 500
    # the oversized 600: its gradient, copy and cast, beside the bucket (large_gradient is beyond
    # the bucket's own copy and cast)
    assert bf16.large_gradient + bf16.reduce_temporary == (2 + 2 + 4) * 600
    assert state_footprint(1000, 400, precision="bf16", zero_stage=2, data_parallel=2).large_gradient == 0.0
    first = state_footprint(1000, 600, zero_stage=2, data_parallel=2, zero_overlap=ZeroTensors(700, 0, True))
    later = state_footprint(1000, 600, zero_stage=2, data_parallel=2, zero_overlap=ZeroTensors(700, 0, False))
    assert first.large_gradient == 4 * 600                         # its gradient; the copy < the new buffer
    assert later.large_gradient == 4 * 600 + 4 * 600               # its gradient and its copy
    # an embedding (its chunk's first tensor) is reduced when the microbatch's activations are freed
    emb = state_footprint(1000, 600, zero_stage=2, data_parallel=2, zero_overlap=ZeroTensors(700, 0, False, True, 50))
    assert emb.large_reduce_after == 1.0 and later.large_reduce_after == emb.reduce_after == 0.5
    assert emb.reduce_gradient == 4 * 50            # another reduce is started by a smaller gradient
    # an embedding within the bucket: its gradient starts a reduce when the activations are freed
    small = state_footprint(1000, 400, zero_stage=2, data_parallel=2, zero_overlap=ZeroTensors(700, 0, True, True, 50))
    assert small.large_gradient == 4 * 400 and small.large_reduce_after == 1.0 and small.reduce_gradient == 4 * 50
    zeros = state_footprint(1000, 100, zero_stage=2, data_parallel=2, zero_overlap=ZeroTensors(700, 300, True))
    assert zeros.unreached_gradients == 4 * 300


def test_zero2_16bit_reduce_holds_its_largest_bucket_walked_not_a_full_one():
    """With 16-bit weights the transient of a reduce is what that reduce flattens (a copy of
    several tensors and its fp32 cast; one tensor within one partition is flattened as a view,
    so the cast alone) beside the gradient whose hook started it, each reduce of the rank's walk
    (:func:`engine.footprint.zero_reduces`) a moment with the activations freed by then; the
    largest is ``reduce_temporary``, not a full bucket's copy and cast."""
    from engine.footprint import ZeroTensors, zero_tensors

    whole = state_footprint(1000, 300, precision="bf16", zero_stage=2, data_parallel=2)
    assert whole.reduce_temporary == (2 + 4) * 500 and whole.reduce_moments == ()   # unknown: a full bucket
    walked = state_footprint(1000, 300, precision="bf16", zero_stage=2, data_parallel=2,
                             zero_overlap=ZeroTensors(700, reduces=((200.0, 300.0, False, 40.0), (300.0, 0.0, True, 90.0))))
    assert walked.reduce_moments == (((2 + 4) * 200 + 2 * 300, 40.0), (4 * 300, 90.0))
    assert walked.reduce_temporary == max((2 + 4) * 200 + 2 * 300, 4 * 300)
    assert walked.backward_temporary == 2 * 500 + walked.reduce_temporary   # the bucket is allocated whole
    blind = state_footprint(1000, 300, precision="bf16", zero_stage=2, data_parallel=2,
                            zero_overlap=ZeroTensors(700, reduces=((200.0, 300.0, False, None),)))
    assert blind.reduce_moments == () and blind.reduce_temporary == whole.reduce_temporary   # freed unknown
    # an oversized tensor's own reduce: its gradient, copy and cast in all, as before
    big = state_footprint(1000, 600, precision="bf16", zero_stage=2, data_parallel=2,
                          zero_overlap=zero_tensors([[600, 300, 100]], 2, freed=[([0.0, 0.0, 0.0], 0.0)]))
    assert big.large_gradient + big.reduce_temporary == (2 + 2 + 4) * 600
    assert big.reduce_temporary == (2 + 4) * 400 + 2 * 600   # 100 and 300, reduced when the 600's hook overflows
    # fp32 gradients keep their own model (no flattened copy)
    fp32 = state_footprint(1000, 300, zero_stage=2, data_parallel=2,
                           zero_overlap=ZeroTensors(700, reduces=((200.0, 300.0, False, None),)))
    assert fp32.reduce_temporary == 4 * 700 and fp32.reduce_moments == ()


def test_zero2_keeps_weight_dtype_gradients_of_whole_parameters():
    """ZeRO-2 with gradients in the weight dtype (fp32): the whole parameters overlapping the
    partition, and the next backward's buffer beside it; 16-bit weights with fp32 accumulation
    keep the compact fp32 partition and no second buffer."""
    fp32 = state_footprint(1000, 600, zero_stage=2, data_parallel=2, zero_overlap=700)
    assert fp32.gradients == 4 * 700 and fp32.second_buffer == 4 * 700 == fp32.reduce_temporary
    assert fp32.backward_temporary == 4 * 500 + 4 * 700           # the bucket (one partition) + the buffer
    unknown = state_footprint(1000, 600, zero_stage=2, data_parallel=2)
    assert unknown.gradients == 4 * 500                              # without tensor sizes: the partition
    bf16 = state_footprint(1000, 600, precision="bf16", zero_stage=2, data_parallel=2, zero_overlap=700)
    assert bf16.gradients == 4 * 500 and bf16.second_buffer == 0.0
