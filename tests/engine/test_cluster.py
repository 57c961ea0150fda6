"""engine.cluster: the ranks torchrun, submitit and Slurm give a process, read one way."""
from __future__ import annotations

import pytest

from engine.cluster import ClusterEnv, detect, export_env, restart_count

_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
         "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_JOB_ID",
         "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "PIPESHARD_RESTART_COUNT",
         "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def env(monkeypatch):
    import os
    for k in {*_KEYS, *(k for k in os.environ if k.startswith("SUBMITIT_"))}:
        monkeypatch.setenv(k, "")  # recorded, so that what export_env sets is undone too
        monkeypatch.delenv(k)
    return monkeypatch


def _setenv(env, **values: str) -> None:
    for key, value in values.items():
        env.setenv(key, value)


def test_nothing_set_means_pipeshard_starts_its_own_workers(env):
    assert detect() is None
    assert restart_count() == 0


def test_torchrun(env):
    _setenv(env, RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="node7", MASTER_PORT="1234",
                 TORCHELASTIC_RESTART_COUNT="2")
    assert detect() == ClusterEnv(3, 8, 1, "node7", 1234, "torchrun")
    assert restart_count() == 2
    env.setenv("PIPESHARD_RESTART_COUNT", "1")   # pipeshard's own launcher wins
    assert restart_count() == 1


def test_slurm_step(env):
    _setenv(env, SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_JOB_ID="123456",
                 SLURM_JOB_NODELIST="gpu[012-013,020],cpu1")
    assert detect() is None           # a batch script outside srun is not a step
    env.setenv("SLURM_STEP_ID", "0")
    got = detect()
    assert got == ClusterEnv(5, 8, 1, "gpu012", 20000 + 123456 % 20000, "slurm")
    export_env(got)
    import os
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("5", "8", "1", "gpu012", "23456")
    assert detect() == ClusterEnv(5, 8, 1, "gpu012", 23456, "torchrun")  # same place, read back


def test_single_task_slurm_step_starts_its_own_workers(env):
    _setenv(env, SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_STEP_ID="0")
    assert detect() is None


def test_submitit_tasks(env):
    _setenv(env, SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID="77", SLURM_NTASKS="4", SLURM_PROCID="2",
                 SLURM_LOCALID="0", SLURM_JOB_NUM_NODES="2", SLURM_NODEID="1",
                 SLURM_JOB_NODELIST="n[1-2]")
    assert detect() == ClusterEnv(2, 4, 0, "n1", 20077, "submitit")
