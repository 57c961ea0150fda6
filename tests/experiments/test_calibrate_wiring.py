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
