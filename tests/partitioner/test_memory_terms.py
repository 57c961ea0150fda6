"""The memory model's buffers beyond saved activations, on plain numbers: the output a chunk
keeps per held microbatch, and the transfer buffers alive at a rank's peak (receives posted
ahead, gradients being received and sent, sends not yet waited)."""
from __future__ import annotations

import pytest

from engine.schedules import build_schedule
from partitioner import LayerCost, Profile, partition
from partitioner.memory import ChunkBytes, MemorySettings, kept_output_bytes, program_peaks, rank_breakdown


def _peaks(*args, **kw):
    """Each rank's largest peak over its moments (forward / backward, before / after its first
    weight gradients)."""
    return [max(peaks, key=lambda pk: pk.total) for peaks in program_peaks(*args, **kw)]


def test_kept_output_is_what_the_last_layer_did_not_save():
    assert kept_output_bytes(1000, 0, False) == 1000        # a residual add: nothing saved
    assert kept_output_bytes(1000, 1000, False) == 0        # a ReLU saved its own result
    assert kept_output_bytes(1000, 400, False) == 600
    assert kept_output_bytes(1000, 1000, True) == 1000      # recomputing: nothing saved but the input


def _two(held: float = 10.0, cut: float = 1.0) -> list[ChunkBytes]:
    return [ChunkBytes(held, 0.0, 0.0, cut), ChunkBytes(held, 0.0, cut, 0.0)]


def test_1f1b_waiting_each_send_holds_one_gradient_in_flight():
    # rank 0 peaks during its first backward: 2 held, the gradient received (1); rank 1 during
    # each backward: 1 held, the input gradient it makes (1)
    peaks = _peaks(build_schedule("1f1b", 2, 4), _two(), lookahead=0, send_wait="compute")
    assert [(pk.held, pk.communication, pk.total) for pk in peaks] == [((2,), 1.0, 21.0), ((1,), 1.0, 11.0)]


def test_sends_left_until_the_step_end_accumulate():
    # gpipe with sends waited only at the step's end: rank 1's input gradients all stay
    # referenced until then, so its last backward sees the three sent before it and its own
    sched = build_schedule("gpipe", 2, 4)
    waited = _peaks(sched, _two(held=0.0), lookahead=0, send_wait="compute")
    left = _peaks(sched, _two(held=0.0), lookahead=0, send_wait="step")
    assert waited[1].communication == 1.0 and left[1].communication == 4.0
    # rank 0, in its last backward: the outputs of the 3 microbatches its backward already freed
    # stay referenced by their sends, plus the gradient received for the one running (its own
    # output is still held by the chunk, counted in ``held``, not twice)
    assert waited[0].communication == 1.0 and left[0].communication == 3.0 + 1.0


def test_receives_posted_ahead_hold_their_buffers():
    sched = build_schedule("1f1b", 2, 4)
    none = _peaks(sched, _two(held=0.0), lookahead=0, send_wait="compute")
    two = _peaks(sched, _two(held=0.0), lookahead=2, send_wait="compute")
    # rank 1 receives activations: posted two ahead, two more buffers than received when needed
    assert two[1].communication == none[1].communication + 2.0


def test_bad_send_wait_is_refused():
    with pytest.raises(ValueError, match="send_wait"):
        program_peaks(build_schedule("1f1b", 2, 2), _two(), lookahead=0, send_wait="never")


def _layer(out: int, saved_out: int | None) -> LayerCost:
    return LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4_000, activation_bytes=50_000,
                     output_bytes=out, output_saved_bytes=saved_out)


def test_the_plan_books_the_kept_output_per_held_microbatch():
    """Two stages of 1f1b: rank 0 holds 2 microbatches; keeping its 8,000-byte output per held
    microbatch costs 2 x 8,000 more than a profile whose last layer saved it (as a ReLU does)."""
    kw = dict(microbatches=4, simulate=False)
    kept = partition(Profile([_layer(8_000, 0)] * 4), 2, **kw)
    saved = partition(Profile([_layer(8_000, 8_000)] * 4), 2, **kw)
    assert kept.stage_ranges == saved.stage_ranges == [(0, 2), (2, 4)]
    assert kept.stage_inflight[0] == 2
    d_kept, d_saved = kept.rank_memory_breakdown[0], saved.rank_memory_breakdown[0]
    assert d_kept["activations"] - d_saved["activations"] == 2 * 8_000
    # the last rank's output is the loss: nothing kept
    assert kept.rank_memory_breakdown[1]["activations"] == saved.rank_memory_breakdown[1]["activations"]


