"""Slurm through Hydra: the `hydra/launcher=slurm` preset composes, and a multirun sweep through
hydra-submitit-launcher's `submitit_local` (the same launcher code, run on this machine) finishes
with every job's metrics, each job's two tasks running as the two ranks of one pipeline (ranks
read from submitit's JobEnvironment, as on Slurm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_slurm_preset_composes():
    from hydra import compose, initialize_config_dir
    from experiments.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2",
                                           "hydra.launcher.tasks_per_node=4", "pipeline.stages=4",
                                           "pipeline.data_parallel=2"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node) == (2, 4)
    assert launcher.max_num_timeout > 0 and "export OMP_NUM_THREADS=1" in launcher.setup


@pytest.mark.slow
def test_submitit_sweep_of_two_jobs_each_two_ranks(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "-m", "hydra/launcher=submitit_local",
         "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=10", "experiment=smoke",
         "train.steps=2", "logger.progress=false", "logger.timeline=false", "partitioner.method=uniform",
         "pipeline.schedule=1f1b,gpipe", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for job, schedule in ((0, "1f1b"), (1, "gpipe")):
        records = read_metrics(sweep / str(job))
        assert [r["step"] for r in records] == [1, 2]          # written once: by the owner rank
        assert json.loads((sweep / str(job) / "plan.json").read_text())["schedule"] == schedule
    logs = sorted((sweep / ".submitit").rglob("*_log.out"))
    assert len(logs) == 4                                      # 2 jobs x 2 tasks
    for log in logs:
        text = log.read_text()
        assert "Job completed successfully" in text
        rank = int(log.name.split("_")[1])
        assert (f"global_rank={rank}(2)" in text) and (("pipeline layers" in text) == (rank == 0))
