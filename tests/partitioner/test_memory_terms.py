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
