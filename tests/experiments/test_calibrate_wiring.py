"""`partitioner.calibrate=true` gives the analytic profile the calibrated device model (cached)."""

from __future__ import annotations

import pytest

from experiments.config import compose_config
from experiments.wiring import profile_kwargs


def test_calibrate_true_uses_the_cached_calibration_of_this_cpu(tmp_path, monkeypatch):
    from partitioner.calibrate import calibrate

    monkeypatch.setenv("PIPESHARD_CACHE", str(tmp_path))
    spec = calibrate("cpu", quick=True, reps=2)
    base = ("experiment=smoke", "partitioner.profile=analytic")
    assert profile_kwargs(compose_config(*base))["device_spec"] is None         # default: off
    kw = profile_kwargs(compose_config(*base, "partitioner.calibrate=true"))
    assert kw["device_spec"] == spec and kw["device_spec"].kernels is not None


def test_calibrate_true_for_a_gpu_preset_without_gpu_or_cache_fails_clearly(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("PIPESHARD_CACHE", str(tmp_path))
    cfg = compose_config("experiment=smoke", "partitioner.profile=analytic", "partitioner.device_spec=a100",
                         "partitioner.calibrate=true")
    with pytest.raises(ValueError, match="partitioner.calibrate=false"):
        profile_kwargs(cfg)


def test_cpu_plan_charges_tp_all_reduces_on_the_measured_gloo_links(tmp_path, monkeypatch):
    """A CPU run with measured layers and fixed costs plans its tensor-parallel all-reduces on
    this machine's gloo collectives (`engine.overhead.measure_collectives`, read from its cache;
    the busy fit when the job's ranks outnumber the cores): the links reach the planner, and each
    block's forward and backward grow by two all-reduces."""
    import json

    from engine.overhead import cache_path
    from experiments.wiring import device_links, partition_kwargs
    from partitioner import LayerCost, Profile, partition

    def points(lat, rate):   # all-reduces over 2 ranks: latency + bytes / rate
        return [["all_reduce", 2, b, lat + b / rate] for b in (4096, 1 << 20)]

    monkeypatch.setenv("PIPESHARD_CACHE_DIR", str(tmp_path))
    cache_path("collectives").write_text(json.dumps({"points": points(4e-4, 5e8), "busy_points": points(3e-3, 2e8)}))
    base = ("experiment=smoke", "partitioner.profile=measure", "pipeline.schedule=1f1b")
    monkeypatch.setattr("experiments.wiring.available_cores", lambda: 4)   # 2 stages x tp 2: a core each
    links = device_links(compose_config(*base, "pipeline.tensor_parallel=2"))
    assert links.intra_latency_s == pytest.approx(4e-4) and links.intra_bytes_per_s == pytest.approx(5e8)
    monkeypatch.setattr("experiments.wiring.available_cores", lambda: 2)   # 4 ranks on 2 cores: the busy fit
    busy = device_links(compose_config(*base, "pipeline.tensor_parallel=2"))
    assert busy.intra_latency_s == pytest.approx(3e-3) and busy.intra_bytes_per_s == pytest.approx(2e8)
    monkeypatch.setattr("experiments.wiring.available_cores", lambda: 4)
    assert device_links(compose_config(*base)) is None                                   # one rank per stage
    assert device_links(compose_config(*base, "pipeline.tensor_parallel=2", "partitioner.fixed_costs=false")) is None
    kw = partition_kwargs(compose_config(*base, "pipeline.tensor_parallel=2"))
    assert kw["links"] == links
    out = 1 << 20
    prof = Profile([LayerCost(1e-3, 2e-3, 4 * out, out, out, workspace_bytes=0)] * 4, meta={"tensor_parallel": 2})
    with_links = partition(prof, 2, microbatches=4, tensor_parallel=2, links=kw["links"], simulate=False)
    free = partition(prof, 2, microbatches=4, tensor_parallel=2, links=None, simulate=False)
    ar = 4e-4 + out / 5e8                    # one all-reduce over 2 ranks: latency + 2 (1/2) bytes / rate
    assert with_links.stage_forward_s[0] - free.stage_forward_s[0] == pytest.approx(3 * ar, rel=1e-6)    # embedding 1 + block 2
    assert with_links.stage_backward_s[1] - free.stage_backward_s[1] == pytest.approx(3 * ar, rel=1e-6)  # block 2 + head 1