def test_gpipe_forward_phase_runs_before_gradients_exist():
    """The torch backend drops gradients between steps: up to its first backward a rank holds
    none, so gpipe's forward phase (every microbatch held) is a peak without them; and no
    backward transient exists inside a forward."""
    sched = build_schedule("gpipe", 2, 4)
    first = program_peaks(sched, _two(), lookahead=0, send_wait="compute")[0]
    assert first.forward_early.held == (4,) and first.backward.held == (3,)   # after the first backward
    torch_fp32 = MemorySettings("fp32", "adamw", zero_stage=0)
    kw = dict(numel=1000, largest=100, communication=0.0, workspace=500.0)
    fwd = rank_breakdown(torch_fp32, activations=40_000.0, in_backward=False, gradients_made=False, **kw)
    assert (fwd["gradients"], fwd["activations"], fwd["temporary"]) == (0, 40_000, 0)
    # the first backward takes each gradient as made (no accumulation transient): its workspace only
    first_bwd = rank_breakdown(torch_fp32, activations=40_000.0, gradients_made=False, **kw)
    assert (first_bwd["gradients"], first_bwd["temporary"]) == (0, 500)
    later = rank_breakdown(torch_fp32, activations=30_000.0, **kw)
    assert (later["gradients"], later["temporary"]) == (4_000, 400 + 500)   # 4 bytes x the largest, + workspace
    ds = MemorySettings("bf16", "adamw", zero_stage=1, data_parallel=2)   # DeepSpeed keeps its buffers
    assert rank_breakdown(ds, activations=40_000.0, in_backward=False, gradients_made=False, **kw)["gradients"] > 0


def test_a_split_backward_has_its_own_input_and_weight_moments():
    """zb-h1 runs F, I and W (no whole backward B): its peaks are read per kind, because I and W
    meet different transients. The last rank peaks with 2 held at a W (both pending, 2 x 10 +
    2 x 5) and at an I before its microbatch turns pending (2 x 10 + 1 x 5)."""
    chunks = [ChunkBytes(10.0, 5.0), ChunkBytes(10.0, 5.0)]
    peaks = program_peaks(build_schedule("zb-h1", 2, 4), chunks, lookahead=0, send_wait="compute")
    assert all({k for k, _, _ in pk.moments()} == {"F", "I", "W"} for pk in peaks)
    last = peaks[1]
    assert (last.weight.held, last.weight.pending, last.weight.total) == ((2,), (2,), 30.0)
    assert (last.input.held, last.input.pending, last.input.total) == ((2,), (1,), 25.0)
    assert last.backward.total == last.backward_early.total == -1.0   # no B action


def test_an_input_gradient_moment_makes_no_weight_gradient():
    """At a split backward's I the backend's gradient transients (DeepSpeed's 16-bit gradient
    copy, ZeRO-2's bucket and its fp32 cast) do not exist: only the layer's own transient (its
    workspace) is booked."""
    ds = MemorySettings("bf16", "adamw", zero_stage=2, data_parallel=2)
    kw = dict(numel=1000, largest=100, activations=1e6, communication=0.0, workspace=0.0,
              layer_transient=(300.0, 300.0))   # activations: the backward phase, not the step, is the peak
    at_i = rank_breakdown(ds, weight_grads=False, **kw)
    at_w = rank_breakdown(ds, **kw)
    assert at_i["temporary"] == 300.0
    assert at_w["temporary"] == 300.0 + ds.footprint(1000, 0).backward_temporary > 300.0


def _loss_profile(given: int | None, saved: int | None) -> Profile:
    body = LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4_000, activation_bytes=50_000,
                     output_bytes=8_000, output_saved_bytes=0)
    head = LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4_000, activation_bytes=50_000,
                     output_bytes=0, loss_input_bytes=given, loss_saved_bytes=saved)
    return Profile([body] * 3 + [head], meta={"loss": "lm_loss", "input_requires_grad": True})


