"""The measurement scripts run (tiny sizes: the figures themselves are taken on an idle machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PIPESHARD_FAULT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_checkpoint_stall_benchmark_tiny(tmp_path):
    out = tmp_path / "stall.json"
    _run("scripts/checkpoint_stall.py", "--tiny", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["checkpoint_bytes"] > 0
    for mode in ("sync", "async"):
        assert len(report[mode]["stall_per_checkpoint_s"]) == 2 == len(report[mode]["write_per_checkpoint_s"])
    assert report["none"]["stall_per_checkpoint_s"] == [] and report["none"]["iter_ratio_to_none"] == 1.0


@pytest.mark.slow
def test_failure_recovery_soak_tiny(tmp_path):
    out = tmp_path / "soak.json"
    proc = _run("scripts/soak.py", "--kills", "1", "--steps", "24", "--every", "3", "--layouts", "2x1",
                "--run-dir", str(tmp_path / "run"), "--json", str(out))
    report = json.loads(out.read_text())
    assert report["ok"] and report["exit"] == 0 and report["missing_steps"] == [], proc.stdout
    assert len(report["kills"]) == len(report["restarts"]) == 1
    assert "steps with a loss: 24 of 24" in proc.stdout
