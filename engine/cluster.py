"""The ranks a cluster launcher gives this process: torchrun, Slurm (srun) or submitit.

:func:`detect` returns this process's place in a job started by someone else, or None when
pipeshard should start its own workers (`engine.launch`). Sources, first match wins:

- torchrun / torchelastic: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``;
- a submitit job with several tasks (``hydra/launcher=submitit_slurm`` or ``submitit_local``
  with ``tasks_per_node`` > 1): submitit's ``JobEnvironment`` (global rank, task count, local
  rank, host names);
- a Slurm step started by ``srun`` with several tasks: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``
  (else ``SLURM_NTASKS``), ``SLURM_LOCALID``; the first host of ``SLURM_JOB_NODELIST`` is the
  master (parsed by submitit). A batch script outside ``srun`` (no ``SLURM_STEP_ID``) is not a
  step: there pipeshard starts its own workers.

``MASTER_ADDR`` / ``MASTER_PORT`` in the environment override the derived ones; the derived port
is ``20000 + job id % 20000``, the same on every task of a job. :func:`restart_count` is the
attempt number under pipeshard's own restarts (``PIPESHARD_RESTART_COUNT``) or torchrun's
(``TORCHELASTIC_RESTART_COUNT``).

Example::

    env = detect()
    if env is not None:          # e.g. srun -N2 --ntasks-per-node=4 python -m experiments.train
        export_env(env)          # RANK, WORLD_SIZE, ... for init_process_group("env://")
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

__all__ = ["ClusterEnv", "detect", "export_env", "restart_count", "init_process_group", "RESTART_ENV",
           "FAILURE_ENV"]

RESTART_ENV = "PIPESHARD_RESTART_COUNT"
FAILURE_ENV = "PIPESHARD_LAST_FAILURE"


@dataclass(frozen=True)
class ClusterEnv:
    """This process's rank in a job a cluster launcher started."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str                 # "torchrun" | "submitit" | "slurm"


def restart_count() -> int:
    """How many times this job was restarted so far (0 on the first run).

    >>> restart_count()  # doctest: +SKIP
    0
    """
    for key in (RESTART_ENV, "TORCHELASTIC_RESTART_COUNT"):
        value = os.environ.get(key)
        if value and value.isdigit():
            return int(value)
    return 0


def _port(job_id: str | None) -> int:
    given = os.environ.get("MASTER_PORT")
    if given:
        return int(given)
    digits = "".join(c for c in (job_id or "") if c.isdigit())
    return 20000 + int(digits) % 20000 if digits else 29500


def _torchrun() -> ClusterEnv | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return ClusterEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                      int(os.environ.get("LOCAL_RANK", "0")),
                      os.environ.get("MASTER_ADDR", "127.0.0.1"), _port(None), "torchrun")


def _submitit() -> ClusterEnv | None:
    if not any(k.startswith("SUBMITIT_") for k in os.environ):
        return None
    try:
        import submitit
        job = submitit.JobEnvironment()
    except (ImportError, RuntimeError):
        return None
    if job.num_tasks <= 1:
        return None
    hosts = list(job.hostnames) if job.cluster == "slurm" else ["127.0.0.1"]
    return ClusterEnv(job.global_rank, job.num_tasks, job.local_rank,
                      os.environ.get("MASTER_ADDR") or hosts[0], _port(job.job_id), "submitit")


def _slurm() -> ClusterEnv | None:
    if "SLURM_PROCID" not in os.environ or "SLURM_STEP_ID" not in os.environ:
        return None
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or "1")
    if tasks <= 1:
        return None
    master = os.environ.get("MASTER_ADDR")
    if not master:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
        try:
            from submitit.slurm.slurm import _parse_node_list
            master = _parse_node_list(nodes)[0]
        except (ImportError, IndexError, ValueError) as exc:
            raise RuntimeError(f"cannot tell the master host from SLURM node list {nodes!r} "
                               f"({exc}); set MASTER_ADDR") from exc
    return ClusterEnv(int(os.environ["SLURM_PROCID"]), tasks, int(os.environ.get("SLURM_LOCALID", "0")),
                      master, _port(os.environ.get("SLURM_JOB_ID")), "slurm")


def detect() -> ClusterEnv | None:
    """This process's rank from torchrun, submitit or Slurm; None when none started it."""
    return _torchrun() or _submitit() or _slurm()


def export_env(env: ClusterEnv) -> None:
    """Set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (for
    ``init_process_group`` with the ``env://`` method and for code that reads them)."""
    os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size),
                      LOCAL_RANK=str(env.local_rank), MASTER_ADDR=env.master_addr,
                      MASTER_PORT=str(env.master_port))


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``torch.distributed.init_process_group`` for a job a cluster launcher started (ranks in
    the environment, see :func:`export_env`).

    Under torchrun the ranks use the agent's store (``TORCHELASTIC_USE_AGENT_STORE=True``), which
    outlives a restart (``--max-restarts``): the ranks of a new attempt would find the previous
    attempt's keys, e.g. the gloo address of a rank that died, and connect to it (connection
    refused). The keys of each attempt therefore get their own prefix.

    >>> init_process_group("gloo", datetime.timedelta(seconds=300))  # doctest: +SKIP
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"pipeshard/attempt_{restart_count()}/", store),
                            rank=rank, world_size=world, timeout=timeout)