def test_the_per_layer_cut_keeps_the_loss_input_and_frees_the_loss_at_i():
    """DeepSpeed's split backward cuts the graph per layer: the head's output (20,000 bytes, the
    logits) is kept per held microbatch as its segment's root and the loss's saved tensors
    (30,000 of the head's 50,000 activation bytes) are freed at I, so the last rank's activations
    are held x (2 x 50,000 + 20,000) - pending x 30,000, and its pending microbatches keep the
    logits' gradient (20,000) as temporary. The torch backend keeps the whole graph to W: the two
    figures change nothing there."""
    kw = dict(schedule="zb-h1", microbatches=4, simulate=False)
    ds = partition(_loss_profile(20_000, 30_000), 2, zero_stage=1, **kw)
    assert ds.stage_ranges == [(0, 2), (2, 4)]
    held, pend = ds.stage_inflight[1], ds.stage_pending[1]
    assert held == 2 and pend >= 1
    assert ds.rank_memory_breakdown[1]["activations"] == held * (2 * 50_000 + 20_000) - pend * 30_000
    assert ds.rank_memory_breakdown[1]["temporary"] >= pend * 20_000
    torch_kw = dict(kw, zero_stage=0)
    assert partition(_loss_profile(20_000, 30_000), 2, **torch_kw).rank_memory_breakdown == \
        partition(_loss_profile(None, None), 2, **torch_kw).rank_memory_breakdown


def test_a_first_layer_fed_token_ids_has_no_backward_workspace():
    """With token ids in, the first layer's backward makes its weight gradient only (an
    embedding): its unknown workspace is 0, not the 2 x output bytes estimated for other layers
    (an embedding-only rank 0 under zb-h2 was over-predicted by 18% against MemTracker)."""
    def prof(ws: int | None) -> Profile:
        first = LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=40_000, activation_bytes=100,
                          output_bytes=8_000, output_saved_bytes=0, workspace_bytes=ws)
        rest = LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4_000, activation_bytes=50_000,
                         output_bytes=8_000, output_saved_bytes=0)
        return Profile([first, rest, rest], meta={"input_requires_grad": False})

    kw = dict(schedule="zb-h2", microbatches=4, zero_stage=0, simulate=False, method="parameters")
    unknown, zero, estimate = (partition(prof(ws), 2, **kw) for ws in (None, 0, 16_000))
    assert unknown.stage_ranges == [(0, 1), (1, 3)]
    assert unknown.rank_memory_breakdown == zero.rank_memory_breakdown
    assert estimate.rank_memory_bytes[0] > unknown.rank_memory_bytes[0]


def test_zero2_second_buffer_only_after_the_first_backward():
    """The previous backward's gradient buffer exists from the step's second backward on: a
    rank's first backward holds one ZeRO-2 buffer, a later one two (at the reduce)."""
    from partitioner.memory import MemorySettings, rank_breakdown

    s = MemorySettings("fp32", "adamw", zero_stage=2, data_parallel=2)
    kw = dict(numel=1000.0, largest=100.0, activations=0.0, communication=0.0, workspace=0.0,
              microbatch_activations=1.0, zero_overlap=700.0)
    first = rank_breakdown(s, gradients_made=False, **kw)
    later = rank_breakdown(s, gradients_made=True, **kw)
    assert sum(later.values()) - sum(first.values()) == 4 * 700


def test_zero2_buffer_is_built_at_the_first_reduce():
    """DeepSpeed's ZeRO-2 frees its gradient buffer at the step and builds it at a backward's
    first reduce: a forward before the rank's first backward holds none, and neither does that
    backward before its reduce (when all its activations are still held); at the reduce the
    buffer meets the activations less the share the backward has freed."""
    from partitioner.memory import MemorySettings, rank_breakdown

    for precision in ("fp32", "bf16"):
        s = MemorySettings(precision, "adamw", zero_stage=2, data_parallel=2)
        f = s.footprint(1000, 100, 700)
        assert f.freed_at_step
        kw = dict(numel=1000.0, largest=100.0, activations=1e4, communication=0.0, workspace=0.0,
                  zero_overlap=700.0)
        forward = rank_breakdown(s, in_backward=False, gradients_made=False, **kw)
        assert forward["gradients"] == 0.0
        later = rank_breakdown(s, in_backward=False, gradients_made=True, **kw)
        assert later["gradients"] == f.gradients > 0
        first = rank_breakdown(s, gradients_made=False, microbatch_activations=2e3, **kw)
        # the moment before the reduce (all activations, no buffer) or at it (the buffer, 1/d of
        # one microbatch's activations freed): the larger
        share = f.reduce_after * 2e3
        before = sum(forward.values()) + f.backward_temporary - f.reduce_temporary
        at_reduce = (sum(forward.values()) + f.gradients + f.backward_temporary - f.second_buffer - share
                     + f.reduce_gradient)
        assert sum(first.values()) == max(before, at_reduce)


