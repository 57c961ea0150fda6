"""Checkpoint and resume through `python -m experiments.train` (issues 4 and 7).

Interrupted + resumed equals uninterrupted exactly (fp32, same split); a checkpoint written by
2 stages x 1 replica resumes as 3 stages, as 2 replicas and with 2 tensor-parallel ranks, and
one written with 2 tensor-parallel ranks as 2 replicas, with the same losses (rtol 1e-5);
SIGTERM during training stops after the current step, saves, exits 0, and the run resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[2]
# Pinned learning-rate schedule (decay over 6 steps whatever train.steps is) and a split that does
# not depend on timings, so every job below computes the same math.
BASE = ["experiment=smoke", "partitioner.method=uniform", "logger.progress=false", "logger.timeline=false",
        "optimizer.warmup_steps=2", "optimizer.decay_steps=6", "checkpoint.every_steps=2"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def train(run_dir: Path, *overrides: str, timeout: float = 120) -> str:
    proc = subprocess.run([sys.executable, "-m", "experiments.train", *BASE, *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 6-step run, and a run interrupted after 3 steps (checkpoints at 2 and 3)."""
    base = tmp_path_factory.mktemp("resume")
    full, part = base / "full", base / "part"
    train(full, "train.steps=6")
    train(part, "train.steps=3")
    return full, part


def _copy_interrupted(part: Path, dst: Path) -> Path:
    shutil.copytree(part, dst)
    return dst


@pytest.mark.slow
def test_interrupted_plus_resumed_equals_uninterrupted(runs, tmp_path):
    full, part = runs
    run_dir = _copy_interrupted(part, tmp_path / "run")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000002", "step_000003"]
    out = train(run_dir, "train.steps=6")
    assert "resuming from" in out and "step_000003" in out
    assert "reusing" in out  # same layout: the run's plan.json is reused, not re-profiled
    want, got = losses(full), losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # metrics.jsonl continues the interrupted run's
    assert [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]  # exactly (fp32)
    manifest = json.loads((run_dir / "checkpoints" / "step_000006" / "manifest.json").read_text())
    assert manifest["meta"]["step"] == 6 and manifest["meta"]["data_position"] == 6


@pytest.mark.slow
@pytest.mark.long   # in the default run: tp -> dp2 and tp1 -> tp2 below, other splits in tests/engine/test_checkpoint.py
@pytest.mark.parametrize("layout", [["pipeline.stages=3"], ["pipeline.data_parallel=2"]],
                         ids=["2-to-3-stages", "dp1-to-dp2"])
def test_resume_resplits_to_another_layout(runs, tmp_path, layout):
    full, part = runs
    run_dir = _copy_interrupted(part, tmp_path / "run")
    out = train(run_dir, "train.steps=6", *layout)
    assert "resuming from" in out and "reusing" not in out
    plan = json.loads((run_dir / "plan.json").read_text())
    assert (plan["num_stages"], plan["data_parallel"]) == ((3, 1) if "stages" in layout[0] else (2, 2))
    want, got = losses(full), losses(run_dir)
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-5)


@pytest.mark.slow
def test_tensor_parallel_trains_and_resumes_across_layouts(runs, tmp_path):
    """`pipeline.tensor_parallel=2` end to end (2 stages x 2 tp ranks, 4 processes): the same
    losses as the 2-stage run, its per-stage figures once per stage; its checkpoint (whole
    tensors) resumes as 2 replicas without tp, and the tp=1 checkpoint resumes with tp=2."""
    full, part = runs
    want = losses(full)
    tp_run = tmp_path / "tp"
    analytic = ("partitioner.profile=analytic", "partitioner.device_spec=h100")  # the plan is not under test
    train(tp_run, "train.steps=3", "pipeline.tensor_parallel=2", *analytic)
    got = losses(tp_run)
    assert [got[s] for s in (1, 2, 3)] == pytest.approx([want[s] for s in (1, 2, 3)], rel=1e-5)
    assert all(len(r["rank_forward_s"]) == 2 for r in read_metrics(tp_run))
    out = train(tp_run, "train.steps=6", "pipeline.data_parallel=2")
    assert "resuming from" in out and "step_000003" in out
    got = losses(tp_run)
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-5)
    run_dir = _copy_interrupted(part, tmp_path / "run")
    out = train(run_dir, "train.steps=6", "pipeline.tensor_parallel=2", *analytic)
    assert "resuming from" in out
    got = losses(run_dir)
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-5)


def test_a_checkpoint_of_another_model_is_refused_before_any_worker_starts(runs, tmp_path):
    _, part = runs
    run_dir = _copy_interrupted(part, tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "experiments.train", *BASE, "train.steps=4", "model.dim=48",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "for another model" in proc.stderr and "checkpoint.resume=false" in proc.stderr
    assert sorted(losses(run_dir)) == [1, 2, 3]  # nothing ran


@pytest.mark.slow
def test_sigterm_stops_cleanly_with_a_resumable_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.train", *BASE, "train.steps=100000", "checkpoint.every_steps=100000",
           "optimizer.decay_steps=null", "train.log_every=1000", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "stopped by a signal" in out
    last = max(losses(run_dir))
    ckpt = run_dir / "checkpoints" / f"step_{last:06d}"
    assert (ckpt / "manifest.json").is_file(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert json.loads((ckpt / "manifest.json").read_text())["meta"]["step"] == last

    out = train(run_dir, f"train.steps={last + 2}", "optimizer.decay_steps=null")
    assert f"resuming from {ckpt}" in out
    assert sorted(losses(run_dir))[-2:] == [last + 1, last + 2]
