"""The experiment config turned into what the engine and the partitioner take.

Pure functions of the typed config (`experiments.config.Config`; a composed `DictConfig` or
plain dicts are turned into it first, `as_config`): the
keyword arguments of `partitioner.profile`, `partitioner.partition`, `engine.Pipeline` and
`engine.OptimizerConfig`, the job's sizes and names, where checkpoints go and which one a job
resumes from, and the profile + plan of a configured model. Used by the entry points
(`experiments.train`, `experiments.partition`, `experiments.bench`) and by the workers; it
imports none of them.

Example:
    >>> from experiments.config import Config, GPTConfig, TextDataConfig
    >>> cfg = Config(model=GPTConfig(), data=TextDataConfig())
    >>> microbatch_size(cfg), world_size(cfg), run_name(cfg)
    (4, 2, 'default-1f1b-p2')
    >>> schedule_chunks("interleaved-1f1b"), schedule_chunks("1f1b")
    (2, 1)

With `pipeline.schedule=auto` (or `pipeline.microbatches=auto`) the planner chooses the layout
(`search_layout`: `partitioner.search` over the model profiled at each microbatch size) and
`resolve_layout` writes the choice into the job's config, so everything downstream reads a
plain layout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, Sequence

from experiments.config import (Config, ConfigError, as_config, checkpointing_mode, configured_microbatches,
                                optimizer_kwargs, parse_memory_limit, searches, sequence_parallel_problem_at,
                                sequence_parallel_setting, validate_config)
from experiments.fields import choice_text as _text
from partitioner.planner import recompute_follows

__all__ = [
    "microbatch_size", "world_size", "run_name", "resolve_device", "torch_dtype", "schedule_chunks",
    "profile_kwargs", "partition_kwargs", "reshard_choice", "device_links", "tp_model_spec", "with_fixed_costs", "pipeline_kwargs", "engine_optimizer_kwargs",
    "checkpoint_root", "resume_checkpoint", "check_checkpoint_model", "profile_model", "make_plan",
    "plan_matches", "search_kwargs", "measures_fixed_costs", "profiles_by_size", "search_layout", "resolve_layout", "available_cores",
    "parallel_search", "sequence_parallel_search", "sp_norm_tensors",
]


def microbatch_size(cfg: Any) -> int:
    """Samples per microbatch: `train.batch_size / (pipeline.data_parallel * pipeline.microbatches)`."""
    m = configured_microbatches(cfg)
    if m is None:
        raise ConfigError("pipeline.microbatches=auto has no microbatch size until the planner chooses; "
                          "use experiments.wiring.resolve_layout(config, plan) (prepare_job does)")
    return _batch_per_replica(cfg) // m


def _batch_per_replica(cfg: Any) -> int:
    cfg = as_config(cfg)
    return int(cfg.train.batch_size) // int(cfg.pipeline.data_parallel)


def world_size(cfg: Any) -> int:
    """Processes the job needs: `pipeline.stages * pipeline.data_parallel * pipeline.tensor_parallel`
    (engine.mesh's rank order)."""
    p = as_config(cfg).pipeline
    return int(p.stages) * int(p.data_parallel) * int(p.tensor_parallel)


def run_name(cfg: Any) -> str:
    """`logger.run_name`, or `<name>-<schedule>-p<stages>` (with `-d<replicas>` when replicated)."""
    cfg = as_config(cfg)
    if cfg.logger.run_name:
        return str(cfg.logger.run_name)
    name = f"{cfg.name}-{_text(cfg.pipeline.schedule)}-p{cfg.pipeline.stages}"
    dp = int(cfg.pipeline.data_parallel)
    return name + (f"-d{dp}" if dp > 1 else "")


def resolve_device(cfg: Any) -> str:
    """`train.device`, with `auto` meaning cuda when available, else cpu."""
    device = _text(as_config(cfg).train.device)
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_dtype(cfg: Any) -> Any:
    """The compute dtype of `precision` (fp32 -> torch.float32; bf16 and bf16-autocast ->
    torch.bfloat16; fp16 and fp16-autocast -> torch.float16)."""
    import torch

    from engine.choices import compute_name

    name = compute_name(_text(as_config(cfg).precision))
    return {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def schedule_chunks(schedule: str) -> int:
    """Model chunks per rank a schedule runs with when none is asked for: its fixed number
    (`engine.schedules.SCHEDULE_INFO`), or 2 where `virtual_stages` chooses (interleaved)."""
    from engine.schedules import SCHEDULE_INFO, SCHEDULES

    info = SCHEDULE_INFO.get(str(schedule))
    if info is None:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    return info.virtual_stages(2)


def profile_kwargs(cfg: Any, device: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `partitioner.profile(layers, example_input, **kwargs)`.

    The example input should be one microbatch: `spec.example_input(microbatch_size(cfg))`.
    Analytic with `partitioner.calibrate=true`: the device spec is the calibrated one
    (`partitioner.calibrate.calibrated_spec`: cached per device name, timed here when missing).
    """
    cfg = as_config(cfg)
    part = cfg.partitioner
    mode = _text(part.profile)
    out: dict[str, Any] = {"mode": mode, "dtype": torch_dtype(cfg)}
    if mode == "measure":
        out.update(device=device or resolve_device(cfg), repeats=int(part.repeats),
                   warmup=int(part.warmup), sweeps=int(part.sweeps), caches=_text(part.caches))
    else:
        out.update(device_spec=part.device_spec,
                   attention=_text(part.attention) if part.attention is not None else None)
        if part.calibrate:  # the device model fitted on the device at hand (cached per device name)
            from partitioner.calibrate import calibrated_spec

            out["device_spec"] = calibrated_spec(out["device_spec"])
    return out


def _planner_kwargs(cfg: Config) -> dict[str, Any]:
    """What `partitioner.partition` and `partitioner.search` both take from the config."""
    p, opt, part = cfg.pipeline, cfg.optimizer, cfg.partitioner
    link = part.link_bytes_per_s
    zero = int(opt.zero_stage)
    return {
        "data_parallel": int(p.data_parallel),
        "zero_stage": zero,
        # ZeRO-3's reshard policy: the planner chooses under auto (Plan.reshard_after_forward)
        "reshard_after_forward": reshard_choice(cfg) if zero == 3 else None,
        "tensor_parallel": int(p.tensor_parallel),
        "links": device_links(cfg),
        "optimizer": _text(opt.name),
        "memory_limit_bytes": parse_memory_limit(part.memory_limit),
        "method": _text(part.method),
        "link_bytes_per_s": float(link) if link is not None else None,
        "activation_checkpointing": checkpointing_mode(p.activation_checkpointing),
        "recompute_granularity": _text(p.recompute_granularity),
        "precision": _text(cfg.precision),
        "momentum": float(opt.momentum or 0.0),
        "grad_accum_dtype": _text(opt.grad_accum_dtype),
        "backend": _text(opt.backend),
        "overlap_grad_reduce": bool(opt.overlap_grad_reduce),
        "grad_bucket_mb": float(opt.grad_bucket_mb),
        "step_sync": _text(opt.step_sync),
        "grad_clip": opt.grad_clip is not None,
    }


def reshard_choice(cfg: Any) -> bool | None:
    """`optimizer.reshard_after_forward` for the planner: True / False, or None (auto: the planner
    chooses, `Plan.reshard_after_forward`)."""
    key = str(as_config(cfg).optimizer.reshard_after_forward).lower()
    return None if key == "auto" else key == "true"


def device_links(cfg: Any) -> Any:
    """The collectives' links (`partitioner.collectives.Links`) the plan charges its tensor- and
    data-parallel collectives on: the analytic profile's device spec's (`partitioner.device_spec`,
    with `partitioner.gpus_per_node` GPUs per node when set, else the spec's own);
    for layers measured here on the CPU with `partitioner.fixed_costs` on and more than one tp or
    dp rank, gloo's collectives measured on this machine (`engine.overhead.measure_collectives`,
    cached per machine like the fixed costs, fitted by `partitioner.collectives.measured_links`):
    the busy fit when the job's ranks outnumber the cores (`available_cores`), else the idle one.
    None otherwise (a spec without links, a measured profile on another device or without fixed
    costs): the plan then charges no tensor-parallel or data-parallel collective, and says so."""
    cfg = as_config(cfg)
    part, p = cfg.partitioner, cfg.pipeline
    if _text(part.profile) == "measure":
        parallel = int(p.tensor_parallel) > 1 or int(p.data_parallel) > 1
        if not (parallel and measures_fixed_costs(cfg)):
            return None
        from engine.overhead import measure_collectives
        from partitioner.collectives import measured_links

        # more local ranks than cores: a collective waits for its peer to get a core (the busy fit)
        return measured_links(measure_collectives(), shared_cores=world_size(cfg) > available_cores())
    if part.device_spec is None:
        return None
    from partitioner import get_device_spec

    node = {} if part.gpus_per_node is None else {"gpus_per_node": int(part.gpus_per_node)}
    return get_device_spec(str(part.device_spec), **node).links


def partition_kwargs(cfg: Any) -> dict[str, Any]:
    """Keyword arguments for `partitioner.partition(profile, **kwargs)` (num_stages included)."""
    cfg = as_config(cfg)
    p = cfg.pipeline
    return {
        "num_stages": int(p.stages),
        "schedule": _text(p.schedule),
        "microbatches": int(p.microbatches),
        "virtual_stages": int(p.virtual_stages),
        "max_inflight": _optional_int(p.max_inflight),
        **_planner_kwargs(cfg),
    }


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def search_kwargs(cfg: Any) -> dict[str, Any]:
    """Keyword arguments for `partitioner.search(profiles, **kwargs)` (`pipeline.schedule=auto` and
    / or `pipeline.microbatches=auto`; `partitioner.search` bounds it). A fixed schedule, count,
    `virtual_stages` (interleaved) or `max_inflight` restricts the search to it.
    `pipeline.activation_checkpointing` follows the partitioner's one rule
    (`partitioner.planner.CHECKPOINTING`): false, only layouts that fit without recomputation;
    true, every chunk recomputes; auto, per chunk where the memory limit needs it."""
    cfg = as_config(cfg)
    p, sc = cfg.pipeline, cfg.partitioner.search
    schedule, listed = _text(p.schedule), sc.schedules
    if schedule != "auto":
        schedules = [schedule]
    else:
        schedules = [_text(x) for x in listed] if listed else None
    cap = _optional_int(p.max_inflight)
    return {
        "num_stages": int(p.stages), "batch_per_replica": _batch_per_replica(cfg),
        "schedules": schedules, "microbatches": configured_microbatches(cfg),
        "max_microbatches": _optional_int(sc.max_microbatches),
        "max_virtual_stages": int(sc.max_virtual_stages),
        "virtual_stages": [int(p.virtual_stages)] if schedule == "interleaved-1f1b" else None,
        "max_inflight": None if cap is None else [cap],
        "top": int(sc.top),
        "sequence_parallel": sequence_parallel_search(cfg, int(p.tensor_parallel)),
        **_planner_kwargs(cfg),
    }


def sequence_parallel_search(cfg: Any, tp: int) -> bool | str:
    """What `partitioner.search` plans at `tp` ranks for `model.sequence_parallel`: true / false as
    configured; auto, "auto" (with and without) where the model runs it over `tp` ranks
    (`experiments.config.sequence_parallel_problem_at`), else False. The search is given the
    profile with the residual stream whole and divides it once itself."""
    mode = sequence_parallel_setting(as_config(cfg).model)
    if mode != "auto":
        return mode
    return "auto" if sequence_parallel_problem_at(as_config(cfg).model, tp) is None else False


def engine_optimizer_kwargs(cfg: Any, plan: Any = None) -> dict[str, Any]:
    """Keyword arguments for `engine.OptimizerConfig` (choices as strings, betas a tuple). Under
    ZeRO-3 with `optimizer.reshard_after_forward=auto`, the `plan`'s reshard policy when given
    (the planner's choice), else `optimizer_kwargs`' rule (reshard iff a memory limit is set)."""
    out = optimizer_kwargs(cfg)
    cfg = as_config(cfg)
    chosen = getattr(plan, "reshard_after_forward", None)
    if (chosen is not None and int(cfg.optimizer.zero_stage) == 3
            and str(cfg.optimizer.reshard_after_forward).lower() == "auto"):
        out["reshard_after_forward"] = str(bool(chosen)).lower()
    return out


def pipeline_kwargs(cfg: Any, stage_ranges: Sequence[Sequence[int]], *, ties: Sequence[tuple[str, str]] = (),
                    device: str | None = None, recompute: Sequence[bool] | None = None) -> dict[str, Any]:
    """Keyword arguments for `engine.Pipeline(spec.layers, **kwargs)`, except `loss_fn` and `optimizer`.

    The caller adds `loss_fn=spec.loss_fn` and `optimizer=engine.OptimizerConfig(**engine_optimizer_kwargs(cfg))`.
    ``recompute``: the plan's per-chunk ``stage_recompute`` (what `pipeline.activation_checkpointing`
    decided: every chunk, none, or with auto the partitioner's choice), passed as one bool when
    every chunk agrees, else one per chunk; without it the config's true / false applies to every
    chunk.
    """
    cfg = validate_config(cfg)
    p = cfg.pipeline
    mode = checkpointing_mode(p.activation_checkpointing)
    if not recompute and mode == "auto":
        raise ConfigError("pipeline.activation_checkpointing=auto needs the plan's per-chunk choice: pass "
                          "recompute=plan.stage_recompute")
    ckpt: Any = bool(mode)
    if recompute:
        ckpt = bool(recompute[0]) if len(set(map(bool, recompute))) == 1 else [bool(x) for x in recompute]
    return {
        "stage_ranges": [tuple(int(x) for x in r) for r in stage_ranges],
        "schedule": _text(p.schedule),
        "microbatches": int(p.microbatches),
        "virtual_stages": int(p.virtual_stages),
        "max_inflight": _optional_int(p.max_inflight),
        "data_parallel": int(p.data_parallel),
        "tensor_parallel": int(p.tensor_parallel),
        "precision": _text(cfg.precision),
        "activation_checkpointing": ckpt,
        "recompute_granularity": _text(p.recompute_granularity),
        "memory_every": int(cfg.train.memory_every or 0),
        "seed": int(cfg.train.seed),
        "device": device,
        "ties": [tuple(t) for t in ties],
        "nonfinite": _text(p.nonfinite),
        "comm_timeout_s": float(p.comm_timeout_s),
    }


# --------------------------------------------------------------------------- checkpoints
def checkpoint_root(cfg: Any, run_dir: str | os.PathLike) -> Path:
    """Where checkpoints go: `checkpoint.dir`, or `<run dir>/checkpoints`."""
    explicit = as_config(cfg).checkpoint.dir
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

    cfg = as_config(cfg)
    value = cfg.checkpoint.resume
    text = "false" if value is None else str(value).strip()
    if text.lower() in _NO:
        return None
    if text.lower() in _YES:
        from engine.checkpoint import find_resumable
        from engine.cluster import restart_count
        from experiments.recovery import skipped_messages

        found, skipped = find_resumable(checkpoint_root(cfg, run_dir))
        if restart_count() == 0:  # on a restart (torchrun's) the restart announcement names them
            for line in skipped_messages(skipped):
                print(line, flush=True)
        return found
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


def check_checkpoint_model(path: Path, spec: Any) -> None:
    """Fail before any worker starts when the checkpoint is for another model (meta device)."""
    from engine.checkpoint import MANIFEST, layer_specs, model_fingerprint
    from partitioner.meta import meta_device

    manifest = json.loads((path / MANIFEST).read_text())
    with meta_device():
        mine = layer_specs({i: f().state_dict() for i, f in enumerate(spec.layers)})
    if manifest.get("num_layers") != len(mine) or manifest.get("fingerprint") != model_fingerprint(mine):
        raise ConfigError(
            f"the checkpoint {path} is for another model ({manifest.get('num_layers')} layers, "
            f"this model has {len(mine)}, or their shapes differ); resume with the model settings "
            f"it was written with, use another hydra.run.dir, or set checkpoint.resume=false")


# --------------------------------------------------------------------------- profile and plan
def tp_model_spec(cfg: Any, tensor_parallel: int | None = None) -> Any:
    """The model spec of one tensor-parallel rank (`pipeline.tensor_parallel` unless given):
    Megatron's sharding as shapes, so that a profile of it is one rank's parameters, FLOPs and
    activations without sequence parallelism. Attention heads, KV heads, the MLP's hidden size and
    the vocabulary (embedding and LM head) divided by tp, the head dimension and the hidden size
    kept: the column-parallel projections' outputs and the attention are sharded, while the block's
    input and output, the norms and the residual stream are whole on every rank. A Hugging Face
    Llama-style family (its config takes `head_dim`) or the GPT model (`_gpt_tp_spec`: its own tp
    plan's shard shapes), built without sequence parallelism (under `model.sequence_parallel`
    `profile_model`, or the search, then splits the residual stream:
    `partitioner.recompute.sequence_parallel_profile`); the model itself for tp = 1."""
    import dataclasses

    from experiments.models import build_model

    cfg = as_config(cfg)
    t = int(cfg.pipeline.tensor_parallel if tensor_parallel is None else tensor_parallel)
    model = cfg.model
    if t == 1:
        return build_model(model)
    gpt = _text(model.name) == "gpt"
    if not gpt and (not hasattr(model, "arch") or getattr(model, "pretrained", None)
                    or _text(model.arch) in ("gpt2", "gpt_neox")):
        raise ConfigError(f"planning pipeline.tensor_parallel={t} needs the GPT model "
                          f"or a random Hugging Face model of a Llama-style "
                          f"family (model=hf_llama, or model=hf with model.arch=llama, mistral, qwen2, qwen3, phi3); "
                          f"got model.name={_text(model.name)}: set pipeline.tensor_parallel=1")
    model = dataclasses.replace(model, sequence_parallel=False)   # the residual stream whole, as profiled
    if gpt:
        return _gpt_tp_spec(model, t)
    heads, dim = int(model.heads), int(model.dim)
    kv = int(model.kv_heads or heads)
    inter = int(model.intermediate or 4 * dim)
    sizes = {"model.heads": heads, "model.kv_heads": kv, "model.intermediate": inter, "model.vocab": int(model.vocab)}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % t]
    if bad:
        raise ConfigError(f"pipeline.tensor_parallel={t} does not divide {', '.join(bad)}: choose a tensor-parallel "
                          f"degree that divides each of {', '.join(f'{k}={v}' for k, v in sizes.items())}")
    shard = dataclasses.replace(model, heads=heads // t, kv_heads=kv // t, intermediate=inter // t,
                                vocab=int(model.vocab) // t)
    from experiments.models.hf_build import build_hf

    return build_hf(shard, head_dim=dim // heads)


def _gpt_tp_spec(model: Any, t: int) -> Any:
    """One tp rank's GPT (`tp_model_spec`): built with the vocabulary / t (the vocabulary-parallel
    embedding and head, and token ids in range), each block with its plan's shard shapes
    (`engine.tp.shard_shapes`: heads, q/k/v and the MLP's width / t)."""
    from experiments.models import build_model

    bad = [f"{k}={v}" for k, v in (("model.heads", int(model.heads)), ("model.vocab", int(model.vocab)),
                                   ("model.dim x model.mlp_ratio", int(model.dim) * int(model.mlp_ratio))) if v % t]
    if bad:
        raise ConfigError(f"pipeline.tensor_parallel={t} does not divide {', '.join(bad)}: choose a tensor-parallel "
                          "degree that divides each")
    spec = build_model(dataclasses.replace(model, vocab=int(model.vocab) // t))
    blocks = [functools.partial(_tp_rank_layer, f, t) for f in spec.layers[1:-1]]
    return dataclasses.replace(spec, layers=[spec.layers[0], *blocks, spec.layers[-1]])


def _tp_rank_layer(factory: Any, t: int) -> Any:
    from engine.tp import shard_shapes

    return shard_shapes(factory(), t)


def profile_model(cfg: Any, spec: Any, microbatch: int | None = None) -> Any:
    """`partitioner.profile` of the model on one microbatch (`microbatch` samples, default the
    configured size), timed with one thread (as the workers run).

    A measured profile runs the layers as the engine does: weights in the precision's weight
    dtype (fp32 under `bf16-autocast`) and, with 16-bit compute, under `torch.autocast`, so it
    saves what the run saves (autocast keeps fp32 inputs and 16-bit weight copies). A tp rank's
    profile measured on the CPU takes its times from the layers run as DTensor (`_tp_timed`)."""
    import contextlib

    import torch

    import partitioner
    from engine.optim import compute_dtype
    from experiments.models.loss import profile_loss_kwargs

    cfg = as_config(cfg)
    kwargs = profile_kwargs(cfg)
    compute = compute_dtype(_text(cfg.precision))
    ctx: Any = contextlib.nullcontext()
    if kwargs["mode"] == "measure" and compute is not None:
        from engine.choices import weight_bytes
        if weight_bytes(_text(cfg.precision)) == 4:
            kwargs["dtype"] = torch.float32
        ctx = torch.autocast(torch.device(kwargs["device"]).type, dtype=compute)
    size = microbatch_size(cfg) if microbatch is None else int(microbatch)
    kwargs.update(profile_loss_kwargs(spec, size))   # the last layer with the loss (and the other LM head)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ctx:
            prof = partitioner.profile(spec.layers, spec.example_input(size), **kwargs)
    finally:
        torch.set_num_threads(threads)
    prof.meta["microbatch_size"] = size
    if int(cfg.pipeline.tensor_parallel) > 1:   # a profile of one tp rank (`tp_model_spec`)
        from partitioner.recompute import SP_NORM_TENSORS

        prof.meta["tensor_parallel"] = int(cfg.pipeline.tensor_parallel)
        prof = _tp_timed(cfg, prof, size, kwargs, compute)
        prof.meta[SP_NORM_TENSORS] = sp_norm_tensors(cfg)
        if sequence_parallel_setting(cfg.model) is True:   # the residual stream split on the sequence
            from partitioner.recompute import sequence_parallel_profile

            prof = sequence_parallel_profile(prof, int(cfg.pipeline.tensor_parallel))
    return with_fixed_costs(cfg, prof)


def sp_norm_tensors(cfg: Any) -> int:
    """Residual-stream tensors each of the model's norms saves that sequence parallelism splits
    (`partitioner.recompute.SP_NORM_TENSORS`), in units of the residual stream: the GPT's
    LayerNorm its input (1); a Hugging Face RMSNorm its input and its normalised input (2) on a
    4-byte residual stream (fp32, and the `-autocast` precisions), and with 16-bit weights its
    input upcast to fp32 (2) and its normalised input cast back (1): 3."""
    from engine.choices import weight_bytes

    cfg = as_config(cfg)
    if _text(cfg.model.name) == "gpt":
        return 1
    return 3 if weight_bytes(_text(cfg.precision)) == 2 else 2


def _tp_timed(cfg: Config, prof: Any, size: int, kwargs: dict[str, Any], compute: Any) -> Any:
    """A tp rank's profile (plain shapes) with, for layers measured on the CPU, the times of the
    whole model's layers run as the engine runs them: sharded by `engine.tp.parallelize_layer`
    over a gloo tp group of `pipeline.tensor_parallel` local ranks (`partitioner.tptime`: each rank's
    CPU time, DTensor's dispatch and redistribution included, the tp collectives not: the plan
    charges those from the links), `meta["tp_time"] = "dtensor"`; the bytes stay the plain shapes'.
    Else (analytic, another device) the plain shapes' times, `meta["tp_time"] = "shapes"`."""
    import torch

    from partitioner.tptime import TP_TIME_KEY, measure_tp_times, with_tp_times

    if kwargs["mode"] != "measure" or torch.device(kwargs["device"]).type != "cpu":
        prof.meta[TP_TIME_KEY] = "shapes"
        return prof
    from experiments.models import build_model
    from experiments.models.loss import profile_loss_kwargs

    tp, whole = int(cfg.pipeline.tensor_parallel), build_model(cfg.model)
    loss = profile_loss_kwargs(whole, size)
    times = measure_tp_times(whole.layers, whole.example_input(size), tp, dtype=kwargs["dtype"], autocast=compute,
                             repeats=kwargs["repeats"], warmup=kwargs["warmup"], sweeps=kwargs["sweeps"],
                             loss_fn=loss["loss_fn"], example_target=loss["example_target"])
    return with_tp_times(prof, times, tp)


def profiles_by_size(cfg: Any, spec: Any) -> Any:
    """`size -> Profile` for the search: the model profiled at each microbatch size it asks for
    (once per size)."""
    return functools.lru_cache(maxsize=None)(functools.partial(profile_model, cfg, spec))


def with_fixed_costs(cfg: Any, prof: Any) -> Any:
    """``prof`` with the runtime's fixed costs on this machine (`engine.overhead`, cached per
    machine) when `partitioner.fixed_costs` is on and layers are measured here on the CPU (the
    costs are measured with gloo on the CPU; other devices get none), with the cores the local
    ranks share and, when the job's ranks outnumber them, the CPU a rank spends off its actions
    (`engine.overhead.measure_cpu_costs`, cached per machine: load on the shared cores), the
    fraction of the cores' time they get and what each compute action costs them
    (`partitioner.shared.fit_shared_costs`)."""
    import dataclasses

    from partitioner import FixedCosts

    if not measures_fixed_costs(cfg):
        return prof
    from engine.overhead import measure_cpu_costs, measure_fixed_costs

    cores = available_cores()
    cpu = measure_cpu_costs() if world_size(cfg) > cores else {}
    fixed = FixedCosts.from_dict({**measure_fixed_costs(), **cpu, "cores": cores})
    if "shared" in cpu:   # ranks outnumbering the cores: the fraction of the cores' time they get
        fit = _shared_fit(json.dumps(cpu["shared"], sort_keys=True), json.dumps(dataclasses.asdict(fixed), sort_keys=True))
        fixed = dataclasses.replace(fixed, shared_efficiency=fit.efficiency, shared_action_s=fit.action_s,
                                    shared_efficiency_by_mode=dict(fit.by_mode))
    return dataclasses.replace(prof, fixed=fixed)


@functools.lru_cache(maxsize=8)
def _shared_fit(shared: str, fixed: str) -> Any:
    """`partitioner.shared.fit_shared_costs` of the JSON ``shared`` records under the JSON
    ``fixed`` costs, once per process (a search plans many layouts on the same machine)."""
    from partitioner import FixedCosts
    from partitioner.shared import fit_shared_costs

    return fit_shared_costs(json.loads(shared), FixedCosts.from_dict(json.loads(fixed)))


def measures_fixed_costs(cfg: Any) -> bool:
    """Whether the plan charges this machine's measured runtime costs (`with_fixed_costs`) and
    gloo collectives (`device_links`): layers measured here on the CPU, `partitioner.fixed_costs`
    on (both are measured with gloo on the CPU; other devices get none)."""
    cfg = as_config(cfg)
    part = cfg.partitioner
    return _text(part.profile) == "measure" and bool(part.fixed_costs) and resolve_device(cfg) == "cpu"


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where the
    platform has none): what the local ranks of a CPU job share."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def make_plan(cfg: Any, spec: Any, prof: Any = None, *, method: str | None = None) -> Any:
    """Profile (unless `prof` is given) and partition per the config; `method` overrides `partitioner.method`.
    When the planner chooses the layout (`searches(cfg)`), the searched plan (`search_layout`);
    `prof` may then be a callable `size -> Profile`."""
    import partitioner

    if searches(cfg):
        if prof is None and int(as_config(cfg).pipeline.tensor_parallel) > 1:
            spec = tp_model_spec(cfg)   # one tp rank's shapes; refused with the fix where there are none
        return search_layout(cfg, spec, prof, method=method).plan
    kwargs = partition_kwargs(cfg)
    whole = None
    if prof is None and int(as_config(cfg).pipeline.tensor_parallel) > 1:
        spec, whole = _tp_rank_spec(cfg, spec)
    if whole is not None:   # no tp-rank shapes for this model: plan the whole layers, say so
        one = as_config(cfg)
        one = dataclasses.replace(one, pipeline=dataclasses.replace(one.pipeline, tensor_parallel=1))
        prof, kwargs["tensor_parallel"] = profile_model(one, spec), 1
    prof = prof if prof is not None else profile_model(cfg, spec)
    if method is not None:
        kwargs["method"] = method
    plan = partitioner.partition(prof, **kwargs)
    if whole is not None:
        plan.notes.append(f"planned as tensor_parallel=1 (each rank's parameters, gradients and activations "
                          f"whole, an upper bound on memory; no tp collectives): {whole}")
    return plan


def _tp_rank_spec(cfg: Any, spec: Any) -> tuple[Any, str | None]:
    """(one tp rank's model spec, None), or (`spec`, why not) when the model has no tp-rank shapes
    to profile (`tp_model_spec`: the GPT and random Llama-style Hugging Face models only)."""
    try:
        return tp_model_spec(cfg), None
    except ConfigError as e:
        return spec, str(e)


def search_layout(cfg: Any, spec: Any, profiles: Any = None, *, method: str | None = None) -> Any:
    """`partitioner.search` per the config: the `SearchResult` (its `plan` carries the record that
    `plan.json` keeps). `profiles`: `size -> Profile` (default `profiles_by_size`, the residual
    stream whole: the search plans sequence parallelism), or one Profile measured at the
    configured microbatch size (one under sequence parallelism already is planned as it is)."""
    import partitioner

    cfg = as_config(cfg)
    if parallel_search(cfg):
        return _search_parallel(cfg, method)
    spec = spec if spec is not None else tp_model_spec(cfg)
    kwargs = search_kwargs(cfg)
    if method is not None:
        kwargs["method"] = method
    profiles = profiles if profiles is not None else profiles_by_size(_stream_whole(cfg), spec)
    extra = {}
    if isinstance(profiles, partitioner.Profile) and profiles.meta.get("microbatch_size"):
        extra["profile_microbatch"] = int(profiles.meta["microbatch_size"])
    if isinstance(profiles, partitioner.Profile) and int(profiles.meta.get("sequence_parallel", 1)) > 1:
        kwargs["sequence_parallel"] = False   # given under sequence parallelism already: planned as it is
    return partitioner.search(profiles, **kwargs, **extra)


def _stream_whole(cfg: Config) -> Config:
    """`cfg` profiled with the residual stream whole (`model.sequence_parallel=false`): the search
    plans sequence parallelism itself (`sequence_parallel_search`)."""
    if not hasattr(cfg.model, "sequence_parallel"):
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, sequence_parallel=False))


def parallel_search(cfg: Any) -> bool:
    """Whether the search chooses the 3-D layout too (`partitioner.search.tensor_parallel` or
    `zero_stages` set)."""
    sc = as_config(cfg).partitioner.search
    return bool(sc.tensor_parallel) or bool(sc.zero_stages)


def _with_parallel(cfg: Config, tp: int, dp: int, zero: int | None = None) -> Config:
    """`cfg` with `pipeline.tensor_parallel` / `data_parallel` (and `optimizer.zero_stage`) set."""
    import dataclasses

    pipeline = dataclasses.replace(cfg.pipeline, tensor_parallel=int(tp), data_parallel=int(dp))
    out = dataclasses.replace(cfg, pipeline=pipeline)
    if zero is not None:
        out = dataclasses.replace(out, optimizer=dataclasses.replace(cfg.optimizer, zero_stage=int(zero)))
    return out


def _search_parallel(cfg: Config, method: str | None) -> Any:
    """`partitioner.search_parallel` per the config: pp fixed, `data_parallel x tensor_parallel`
    GPUs per stage split between replicas and tensor parallelism, the global batch fixed."""
    import partitioner

    p, sc = cfg.pipeline, cfg.partitioner.search
    per_stage = int(p.data_parallel) * int(p.tensor_parallel)
    tps = [int(x) for x in (sc.tensor_parallel or [p.tensor_parallel])]
    zeros = [int(x) for x in (sc.zero_stages or [cfg.optimizer.zero_stage])]
    kwargs = search_kwargs(cfg)
    for key in ("data_parallel", "zero_stage", "tensor_parallel", "batch_per_replica", "num_stages"):
        kwargs.pop(key)
    if method is not None:
        kwargs["method"] = method
    batch = int(cfg.train.batch_size)

    kwargs.pop("sequence_parallel")

    def profiles(tp: int) -> Any:
        one = _stream_whole(_with_parallel(cfg, tp, per_stage // tp))
        return profiles_by_size(one, tp_model_spec(one))

    return partitioner.search_parallel(profiles, int(p.stages), batch, per_stage, tensor_parallel=tps,
                                       zero_stages=zeros, sequence_parallel=lambda t: sequence_parallel_search(cfg, t),
                                       **kwargs)


def resolve_layout(config: Any, plan: Any) -> Config:
    """The typed `config` with the layout `plan` runs written into `pipeline` (schedule,
    microbatches, virtual stages, max_inflight; under auto the recompute granularity, and
    `model.sequence_parallel`): after the planner chose, everything downstream (workers, data,
    checkpoints, names) reads a plain layout."""
    import dataclasses

    from experiments.config import RecomputeGranularity, ScheduleName

    config = as_config(config)
    pipeline = dataclasses.replace(config.pipeline, schedule=ScheduleName(plan.schedule),
                                   microbatches=int(plan.microbatches), virtual_stages=int(plan.virtual_stages),
                                   max_inflight=plan.max_inflight)
    if _text(config.pipeline.recompute_granularity) == "auto":
        pipeline = dataclasses.replace(pipeline, recompute_granularity=RecomputeGranularity(plan.recompute_granularity))
    out = dataclasses.replace(config, pipeline=pipeline)
    if sequence_parallel_setting(out.model) == "auto":
        out = dataclasses.replace(out, model=dataclasses.replace(out.model, sequence_parallel=bool(plan.sequence_parallel)))
    if parallel_search(out):   # the 3-D search chose the replicas, tp and ZeRO stage too
        out = _with_parallel(out, plan.tensor_parallel, plan.data_parallel, plan.zero_stage)
    if plan.reshard_after_forward is not None and str(out.optimizer.reshard_after_forward).lower() == "auto":
        out = dataclasses.replace(out, optimizer=dataclasses.replace(
            out.optimizer, reshard_after_forward=str(bool(plan.reshard_after_forward)).lower()))
    return out


def plan_matches(plan: Any, cfg: Any, num_layers: int) -> bool:
    """Whether a saved plan fits the configured layout (stages, chunks, schedule, m, replicas,
    method), precision and checkpointing (`pipeline.activation_checkpointing`: false / true,
    no chunk / every chunk recomputes; auto, any; a recomputing plan's
    `pipeline.recompute_granularity`), `model.sequence_parallel` (each: auto, any); under
    `auto` layouts, a searched plan whose layout the search could choose."""
    cfg = as_config(cfg)
    mode, sp = checkpointing_mode(cfg.pipeline.activation_checkpointing), sequence_parallel_setting(cfg.model)
    same = (plan.num_layers == num_layers and plan.num_stages == int(cfg.pipeline.stages)
            and plan.data_parallel == int(cfg.pipeline.data_parallel)
            and plan.method == _text(cfg.partitioner.method)
            and plan.precision == _text(cfg.precision)
            and len(plan.stage_recompute or []) == plan.num_chunks
            and recompute_follows(mode, plan.stage_recompute)
            and (not any(plan.stage_recompute)
                 or _text(cfg.pipeline.recompute_granularity) in ("auto", plan.recompute_granularity))
            and (sp == "auto" or bool(plan.sequence_parallel) == (sp is True and int(cfg.pipeline.tensor_parallel) > 1)))
    if searches(cfg):
        kw = search_kwargs(cfg)
        return (same and plan.search is not None and kw["batch_per_replica"] % plan.microbatches == 0
                and (kw["schedules"] is None or plan.schedule in kw["schedules"])
                and kw["microbatches"] in (None, plan.microbatches))
    kw = partition_kwargs(cfg)
    return (same and plan.virtual_stages == kw["virtual_stages"] and plan.schedule == kw["schedule"]
            and plan.microbatches == kw["microbatches"])
