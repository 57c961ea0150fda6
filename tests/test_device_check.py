"""scripts/device_check.py runs (reduced): the held-out comparison with published figures.

It asserts the comparison runs and that the predictions are sane, never a tuned figure."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

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
    assert r["step_s"] == r["forward_s"] + r["backward_s"] + r["recompute_s"] + r["optimizer_s"]