def test_zero1_fp32_gradients_are_made_by_the_first_backward():
    """fp32 ZeRO-1: the gradients are the parameters' own ``.grad``, which DeepSpeed's
    ``zero_grad`` drops at the step (as the torch backend does); a 16-bit ZeRO-1 with an fp32
    accumulation buffer or DeepSpeed's bf16 optimizer keeps its buffer."""
    from engine.footprint import state_footprint

    assert state_footprint(1000, 100, zero_stage=1, data_parallel=2).gradients_from_first_backward
    assert not state_footprint(1000, 100, precision="fp16", zero_stage=1, data_parallel=2).gradients_from_first_backward
    assert not state_footprint(1000, 100, precision="bf16", zero_stage=1, data_parallel=2).gradients_from_first_backward


def test_zero2_loss_backward_meets_no_bucket():
    """fp32 ZeRO-2 builds its bucket and buffers at the first gradient hook, after the loss's
    backward: the loss's workspace meets neither; the other layers' transients meet both. At a
    reduce the gradient of the parameter that started it is alive too."""
    from partitioner.memory import MemorySettings, loss_split, rank_breakdown

    s = MemorySettings("fp32", "adamw", zero_stage=2, data_parallel=2)
    f = s.footprint(1000, 100, 700)
    assert f.reduce_gradient == 4 * 100
    split = loss_split(s, [100.0, 100.0], [10.0, 5000.0], [0.0, 0.0], loss_at=1)
    kw = dict(numel=1000.0, largest=100.0, activations=0.0, communication=0.0, workspace=0.0,
              zero_overlap=700.0, gradients_made=True)
    whole = rank_breakdown(s, layer_transient=(5000.0, 5000.0), **kw)
    apart = rank_breakdown(s, layer_transient=(5000.0, 5000.0), loss_transient=split, **kw)
    rank_level = s.footprint(1000, 0, 700).backward_temporary
    assert whole["temporary"] == rank_level + 5000.0
    assert apart["temporary"] == max(rank_level + split[0][0], 5000.0) == 5000.0


def test_bf16_zero2_loss_backward_meets_no_bucket_either():
    """16-bit weights with fp32 accumulation: DeepSpeed allocates the 16-bit reduce bucket at a
    backward's first parameter hook (``setup_buckets``) and releases it at the backward's end
    (``_release_ipg_buffers``), so the loss's backward (no parameters) meets none of it; the fp32
    partition of the gradients is held throughout. MemTracker on the memcheck grid's 1f1b bf16
    v4096 ZeRO-2 last rank: the peak is the loss's backward, 4.0 MiB beside the fp32 partition
    (+5.4% -> +0.3%)."""
    from partitioner.memory import MemorySettings, loss_split, rank_breakdown

    s = MemorySettings("bf16", "adamw", zero_stage=2, data_parallel=2)
    f = s.footprint(1000, 100)
    assert f.second_buffer == 0 and f.freed_at_step and f.gradients == 4 * 500
    split = loss_split(s, [100.0, 100.0], [10.0, 5000.0], [0.0, 0.0], loss_at=1)
    kw = dict(numel=1000.0, largest=100.0, activations=1e4, communication=0.0, workspace=0.0,
              gradients_made=True, microbatch_activations=2e3)
    whole = rank_breakdown(s, layer_transient=(5000.0, 5000.0), **kw)
    apart = rank_breakdown(s, layer_transient=(5000.0, 5000.0), loss_transient=split, **kw)
    bucket = 2 * 500   # the 16-bit bucket: the partition's elements
    assert whole["temporary"] == bucket + 5000.0
    assert apart["temporary"] == 5000.0 and apart["gradients"] == f.gradients


