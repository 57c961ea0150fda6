"""engine.caches: the last-level cache read from sysfs, the evictor, and a profile that times
cold exactly when asked (the evictor called before every timed phase), hot by default."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

from engine.caches import CacheEvictor, check_caches, last_level_cache_bytes
from partitioner import LayerCost, Profile, partition, profile, search

profile_mod = importlib.import_module("partitioner.profile")


def _cache_dir(root, index: int, level: int, kind: str, size: str) -> None:
    d = root / f"index{index}"
    d.mkdir()
    (d / "level").write_text(f"{level}\n")
    (d / "type").write_text(f"{kind}\n")
    (d / "size").write_text(f"{size}\n")


def test_the_last_level_cache_is_the_highest_unified_or_data_level(tmp_path):
    _cache_dir(tmp_path, 0, 1, "Data", "48K")
    _cache_dir(tmp_path, 1, 1, "Instruction", "32K")
    _cache_dir(tmp_path, 2, 2, "Unified", "2048K")
    _cache_dir(tmp_path, 3, 3, "Unified", "32768K")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_an_unreadable_cache_size_gives_none(tmp_path):
    _cache_dir(tmp_path, 0, 3, "Unified", "lots")
    assert last_level_cache_bytes(tmp_path) is None


def test_an_unknown_mode_is_refused_with_the_choices():
    assert check_caches("hot") == "hot"
    with pytest.raises(ValueError, match="hot, cold"):
        check_caches("auto")
    with pytest.raises(ValueError, match="hot, cold"):
        profile([lambda: nn.Linear(4, 4)], torch.randn(2, 4), caches="warm")


def test_cold_is_refused_off_the_cpu_with_the_remedy():
    with pytest.raises(ValueError, match="partitioner.caches=hot"):
        profile([lambda: nn.Linear(4, 4)], torch.randn(2, 4), device="cuda", caches="cold")


def test_the_evictor_reads_twice_the_cache_at_most_512_mib():
    ev = CacheEvictor(1 << 16)
    ev()
    assert ev.buffer.numel() * 4 == 2 << 16 and bool((ev.buffer == 1).all())
    assert CacheEvictor(1 << 30).buffer.numel() * 4 == 512 << 20


class _Counting:
    calls = 0

    def __init__(self, cache_bytes: int | None = None) -> None:
        _Counting.calls = 0

    def __call__(self) -> None:
        _Counting.calls += 1


def _layers():
    return [lambda: nn.Linear(16, 16), lambda: nn.ReLU(), lambda: nn.Linear(16, 8)]


@pytest.mark.parametrize("caches", ["hot", "cold", None])
def test_cold_evicts_before_every_timed_phase_and_hot_never(monkeypatch, caches):
    monkeypatch.setattr(profile_mod, "CacheEvictor", _Counting)
    _Counting.calls = 0
    kw = {} if caches is None else {"caches": caches}
    prof = profile(_layers(), torch.randn(4, 16), repeats=2, warmup=1, min_time_s=0.0, **kw)
    assert prof.meta["caches"] == (caches or "hot")
    # cold: each of 3 runs (1 warm-up + 2 timed) of each layer evicts before F and B, and before
    # I and W on the one layer with both gradients
    assert _Counting.calls == (3 * 3 * 2 + 3 * 2 if caches == "cold" else 0)


def test_the_plan_and_the_search_say_when_the_layers_were_timed_cold():
    layers = [LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=1024, activation_bytes=256, output_bytes=64)] * 4
    cold = Profile(layers, meta={"mode": "measure", "caches": "cold"})
    plan = partition(cold, 2, schedule="1f1b", microbatches=4)
    assert any(n.startswith("layer times measured with cold caches") for n in plan.notes)
    assert "(measure, cold caches)" in search(lambda size: cold, 2, 8, schedules=["1f1b"]).chosen.profile
    hot = Profile(layers, meta={"mode": "measure", "caches": "hot"})
    assert not any("caches" in n for n in partition(hot, 2, schedule="1f1b", microbatches=4).notes)
    assert search(lambda size: hot, 2, 8, schedules=["1f1b"]).chosen.profile == "profiled at 4 (measure)"
