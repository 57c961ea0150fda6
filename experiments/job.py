"""One training job, made before any worker starts: the `Job` every rank is given.

`prepare_job(cfg, run_dir)` builds the model spec, finds the checkpoint to resume from (and
refuses one written for another model), and makes the plan: the run's own `plan.json` when it
resumes with the same layout, else a fresh profile and partition (printed, saved as
`plan.json`); with `data=hf` it checks the files (and tokenizes them into the cache) first.
With `pipeline.schedule=auto` / `pipeline.microbatches=auto` the plan is the
planner's choice (`partitioner.search`; `plan.json` keeps the choice and the alternatives) and
the job's config holds the chosen layout (`experiments.wiring.resolve_layout`).
Under `torchrun`, a submitit job of several tasks or an `srun` step (`engine.cluster.detect`)
the process group is initialised first and rank 0 alone prepares, then broadcasts the `Job`
(a measured profile is not deterministic, so the ranks must not each compute one).

Example (what `experiments.train` does)::

    job = prepare_job(cfg, run_dir)
    results = engine.launch(run_worker, world_size(cfg), job)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.config import Config, ConfigError, HFDataConfig, searches, to_plain_dict
from experiments.wiring import (check_checkpoint_model, checkpoint_root, make_plan, plan_matches, resolve_layout,
                                resume_checkpoint, run_name, world_size)

__all__ = ["Job", "prepare_job", "under_torchrun", "check_restartable_run_dir"]


@dataclass
class Job:
    """Everything a rank needs; picklable (it crosses to the workers).

    config: the typed experiment config (`experiments.config.Config`), with the planner's layout
        written in when it chose one (`pipeline.schedule=auto`).
    plan: the `partitioner.Plan` being run (its stage ranges, and the predictions for the metrics).
    run_dir: the shared run directory (metrics.jsonl, W&B, pictures).
    checkpoint_root: where checkpoints go (`<run_dir>/checkpoints` by default).
    resume_from: a complete checkpoint directory to start from, or None for a fresh start.
    run_name: the W&B run name.
    data: with data=hf, the data settings `experiments.hfdata.prepare` resolved (files, tokenizer,
        shards, the tokenized cache's files); None otherwise.
    """

    config: Config
    plan: Any
    run_dir: str
    checkpoint_root: str
    resume_from: str | None = None
    run_name: str = "run"
    data: dict | None = None

    @property
    def stage_ranges(self) -> list[tuple[int, int]]:
        return list(self.plan.stage_ranges)

    def plain_config(self) -> dict:
        """The config as plain Python for W&B (`data` as prepared, with data=hf)."""
        plain = to_plain_dict(self.config)
        return plain if self.data is None else {**plain, "data": self.data}


def under_torchrun() -> bool:
    """Whether torchrun, submitit or Slurm started this process as one rank of the job; their
    ranks are then in RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT (`engine.cluster`)."""
    from engine.cluster import detect, export_env

    env = detect()
    if env is not None:
        export_env(env)
    return env is not None


def check_restartable_run_dir() -> None:
    """`torchrun --max-restarts` starts this module again: with the default time-stamped run
    directory the new start would not find the run's checkpoints. Refuse that before training."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and not any(o.startswith("hydra.run.dir=")
                                             for o in HydraConfig.get().overrides.hydra):
        raise ConfigError("torchrun --max-restarts needs a fixed run directory shared by all nodes, so that a "
                          "restarted job finds its checkpoints: add hydra.run.dir=<shared dir>")


def prepare_job(cfg: Any, run_dir: Path) -> Job:
    """The job for the typed `cfg` in `run_dir` (see the module docstring)."""
    from experiments.config import as_config

    cfg = as_config(cfg)
    if not under_torchrun():
        return _prepare(cfg, run_dir)
    check_restartable_run_dir()
    return _prepare_on_rank0(cfg, run_dir)


