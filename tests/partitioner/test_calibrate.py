"""partitioner.calibrate: the fit recovers known constants, calibration runs here, the cache round-trips."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from partitioner.calibrate import (QUICK_SET, cache_path, calibrate, calibrated_spec, device_name, fit_kernel_model,
                                   load_calibrated, save_calibrated, synthetic_timings)
from partitioner.kernels import KERNEL_PRESETS, KernelModel


@pytest.mark.parametrize("true", [
    KERNEL_PRESETS["a100"],
    KernelModel(units=132, gemm_efficiency=0.62, gemm_k0=320.0, attn_fwd=0.41, attn_bwd=0.29, attn_s0=640.0,
                bandwidth=0.71, launch_s=7e-6),
])
def test_fit_recovers_the_constants_of_synthetic_timings(true):
    fit = fit_kernel_model(synthetic_timings(true, 989e12, 3.35e12), 989e12, 3.35e12, units=true.units)
    assert fit.gemm_efficiency == pytest.approx(true.gemm_efficiency, rel=1e-6)
    assert fit.gemm_k0 == true.gemm_k0 and fit.attn_s0 == true.attn_s0
    assert fit.attn_fwd == pytest.approx(true.attn_fwd, rel=1e-6)
    assert fit.attn_bwd == pytest.approx(true.attn_bwd, rel=1e-6)
    assert fit.bandwidth == pytest.approx(true.bandwidth, rel=1e-6)
    assert fit.launch_s == pytest.approx(true.launch_s)


def test_fit_is_not_fooled_by_noise_free_but_different_k0():
    a = synthetic_timings(dataclasses.replace(KERNEL_PRESETS["a100"], gemm_k0=0.0), 312e12, 2e12)
    b = synthetic_timings(dataclasses.replace(KERNEL_PRESETS["a100"], gemm_k0=512.0), 312e12, 2e12)
    assert fit_kernel_model(a, 312e12, 2e12, units=108).gemm_k0 == 0.0
    assert fit_kernel_model(b, 312e12, 2e12, units=108).gemm_k0 == 512.0


def test_calibrate_on_this_cpu_and_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESHARD_CACHE", str(tmp_path))
    spec = calibrate("cpu", quick=True, reps=2)
    k = spec.kernels
    assert k is not None and 0 < k.gemm_efficiency <= 1 and 0 < k.bandwidth <= 1 and k.launch_s < 1e-2
    assert spec.peak_flops["float32"] > 1e8 and spec.memory_bandwidth > 1e8
    path = cache_path(device_name("cpu"))
    assert path.exists() and str(path).startswith(str(tmp_path))
    assert load_calibrated(device_name("cpu")) == spec
    assert calibrated_spec(None) == spec   # the cached one: no second timing
    save_calibrated(spec, "renamed")
    assert load_calibrated("renamed") == spec and load_calibrated("nothing-here") is None


def test_calibrated_spec_for_an_absent_gpu_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESHARD_CACHE", str(tmp_path))
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: it would calibrate it")
    with pytest.raises(ValueError, match="python -m partitioner.calibrate"):
        calibrated_spec("h100")


def test_quick_set_is_small():
    assert len(QUICK_SET["gemm"]) <= 4 and max(m for _, m, _, _ in QUICK_SET["gemm"]) <= 256
