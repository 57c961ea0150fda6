"""Automatic restart through `python -m experiments.train train.max_restarts=N`: rank 1 is killed
(SIGKILL) before step 5, and again while it writes checkpoint 6; the job restarts by itself
twice, skips the torn checkpoint with a message naming it, finishes every step, logs the
restarts to the console, metrics.jsonl and the same W&B run, and ends where an uninterrupted
run ends (SGD, fp32: losses and parameters to 1e-6). The same under `torchrun --max-restarts`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoint import load_checkpoint
from experiments.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[2]
BASE = ["experiment=smoke", "optimizer=sgd", "partitioner.method=uniform", "logger.progress=false",
        "logger.timeline=false", "train.steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=3"]


def _train(run_dir: Path, *overrides: str, fault: str | None = None,
           launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PIPESHARD_FAULT"):
        env.pop(key, None)
    if fault:
        env["PIPESHARD_FAULT"] = fault
    proc = subprocess.run([sys.executable, *launcher, "-m", "experiments.train", *BASE, *overrides,
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """The uninterrupted run's directory."""
    run_dir = tmp_path_factory.mktemp("restart") / "full"
    _train(run_dir, "logger.mode=disabled")
    return run_dir


def _assert_equal_runs(full: Path, killed: Path) -> None:
    """Same loss at every step (the later record of a re-run step wins) and same final weights."""
    want = {r["step"]: r["loss"] for r in read_metrics(full)}
    got = {r["step"]: r["loss"] for r in read_metrics(killed)}
    assert sorted(got) == list(range(1, 9)) == sorted(want)
    for s in want:
        assert got[s] == pytest.approx(want[s], abs=1e-6, rel=0), s
    a = load_checkpoint(full / "checkpoints" / "step_000008", range(4), num_layers=4)
    b = load_checkpoint(killed / "checkpoints" / "step_000008", range(4), num_layers=4)
    for i, params in a.layers.items():
        for k, v in params.items():
            torch.testing.assert_close(b.layers[i][k], v, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_twice_restarts_skips_the_torn_checkpoint_and_equals_uninterrupted(tmp_path, full):
    killed = tmp_path / "killed"
    proc = _train(killed, "train.max_restarts=2", "logger.mode=offline",
                  fault="step@5:rank=1,save@6:rank=1:attempt=1")
    out = proc.stdout + proc.stderr
    # the console: both failures, both restarts, the torn checkpoint named with the reason
    assert out.count("pipeshard: rank 1 (stage 1, replica 0) failed: the process was killed by SIGKILL") == 2, out[-4000:]
    assert "restarting all 2 ranks (restart 1 of 2)" in out and "(restart 2 of 2)" in out
    assert "skipping checkpoint .tmp_step_000006: incomplete: it was being written when the job stopped" in out
    assert "restart 2: resumed from step_000004 (step 4)" in out

    events = [r for r in read_metrics(killed, events=True) if "event" in r]
    restarts = [r for r in events if r["event"] == "restart"]
    assert [r["attempt"] for r in restarts] == [1, 2]
    first, second = restarts
    assert first["resumed_from_step"] in (2, 4) and first["lost_steps"] == first["last_recorded_step"] - first["resumed_from_step"]
    assert first["last_recorded_step"] == 4 and "killed by SIGKILL" in first["cause"]
    assert second["resumed_from_step"] == 4 and second["checkpoint"] == "step_000004"
    assert second["lost_steps"] == second["last_recorded_step"] - 4 >= 2
    assert [s["checkpoint"] for s in second["skipped"]] == [".tmp_step_000006"]
    saves = [r for r in events if r["event"] == "checkpoint"]
    assert saves and all(r["async"] and r["stall_s"] <= r["write_s"] for r in saves)

    _assert_equal_runs(full, killed)

    # one W&B run, resumed: every start logged into the run id stored in the run directory
    run_id = (killed / "wandb_run_id").read_text().strip()
    offline = sorted(p.name for p in (killed / "wandb").glob("offline-run-*"))
    assert len(offline) == 3 and all(name.endswith(f"-{run_id}") for name in offline), offline


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_max_restarts_resumes_and_equals_uninterrupted(tmp_path, full):
    """torchrun restarts the ranks (its agent store outlives the first attempt: the new ranks
    must not read the dead ones' addresses) and the job resumes from its newest checkpoint."""
    killed = tmp_path / "killed"
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1")
    proc = _train(killed, "logger.mode=disabled", fault="step@5:rank=1", launcher=torchrun)
    out = proc.stdout + proc.stderr
    restarts = [r for r in read_metrics(killed, events=True) if r.get("event") == "restart"]
    assert [r["attempt"] for r in restarts] == [1] and restarts[0]["resumed_from_step"] in (2, 4), out[-4000:]
    assert f"restart 1: resumed from step_{restarts[0]['resumed_from_step']:06d}" in out
    assert out.count("skipping checkpoint") == len(restarts[0]["skipped"])  # named once
    _assert_equal_runs(full, killed)