def _plan_for(cfg: Any, spec: Any, run_dir: Path, resume: Path | None) -> Any:
    """The run's saved plan when resuming the same layout, else a fresh one (saved)."""
    from partitioner import Plan

    plan_path = run_dir / "plan.json"
    if resume is not None and plan_path.is_file():
        saved = Plan.from_json(plan_path)
        if plan_matches(saved, cfg, len(spec.layers)):
            print(f"reusing {plan_path} (same layout as the run being resumed)", flush=True)
            return saved
    plan = make_plan(cfg, spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan.to_json(plan_path)
    return plan


def _checked_choice(config: Config) -> Config:
    """The planner's layout passes the checks an explicit one does (a 3-D search may choose a tp
    the model or precision cannot run)."""
    from experiments.config import validate_config

    try:
        return validate_config(config)
    except ConfigError as e:
        raise ConfigError(f"the planner chose a layout this run cannot use: {e}; or narrow the search "
                          "(partitioner.search.tensor_parallel / zero_stages)") from None


def _prepare(cfg: Config, run_dir: Path) -> Job:
    """Model, resume point, plan (printed and saved). Once the input has passed its checks, the
    workers' fork server imports torch during planning, on another core: a measured profile
    beside it times the same within its noise (docs/performance.md), and the fixed costs' own
    workers wait for it to be ready. A plan that does not fit still refuses the job (exit 2);
    the idle server then leaves when its import is done."""
    from engine.launch import prestart
    from experiments.models import build_model

    spec = build_model(cfg.model)
    resume = resume_checkpoint(cfg, run_dir)
    if resume is not None:
        check_checkpoint_model(resume, spec)
    data = _prepare_data(cfg, resume)
    prestart()
    plan = _plan_for(cfg, spec, run_dir, resume)
    print(f"model {spec.name}: {len(spec.layers)} pipeline layers, {spec.num_params:,} parameters", flush=True)
    print(plan.summary(), flush=True)
    if resume is not None:
        print(f"resuming from {resume}", flush=True)
    config = cfg
    if searches(cfg):
        config = _checked_choice(resolve_layout(cfg, plan))
        print(f"the planner chose {plan.schedule}, {plan.microbatches} microbatches"
              + (f", {plan.virtual_stages} chunks per rank" if plan.virtual_stages > 1 else "")
              + (f", max_inflight {plan.max_inflight}" if plan.max_inflight is not None else "")
              + (f", recompute on chunks {[c for c, r in enumerate(plan.stage_recompute) if r]}"
                 f" ({plan.recompute_granularity} checkpoints)" if any(plan.stage_recompute) else "")
              + (", sequence parallel" if plan.sequence_parallel else ""), flush=True)
    return Job(config=config, plan=plan, run_dir=str(run_dir), checkpoint_root=str(checkpoint_root(cfg, run_dir)),
               resume_from=str(resume) if resume else None, run_name=run_name(config), data=data)


def _prepare_data(cfg: Config, resume: Path | None) -> dict | None:
    """data=hf: check (and tokenize) the files before launch; the resolved `data` for the workers."""
    if not isinstance(cfg.data, HFDataConfig):
        return None
    import json

    from engine.checkpoint import MANIFEST
    from experiments.hfdata import DataError, prepare

    resumed = json.loads((resume / MANIFEST).read_text()).get("meta", {}).get("data") if resume else None
    try:
        return prepare(cfg, resumed)
    except DataError as err:  # reported like any bad config: error: ..., exit 2, nothing launched
        raise ConfigError(str(err)) from None


def _prepare_on_rank0(cfg: Any, run_dir: Path) -> Job:
    """Under torchrun: initialise the process group, rank 0 prepares, every rank gets its job."""
    import datetime

    import torch
    import torch.distributed as dist

    from engine.cluster import init_process_group
    from engine.launch import _device_backend

    world = int(os.environ["WORLD_SIZE"])
    if world != world_size(cfg):
        raise ConfigError(
            f"the cluster launcher started {world} processes but pipeline.stages x pipeline.data_parallel = "
            f"{world_size(cfg)}; set torchrun's --nnodes x --nproc-per-node (or Slurm's nodes x tasks per "
            f"node, hydra.launcher.nodes x hydra.launcher.tasks_per_node) to {world_size(cfg)} or change the layout")
    if not dist.is_initialized():
        backend = _device_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init_process_group(backend, datetime.timedelta(seconds=300))
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = _prepare(cfg, run_dir)
        except Exception as exc:  # tell the other ranks instead of leaving them waiting
            payload[0] = f"{type(exc).__name__}: {exc}"
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], str):
        raise ConfigError(f"rank 0 failed to prepare the job: {payload[0]}")
    return payload[0]
