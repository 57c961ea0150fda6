"""scripts/device_check.py runs (reduced): the held-out comparison with published figures.

It asserts the comparison runs and that the predictions are sane, never a tuned figure."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
device_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(device_check)


def test_zb_row_predicts_sane_throughputs():
    row = device_check.zb_row("1.5B", 24, "a100-kernels")
    assert all(math.isfinite(v) and v > 0 for v in row.values())
    assert row["zb1p"] > row["1f1b"]   # fewer bubbles, same work
    # no faster than the model's FLOPs at the A100's bf16 peak allow: 6 N s + attention per sample
    flops_per_sample = 6 * 1.5e9 * 1024
    assert row["1f1b"] * flops_per_sample < 312e12


def test_llama_row_reduced_runs_and_splits_the_step():
    r = device_check.llama_row("h100-kernels", layers=1, seq=1024)
    assert r["forward_s"] > 0 and r["backward_s"] > r["forward_s"] and 0 < r["recompute_s"] < r["forward_s"]
    assert r["step_s"] == pytest.approx(r["forward_s"] + r["backward_s"] + r["recompute_s"] + r["optimizer_s"]
                                        + r["fsdp_copies_s"])
    assert r["fsdp_copies_s"] > 0 and r["optimizer_s"] > 0


def test_zb_stage_row_splits_a_middle_stage_into_f_b_w():
    r = device_check.zb_stage_row("28.3B", "a100-kernels")
    assert all(math.isfinite(v) and v > 0 for v in r.values())
    # two blocks of 12 h^2 s FLOPs-per-token GEMMs: no faster than the A100's fp16 peak
    gemm = 2 * 24 * 1024 * 6144**2
    assert r["F"] * 1e-3 > gemm / 312e12 and r["W"] * 1e-3 > gemm / 312e12


def test_sac_recompute_follows_torchtitans_op_policy():
    ops = [("mm", 1.0), ("mm", 2.0), ("_scaled_dot_product_flash_attention", 4.0), ("mm", 8.0), ("mm", 16.0),
           ("mul", 0.5), ("_fused_rms_norm", 0.25)]
    assert device_check.sac_recompute(ops) == 2.0 + 16.0 + 0.5 + 0.25   # every second mm and the rest


def test_zb_vocabulary_reproduces_the_papers_parameter_counts():
    for size in device_check.ZB_MODELS:
        assert round(device_check.zb_params(size) / 1e9, 1) == float(size.rstrip("B"))
    assert round(device_check.zb_params("28.3B", vocab=device_check.ZB_GPT2_VOCAB) / 1e9, 1) != 28.3


def test_zb_floor_puts_the_papers_stage_times_through_its_bubble_rates():
    f1, fz = device_check.zb_floor("28.3B", 96)
    ideal = 96 * (10.419 + 10.207 + 7.715) * 1e-3
    assert f1 == pytest.approx(96 / (ideal / (1 - 0.2646) * 32))
    assert fz > f1