def test_bf16_zero2_each_walked_reduce_meets_the_activations_freed_by_then():
    """16-bit ZeRO-2 with the rank's tensors known: each reduce of the walk is a moment of its
    own, its transient beside the bucket and the held activations less what its backward has
    freed by then (at most one microbatch's); the rank's peak is the largest of them, not the
    largest transient at the bucket's share. MemTracker on the memcheck grid's bf16 ZeRO-2 first
    ranks: the embedding's hook starts a reduce of a partial bucket when its chunk's activations
    are gone (interleaved-1f1b +5.9% -> +0.0%, one-chunk ranks +2.9..3.9% -> -0.5..+0.2%)."""
    from engine.footprint import ZeroTensors
    from partitioner.memory import MemorySettings, rank_breakdown

    s = MemorySettings("bf16", "adamw", zero_stage=2, data_parallel=2)
    early, late = (200.0, 0.0, False, 100.0), (300.0, 500.0, False, 1500.0)   # (elements, trigger, one, freed)
    kw = dict(numel=1000.0, largest=500.0, activations=1e4, communication=0.0, workspace=0.0, gradients_made=True,
              microbatch_activations=2e3, layer_transient=(0.0, 0.0))
    peak = {}
    for name, reduces in (("early", (early,)), ("late", (late,)), ("both", (early, late))):
        peak[name] = rank_breakdown(s, zero_overlap=ZeroTensors(700.0, reduces=reduces), **kw)
        assert peak[name]["temporary"] >= 2 * 500   # the bucket, allocated whole
    assert peak["early"]["activations"] == 1e4 - 100.0 and peak["late"]["activations"] == 1e4 - 1500.0
    assert peak["late"]["temporary"] - peak["early"]["temporary"] == (6 * 300 + 2 * 500) - 6 * 200
    both = sum(peak["both"].values())
    assert both == max(sum(peak["early"].values()), sum(peak["late"].values())) == sum(peak["late"].values())
    # the larger transient at the bucket's share (0.5 of the microbatch) would book more than either moment
    share = s.footprint(1000.0, 500.0).reduce_after
    assert both < sum(peak["late"].values()) + 1500.0 - share * 2e3
    # unknown freed bytes (a recomputing rank): not walked, one full bucket at the bucket's share
    blind = rank_breakdown(s, zero_overlap=ZeroTensors(700.0, reduces=((200.0, 0.0, False, None),)), **kw)
    assert blind == rank_breakdown(s, zero_overlap=ZeroTensors(700.0), **kw)
    assert blind["activations"] == 1e4 - share * 2e3 and blind["temporary"] == 2 * 500 + (2 + 4) * 500


def test_zero2_loss_backward_meets_the_previous_buffer():
    """From a rank's second backward on, fp32 ZeRO-2's previous gradient buffer (the parameters'
    gradients view it) is alive while the loss back-propagates: the loss's own transient meets
    it, whole, beside all of the microbatch's activations (the moment before the first reduce
    does not lose the next buffer it never held)."""
    from partitioner.memory import MemorySettings, loss_split, rank_breakdown

    s = MemorySettings("fp32", "adamw", zero_stage=2, data_parallel=2)
    f = s.footprint(1000, 100, 700)
    split = loss_split(s, [100.0, 100.0], [10.0, 5000.0], [0.0, 0.0], loss_at=1)
    d = rank_breakdown(s, numel=1000.0, largest=100.0, activations=1e4, communication=0.0, workspace=0.0,
                       zero_overlap=700.0, gradients_made=True, microbatch_activations=2e3,
                       layer_transient=(5000.0, 5000.0), loss_transient=split)
    assert d["gradients"] == f.gradients == 4 * 700
    assert sum(d.values()) >= f.parameters + f.gradients + f.optimizer_state + 1e4 + 5000.0


def test_zero2_zeros_of_chunks_not_yet_reached_are_held_after_the_first_backward():
    """fp32 ZeRO-2 on a rank of several chunks: the first backward's epilogue holds fp32 zeros
    for the partition's tensors of the chunks not yet back-propagated, until the step."""
    from engine.footprint import ZeroTensors
    from partitioner.memory import MemorySettings, rank_breakdown

    s = MemorySettings("fp32", "adamw", zero_stage=2, data_parallel=2)
    kw = dict(numel=1000.0, largest=100.0, activations=1e5, communication=0.0, workspace=0.0,
              in_backward=False)   # a forward's moment, above the step's
    zt, none = ZeroTensors(700.0, 300.0, True), ZeroTensors(700.0, 0.0, True)
    assert (rank_breakdown(s, gradients_made=True, zero_overlap=zt, **kw)["gradients"]
            - rank_breakdown(s, gradients_made=True, zero_overlap=none, **kw)["gradients"]) == 4 * 300
    assert rank_breakdown(s, gradients_made=False, zero_overlap=zt, **kw)["gradients"] == 0.0


