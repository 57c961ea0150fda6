"""`python -m experiments.train [overrides]`: profile, partition and train the configured model.

1. `validate_config` checks the composed config before anything starts;
2. `experiments.job.prepare_job` builds the model spec, finds the checkpoint to resume from and
   makes the plan (`plan.summary()` printed, `plan.json` saved; under `torchrun` rank 0 alone);
3. `engine.launch` starts `pipeline.stages x pipeline.data_parallel` workers running
   `experiments.runner.run_worker`, which train, write `metrics.jsonl`, log to W&B and checkpoint.

Several nodes: run this module under `torchrun` on every node with the same
`hydra.run.dir=<shared dir>`. Resume: a job whose checkpoint directory holds a checkpoint
continues from it (`checkpoint.resume`), also with another number of stages or replicas.
SIGTERM / Ctrl-C stop the workers after the current step (`engine.launch` forwards the signal),
save a checkpoint when `checkpoint.every_steps > 0`, and the job exits with status 0.

Example:
    python -m experiments.train                                   # the default experiment
    python -m experiments.train experiment=smoke logger.mode=disabled
    python -m experiments.train -m pipeline.schedule=1f1b,zb-h1
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from experiments.app import hydra_entry
from experiments.config import validate_config
from experiments.job import prepare_job, under_torchrun
from experiments.wiring import checkpoint_root, world_size

__all__ = ["run", "main"]


def run(cfg: Any, run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Prepare and run one training job in `run_dir`; returns the loss-owning rank's summary
    (None on ranks that do not own it under torchrun, or when stopped by a signal)."""
    import engine
    from experiments.runner import run_worker

    cfg = validate_config(cfg)
    job = prepare_job(cfg, Path(run_dir).resolve())
    run_dir = Path(job.run_dir)
    timeout = cfg.train.timeout_s
    try:  # engine.launch owns SIGINT / SIGTERM while the workers run
        results = engine.launch(run_worker, world_size(cfg), job, timeout_s=float(timeout) if timeout else None,
                                max_restarts=int(cfg.train.max_restarts or 0))
    except KeyboardInterrupt:
        _print_stopped(cfg, run_dir)
        return None
    # the last stage of replica 0 (its tp rank 0) owns the loss (rank order: engine.mesh)
    owner = (int(cfg.pipeline.stages) - 1) * int(cfg.pipeline.tensor_parallel)
    summary = results[owner] if len(results) > owner else None
    if under_torchrun() and any(r.get("stopped_at") for r in results if r is not None):
        if int(os.environ["RANK"]) == 0:
            _print_stopped(cfg, run_dir)
        return summary
    if summary is not None or not under_torchrun():
        _print_end(summary, run_dir)
    return summary


def _leave_torchrun_rank() -> None:
    """Under torchrun, leave without the interpreter's teardown, as engine.launch's own workers
    do: every rank has met on the store after its work (engine.launch), and the run's files and
    W&B run are closed. gloo's threads torn down with the interpreter (or by
    destroy_process_group) could abort a finished rank ("terminate called without an active
    exception", SIGABRT), which turned a clean job into a failed one."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def _print_end(summary: dict[str, Any] | None, run_dir: Path) -> None:
    if summary and summary.get("first_loss") is not None:
        print(f"trained steps {summary['start_step'] + 1}..{summary['end_step']}: loss "
              f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}; median step "
              f"{summary['median_step_s'] * 1e3:.1f} ms (predicted {summary['predicted_step_s'] * 1e3:.1f} ms)",
              flush=True)
    print(f"run directory: {run_dir}  (metrics.jsonl, plan.json)", flush=True)
    offline = sorted(run_dir.glob("wandb/offline-run-*"))
    if offline:
        print(f"W&B offline run: {offline[-1]}\n  upload it with: wandb sync {offline[-1]}", flush=True)


def _print_stopped(cfg: Any, run_dir: Path) -> None:
    from engine.checkpoint import latest_checkpoint

    latest = latest_checkpoint(checkpoint_root(cfg, run_dir))
    where = f"latest checkpoint: {latest}" if latest else "no checkpoint (checkpoint.every_steps=0)"
    print(f"stopped by a signal after the current step; {where}", flush=True)
    if latest:
        print(f"resume with: python -m experiments.train <same overrides> hydra.run.dir={run_dir}", flush=True)
    _print_end(None, run_dir)


def main() -> None:
    """The Hydra entry point (`python -m experiments.train [overrides]`)."""
    hydra_entry(run)
    if under_torchrun():
        _leave_torchrun_rank()


if __name__ == "__main__":
    main()
