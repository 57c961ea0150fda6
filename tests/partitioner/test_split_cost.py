"""Issue 10: a split backward (zero-bubble I and W) costs more than the whole backward; the
profile measures it on the engine's own split and split-backward plans are charged it."""
from __future__ import annotations

import importlib
import json

import pytest
import torch
import torch.nn as nn

from partitioner import LayerCost, Profile, partition, profile

profile_mod = importlib.import_module("partitioner.profile")   # the module, not the function


def _layer(i: float | None = 1.5e-3, w: float = 1.5e-3) -> LayerCost:
    return LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4_000, activation_bytes=10_000,
                     output_bytes=1_000, weight_grad_s=w, input_grad_s=i)


def test_split_cost_round_trips_and_old_profiles_cost_the_whole_backward():
    prof = Profile([_layer(), _layer(None, 0.5e-3)])
    assert Profile.from_json(prof.to_json()) == prof
    assert prof.layers[0].split_backward_s == pytest.approx(3e-3)     # I + W > B: measured
    assert prof.layers[1].input_s == pytest.approx(1.5e-3)            # unknown: B - W
    assert prof.layers[1].split_backward_s == pytest.approx(2e-3)
    old = json.loads(prof.to_json())
    for row in old["layers"]:
        del row["input_grad_s"]   # a profile written before the field existed
    back = Profile.from_json(json.dumps(old))
    assert back.layers[0].split_backward_s == pytest.approx(2e-3)
    # W may exceed the whole backward only when the split's I is given too
    assert _layer(1e-3, 2.5e-3).split_backward_s == pytest.approx(3.5e-3)
    with pytest.raises(ValueError, match="input_grad_s"):
        _layer(None, 2.5e-3)
    with pytest.raises(ValueError, match="input_grad_s"):
        LayerCost(1e-3, 2e-3, 0, 0, 0, input_grad_s=1e-3)   # I without W


def test_the_profile_times_the_engines_split(monkeypatch):
    calls = []

    def fake(chunk, x, grads, dev, *_):   # (kept_bytes, clock)
        from engine.stage import Chunk

        assert isinstance(chunk, Chunk)   # the engine's own split path, not a copy of it
        calls.append(chunk)
        return 7e-3, 5e-3, 123

    monkeypatch.setattr(profile_mod, "_time_split", fake)
    layers = [lambda: nn.Linear(16, 16), lambda: nn.ReLU(), lambda: nn.Linear(16, 8)]
    prof = profile(layers, torch.randn(4, 16), repeats=2, warmup=1, min_time_s=0.0)
    first, relu, last = prof.layers
    assert (first.input_grad_s, first.weight_grad_s) == (None, first.backward_s)  # no input grad
    assert relu.input_grad_s is None and relu.weight_grad_s == 0.0               # no weights
    assert (last.input_grad_s, last.weight_grad_s, last.pending_grad_bytes) == (7e-3, 5e-3, 123)
    assert len(calls) == 3    # one per repeat and warm-up, of the one layer with both gradients
    # a fast layer runs until min_time_s is timed: here 12 ms of split per run -> at most 9 runs
    calls.clear()
    profile(layers, torch.randn(4, 16), repeats=2, warmup=1, min_time_s=0.1)
    assert 1 + 5 <= len(calls) <= 1 + 9


def test_a_measured_split_is_timed_and_keeps_what_the_engine_keeps():
    torch.manual_seed(0)
    layers = [lambda: nn.Linear(64, 64), lambda: nn.Sequential(nn.Linear(64, 128), nn.GELU(),
                                                               nn.Linear(128, 64))]
    prof = profile(layers, torch.randn(8, 64), repeats=2, warmup=1)
    blk = prof.layers[1]
    assert blk.input_grad_s > 0 and blk.weight_grad_s > 0
    # the two Linear nodes of the block keep their output gradients from I to W
    assert blk.pending_grad_bytes == 8 * (128 + 64) * 4


def _plan(prof: Profile, schedule: str, **kw):
    return partition(prof, 2, schedule=schedule, microbatches=4, optimizer="sgd", zero_stage=0, **kw)


def test_split_backward_schedules_pay_the_split_and_others_do_not():
    split = Profile([_layer(1.5e-3, 1.5e-3)] * 6)     # I + W = 1.5 x the whole backward
    whole = Profile([_layer(None, 1.5e-3)] * 6)       # the same layers, the split priced at B
    one = _plan(split, "1f1b")
    assert one.stage_backward_s == pytest.approx([6e-3, 6e-3])
    assert one.step_s == pytest.approx(_plan(whole, "1f1b").step_s)
    zb = _plan(split, "zb-h1")
    assert zb.stage_backward_s == pytest.approx([9e-3, 9e-3])
    assert zb.stage_weight_s == pytest.approx([4.5e-3, 4.5e-3])
    assert zb.step_s > _plan(whole, "zb-h1").step_s * 1.2
    assert any("split backward (I + W) costs 1.500x" in n for n in zb.notes)


def test_a_recomputing_chunk_and_a_first_chunk_without_input_gradient_do_not_split():
    prof = Profile([_layer(1.5e-3, 1.5e-3)] * 6)
    ck = _plan(prof, "zb-h1", activation_checkpointing=True)
    # the checkpointed chunk's I is one whole backward after the recompute; its W is empty
    assert ck.stage_backward_s == pytest.approx([6e-3 + 3e-3] * 2)
    assert ck.stage_weight_s == [0.0, 0.0]
    ids = Profile(prof.layers, meta={"input_requires_grad": False})
    lm = _plan(ids, "zb-h1")
    # token ids in: chunk 0 defers its whole, unsplit backward to W; chunk 1 splits
    (_, a), (_, n) = lm.stage_ranges
    assert lm.stage_backward_s == pytest.approx([a * 2e-3, (n - a) * 3e-3])
    assert lm.stage_weight_s == pytest.approx([a * 2e-3, (n - a) * 1.5e-3])


def test_sweeps_keep_the_median_of_each_time(monkeypatch):
    # three sweeps of a two-layer model: the middle value of each time survives, bytes are kept
    real = profile_mod._time_layer
    seq = iter([1.0, 9.0, 2.0])

    def scaled(*args, **kw):
        f, b, split, pending = real(*args, **kw)
        k = next(seq) if args[0].__class__ is nn.Linear and args[0].out_features == 8 else 1.0
        return f * k, b * k, None if split is None else (split[0] * k, split[1] * k), pending

    monkeypatch.setattr(profile_mod, "_time_layer", scaled)
    layers = [lambda: nn.Linear(16, 16), lambda: nn.Linear(16, 8)]
    runs = []
    real_median = profile_mod._median_profile
    monkeypatch.setattr(profile_mod, "_median_profile", lambda rs: runs.extend(rs) or real_median(rs))
    prof = profile(layers, torch.randn(4, 16), repeats=1, warmup=0, min_time_s=0.0, sweeps=3)
    lasts = [r.layers[1] for r in runs]
    order = sorted(range(3), key=lambda i: lasts[i].backward_s)
    assert prof.layers[1].backward_s == lasts[order[1]].backward_s   # the median sweep's
    assert prof.layers[1].input_grad_s == sorted(c.input_grad_s for c in lasts)[1]
    assert prof.layers[1].activation_bytes == lasts[0].activation_bytes
    assert prof.meta["sweeps"] == 3
    with pytest.raises(ValueError, match="sweeps"):
        profile(layers, torch.randn(4, 16), sweeps=0)