def test_zero2_oversized_tensor_reduce_meets_the_activations_its_position_leaves():
    """A tensor larger than the ZeRO-2 bucket is reduced apart, with its gradient and flattened
    copy: an embedding (the first tensor of a rank's one chunk) at the end of its backward, when
    the microbatch's activations are freed; a head (its chunk's last) first, which under a split
    backward's W is before any of them are freed, and under a full backward after the bucket's
    share."""
    from engine.footprint import ZeroTensors
    from partitioner.memory import MemorySettings, rank_breakdown

    s = MemorySettings("fp32", "adamw", zero_stage=2, data_parallel=2)
    kw = dict(numel=1000.0, largest=600.0, activations=1e4, communication=0.0, workspace=0.0,
              microbatch_activations=4e3, gradients_made=True, layer_transient=(0.0, 0.0))
    emb, head = ZeroTensors(700.0, 0.0, False, True, 100.0), ZeroTensors(700.0, 0.0, True, False)
    assert s.footprint(1000, 600, emb).large_gradient > 0
    at_emb = rank_breakdown(s, zero_overlap=emb, **kw)
    at_head_b = rank_breakdown(s, zero_overlap=head, **kw)
    at_head_w = rank_breakdown(s, zero_overlap=head, split_weight=True, **kw)
    f = s.footprint(1000, 600, head)
    assert at_head_w["activations"] == 1e4                       # W: nothing freed yet
    assert at_head_b["activations"] == 1e4 - f.reduce_after * 4e3  # B: the bucket's share
    assert sum(at_head_w.values()) > sum(at_head_b.values())
    assert at_emb["activations"] == 1e4 - 4e3                      # the embedding: all freed
    # its flattened copy meets the backward's new buffer (it is not the first reduced)
    assert at_emb["temporary"] == at_head_b["temporary"] + 4 * 600 - max(0.0, 4 * (600 - 700))


def test_a_rank_of_two_chunks_books_each_chunks_gradients_from_its_own_first_backward():
    """dualpipev's rank 0 runs the last chunk's first backward (3B0 / 3W0) long before chunk 0's
    (0B0): in between, chunk 0 holds all four microbatches but has no gradients yet. The walk
    books the gradients of the chunks not yet back-propagated as ``unmade`` and picks each
    moment with them: the peak after the first weight gradients is the backward where every
    gradient exists and one microbatch less is held (measured so by MemTracker: +5.2% -> +0.4%
    on the memcheck grid's dualpipev fp32 v4096 rank 0)."""
    sched = build_schedule("dualpipev", 2, 4, 2)
    assert [str(a) for a in sched.actions[0][:9]] == ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "0F3", "3B1"]
    held, grads = [2.0, 1.0, 1.0, 4.0], [3.0, 1.0, 1.0, 2.0]
    chunks = [ChunkBytes(h, 0.0, 0.0, 0.0, g) for h, g in zip(held, grads)]
    rank0 = program_peaks(sched, chunks, lookahead=0, send_wait="compute")[0]
    # 3B1 holds (4, 1) with chunk 0's gradients unmade (12 - 3 = 9); 3B2 holds (3, 1), all made (10)
    assert (rank0.backward.held, rank0.backward.unmade) == ((3, 1), 0.0)
    assert rank0.backward.total == 3 * 2.0 + 4.0
    without = program_peaks(sched, [ChunkBytes(h) for h in held], lookahead=0, send_wait="compute")[0]
    assert (without.backward.held, without.backward.unmade) == ((4, 1), 0.0)   # gradients booked whole
    plain = MemorySettings("fp32", "adamw", zero_stage=0)
    kw = dict(numel=1000, largest=100, communication=0.0, workspace=0.0, activations=1e6)   # not the step's
    made = rank_breakdown(plain, **kw)
    assert made["gradients"] - rank_breakdown(plain, unmade_gradients=1200.0, **kw)["gradients"] == 1200.0
