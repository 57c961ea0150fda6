"""`python -m experiments.train [overrides]`: profile, partition and train the configured model.

What a job does, in order:
1. compose and check the config (`validate_config`) before anything starts;
2. build the model spec, profile it (`partitioner.profile`, measured here with one thread, or
   analytic) and split it (`partitioner.partition` with the configured method, memory limit,
   schedule, microbatches, replicas and ZeRO stage); print `plan.summary()` and save `plan.json`
   in the run directory. A job that resumes with an unchanged layout reuses the run's plan.json;
3. start `pipeline.stages x pipeline.data_parallel` workers with `engine.launch`
   (`experiments.runner.run_worker`), which train, write `metrics.jsonl`, log to W&B and
   checkpoint.

Under `torchrun` (RANK / WORLD_SIZE set) every process runs this module; the process group is
initialised first, **rank 0 alone profiles and partitions** and broadcasts the plan and its run
directory to the others (a measured profile is not deterministic, so the ranks must not each
compute one). Give every node the same `hydra.run.dir=<shared dir>`; rank 0's directory is the one
used. Checkpoints need a filesystem shared by all nodes.

Resume: with `checkpoint.resume=true` (default) a job whose checkpoint directory
(`<run dir>/checkpoints`) holds a checkpoint continues from it, also with another number of
stages or replicas; `checkpoint.resume=false` starts fresh; a path resumes from that checkpoint.
SIGTERM / SIGINT stop the workers after the current step, save a checkpoint when
`checkpoint.every_steps > 0`, and the job exits with status 0.

Example:
    python -m experiments.train                                   # the default experiment
    python -m experiments.train experiment=smoke logger.mode=disabled
    python -m experiments.train -m pipeline.schedule=1f1b,zb-h1

    >>> from experiments.config import Config, GPTConfig, TextDataConfig
    >>> cfg = Config(model=GPTConfig(), data=TextDataConfig())
    >>> microbatch_size(cfg), run_name(cfg)
    (4, 'default-1f1b-p2')
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from experiments.config import choice_text as _text
from experiments.config import get_field as _get
from experiments.config import ConfigError, optimizer_kwargs, parse_memory_limit, validate_config

__all__ = [
    "microbatch_size",
    "run_name",
    "resolve_device",
    "torch_dtype",
    "profile_kwargs",
    "partition_kwargs",
    "pipeline_kwargs",
    "engine_optimizer_kwargs",
    "world_size",
    "checkpoint_root",
    "resume_checkpoint",
    "profile_model",
    "make_plan",
    "plan_matches",
    "run",
    "refuse_bad_input",
    "main",
]


def microbatch_size(cfg: Any) -> int:
    """Samples per microbatch: `train.batch_size / (pipeline.data_parallel * pipeline.microbatches)`."""
    per_step = int(_get(cfg, "pipeline.data_parallel")) * int(_get(cfg, "pipeline.microbatches"))
    return int(_get(cfg, "train.batch_size")) // per_step


def world_size(cfg: Any) -> int:
    """Processes the job needs: `pipeline.stages * pipeline.data_parallel`."""
    return int(_get(cfg, "pipeline.stages")) * int(_get(cfg, "pipeline.data_parallel"))


def run_name(cfg: Any) -> str:
    """`logger.run_name`, or `<name>-<schedule>-p<stages>` (with `-d<replicas>` when replicated)."""
    explicit = _get(cfg, "logger.run_name")
    if explicit:
        return str(explicit)
    name = f"{_get(cfg, 'name', 'run')}-{_text(_get(cfg, 'pipeline.schedule'))}-p{_get(cfg, 'pipeline.stages')}"
    dp = int(_get(cfg, "pipeline.data_parallel", 1))
    return name + (f"-d{dp}" if dp > 1 else "")


def resolve_device(cfg: Any) -> str:
    """`train.device`, with `auto` meaning cuda when available, else cpu."""
    device = _text(_get(cfg, "train.device", "auto"))
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_dtype(cfg: Any) -> Any:
    """The compute dtype of `precision` (fp32 -> torch.float32, bf16 -> torch.bfloat16, fp16 -> torch.float16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[_text(_get(cfg, "precision"))]


def profile_kwargs(cfg: Any, device: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `partitioner.profile(layers, example_input, **kwargs)`.

    The example input should be one microbatch: `spec.example_input(microbatch_size(cfg))`.
    """
    part = _get(cfg, "partitioner")
    mode = _text(_get(part, "profile"))
    out: dict[str, Any] = {"mode": mode, "dtype": torch_dtype(cfg)}
    if mode == "measure":
        out.update(device=device or resolve_device(cfg), repeats=int(_get(part, "repeats")),
                   warmup=int(_get(part, "warmup")))
    else:
        out["device_spec"] = _get(part, "device_spec")
    return out


def partition_kwargs(cfg: Any) -> dict[str, Any]:
    """Keyword arguments for `partitioner.partition(profile, **kwargs)` (num_stages included)."""
    p, opt, part = _get(cfg, "pipeline"), _get(cfg, "optimizer"), _get(cfg, "partitioner")
    link = _get(part, "link_bytes_per_s")
    return {
        "num_stages": int(_get(p, "stages")),
        "schedule": _text(_get(p, "schedule")),
        "microbatches": int(_get(p, "microbatches")),
        "virtual_stages": int(_get(p, "virtual_stages")),
        "data_parallel": int(_get(p, "data_parallel")),
        "zero_stage": int(_get(opt, "zero_stage")),
        "optimizer": _text(_get(opt, "name")),
        "memory_limit_bytes": parse_memory_limit(_get(part, "memory_limit")),
        "method": _text(_get(part, "method")),
        "link_bytes_per_s": float(link) if link is not None else None,
        "activation_checkpointing": bool(_get(p, "activation_checkpointing")),
    }


def engine_optimizer_kwargs(cfg: Any) -> dict[str, Any]:
    """Keyword arguments for `engine.OptimizerConfig` (choices as strings, betas a tuple)."""
    return optimizer_kwargs(cfg)


def pipeline_kwargs(cfg: Any, stage_ranges: Sequence[Sequence[int]], *, ties: Sequence[tuple[str, str]] = (),
                    device: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `engine.Pipeline(spec.layers, **kwargs)`, except `loss_fn` and `optimizer`.

    The caller adds `loss_fn=spec.loss_fn` and `optimizer=engine.OptimizerConfig(**engine_optimizer_kwargs(cfg))`.
    """
    validate_config(cfg)
    p = _get(cfg, "pipeline")
    return {
        "stage_ranges": [tuple(int(x) for x in r) for r in stage_ranges],
        "schedule": _text(_get(p, "schedule")),
        "microbatches": int(_get(p, "microbatches")),
        "virtual_stages": int(_get(p, "virtual_stages")),
        "data_parallel": int(_get(p, "data_parallel")),
        "precision": _text(_get(cfg, "precision")),
        "activation_checkpointing": bool(_get(p, "activation_checkpointing")),
        "seed": int(_get(cfg, "train.seed")),
        "device": device,
        "ties": [tuple(t) for t in ties],
        "nonfinite": _text(_get(p, "nonfinite", "raise")),
        "comm_timeout_s": float(_get(p, "comm_timeout_s", 60.0)),
    }


# --------------------------------------------------------------------------- job preparation
def checkpoint_root(cfg: Any, run_dir: str | os.PathLike) -> Path:
    """Where checkpoints go: `checkpoint.dir`, or `<run dir>/checkpoints`."""
    explicit = _get(cfg, "checkpoint.dir")
    return Path(explicit) if explicit else Path(run_dir) / "checkpoints"


_YES = ("true", "auto", "yes", "1", "on")
_NO = ("false", "no", "0", "off", "none", "null", "")


def resume_checkpoint(cfg: Any, run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint a job starts from, per `checkpoint.resume`.

    `true` / `auto` (default): the newest complete checkpoint under the checkpoint directory, or
    None when there is none (fresh start). `false` / null: None. A path: that checkpoint (a step
    directory, or a checkpoint root whose newest one is used); an error if it holds none.
    """
    from engine.checkpoint import MANIFEST, latest_checkpoint

    value = _get(cfg, "checkpoint.resume")
    text = "false" if value is None else str(value).strip()
    if text.lower() in _NO:
        return None
    if text.lower() in _YES:
        return latest_checkpoint(checkpoint_root(cfg, run_dir))
    path = Path(text)
    if (path / MANIFEST).is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ConfigError(
            f"checkpoint.resume={text!r} holds no complete checkpoint; point it at a checkpoint "
            "directory (e.g. <run dir>/checkpoints), or use checkpoint.resume=true to resume from "
            "this run's own checkpoints")
    return found


def _check_checkpoint_model(path: Path, spec: Any) -> None:
    """Fail before any worker starts when the checkpoint is for another model (meta device)."""
    import json

    import torch

    from engine.checkpoint import MANIFEST, layer_specs, model_fingerprint

    manifest = json.loads((path / MANIFEST).read_text())
    with torch.device("meta"):
        mine = layer_specs({i: f().state_dict() for i, f in enumerate(spec.layers)})
    if manifest.get("num_layers") != len(mine) or manifest.get("fingerprint") != model_fingerprint(mine):
        raise ConfigError(
            f"the checkpoint {path} is for another model ({manifest.get('num_layers')} layers, "
            f"this model has {len(mine)}, or their shapes differ); resume with the model settings "
            f"it was written with, use another hydra.run.dir, or set checkpoint.resume=false")


def profile_model(cfg: Any, spec: Any) -> Any:
    """`partitioner.profile` of the model on one microbatch, timed with one thread (as the workers run)."""
    import torch

    import partitioner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return partitioner.profile(spec.layers, spec.example_input(microbatch_size(cfg)), **profile_kwargs(cfg))
    finally:
        torch.set_num_threads(threads)


def make_plan(cfg: Any, spec: Any, prof: Any = None, *, method: str | None = None) -> Any:
    """Profile (unless `prof` is given) and partition per the config; `method` overrides `partitioner.method`."""
    import partitioner

    prof = prof if prof is not None else profile_model(cfg, spec)
    kwargs = partition_kwargs(cfg)
    if method is not None:
        kwargs["method"] = method
    return partitioner.partition(prof, **kwargs)


def plan_matches(plan: Any, cfg: Any, num_layers: int) -> bool:
    """Whether a saved plan fits the configured layout (stages, chunks, schedule, m, replicas, method)."""
    kw = partition_kwargs(cfg)
    return (plan.num_layers == num_layers and plan.num_stages == kw["num_stages"]
            and plan.virtual_stages == kw["virtual_stages"] and plan.schedule == kw["schedule"]
            and plan.microbatches == kw["microbatches"] and plan.data_parallel == kw["data_parallel"]
            and plan.method == kw["method"])


def _prepare(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Rank 0's part: model, resume point, plan (printed and saved). Returns plain data."""
    from partitioner import Plan

    from experiments.models import build_model

    spec = build_model(_get(cfg, "model"))
    resume = resume_checkpoint(cfg, run_dir)
    if resume is not None:
        _check_checkpoint_model(resume, spec)
    data = _prepare_data(cfg, resume)
    plan_path = run_dir / "plan.json"
    plan = None
    if resume is not None and plan_path.is_file():
        saved = Plan.from_json(plan_path)
        if plan_matches(saved, cfg, len(spec.layers)):
            plan = saved
            print(f"reusing {plan_path} (same layout as the run being resumed)", flush=True)
    if plan is None:
        plan = make_plan(cfg, spec)
        run_dir.mkdir(parents=True, exist_ok=True)
        plan.to_json(plan_path)
    print(f"model {spec.name}: {len(spec.layers)} pipeline layers, {spec.num_params:,} parameters", flush=True)
    print(plan.summary(), flush=True)
    if resume is not None:
        print(f"resuming from {resume}", flush=True)
    return {"plan": plan.to_dict(), "resume": str(resume) if resume else None, "run_dir": str(run_dir),
            "data": data}


def _prepare_data(cfg: Any, resume: Path | None) -> dict | None:
    """data=hf: check (and tokenize) the files before launch; the resolved `data` for the workers."""
    if _text(_get(cfg, "data.name")) != "hf":
        return None
    import json

    from engine.checkpoint import MANIFEST
    from experiments.hfdata import DataError, prepare

    resumed = json.loads((resume / MANIFEST).read_text()).get("meta", {}).get("data") if resume else None
    try:
        return prepare(cfg, resumed)
    except DataError as err:  # reported like any bad config: error: ..., exit 2, nothing launched
        raise ConfigError(str(err)) from None


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _torchrun_prepare(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Under torchrun: initialise the process group, rank 0 prepares, every rank gets its result."""
    import datetime

    import torch
    import torch.distributed as dist

    from engine.launch import _device_backend

    world = int(os.environ["WORLD_SIZE"])
    if world != world_size(cfg):
        raise ConfigError(
            f"torchrun started {world} processes but pipeline.stages x pipeline.data_parallel = "
            f"{world_size(cfg)}; set --nnodes x --nproc-per-node to {world_size(cfg)} or change the layout")
    if not dist.is_initialized():
        backend = _device_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = _prepare(cfg, run_dir)
        except Exception as exc:  # tell the other ranks instead of leaving them waiting
            payload[0] = {"error": str(exc)}
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise ConfigError(f"rank 0 failed to prepare the job: {payload[0]['error']}")
    return payload[0]


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


def run(cfg: Any, run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Prepare and run one training job in `run_dir`; returns the loss-owning rank's summary
    (None on ranks that do not own it under torchrun, or when stopped by a signal)."""
    import signal

    import engine
    from experiments.config import to_plain_dict
    from experiments.runner import Job, run_worker

    validate_config(cfg)
    run_dir = Path(run_dir).resolve()
    torchrun = _under_torchrun()
    prep = _torchrun_prepare(cfg, run_dir) if torchrun else _prepare(cfg, run_dir)
    run_dir = Path(prep["run_dir"])
    plan = prep["plan"]
    config = to_plain_dict(cfg)
    if prep.get("data"):
        config["data"] = prep["data"]
    job = Job(config=config, stage_ranges=[list(r) for r in plan["stage_ranges"]], plan=plan,
              run_dir=str(run_dir), checkpoint_root=str(checkpoint_root(cfg, run_dir)),
              resume_from=prep["resume"], run_name=run_name(cfg))
    world = world_size(cfg)
    timeout = _get(cfg, "train.timeout_s")
    old_int = None
    if not torchrun:
        # Ctrl-C: take the launcher's SIGTERM path (workers get a grace period to checkpoint).
        old_int = signal.signal(signal.SIGINT, lambda s, f: os.kill(os.getpid(), signal.SIGTERM))
    try:
        results = engine.launch(run_worker, world, job, timeout_s=float(timeout) if timeout else None)
    except KeyboardInterrupt:
        _print_stopped(cfg, run_dir)
        return None
    finally:
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)
    mine = [r for r in results if r is not None]
    owner = world_size(cfg) // int(_get(cfg, "pipeline.data_parallel")) - 1
    summary = results[owner] if len(results) > owner and results[owner] is not None else None
    if torchrun and any(r.get("stopped_at") for r in mine):
        if int(os.environ["RANK"]) == 0:
            _print_stopped(cfg, run_dir)
        return summary
    if summary is not None or not torchrun:
        _print_end(summary, run_dir)
    return summary


@contextlib.contextmanager
def refuse_bad_input() -> Iterator[None]:
    """Turn a bad configuration (`ConfigError`) or an infeasible partition (`PartitionError`) into
    `error: <message with the fix>` on stderr and exit status 2, without a traceback."""
    from partitioner import PartitionError

    try:
        yield
    except (ConfigError, PartitionError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def hydra_entry(task: Callable[[Any, str], Any]) -> None:
    """Run ``task(cfg, run_dir)`` as a Hydra app on ``conf/`` (overrides from the command
    line), turning bad input into ``error: ...`` and exit status 2."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from experiments.config import CONF_DIR, register_configs

    register_configs()

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _task(cfg: Any) -> None:
        with refuse_bad_input():
            task(cfg, HydraConfig.get().runtime.output_dir)

    _task()


def main() -> None:
    """The Hydra entry point (`python -m experiments.train [overrides]`)."""
    hydra_entry(run)


if __name__ == "__main__":
    main()
