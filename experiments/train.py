"""`python -m experiments.train`: profile, partition and train the configured model.

This module currently holds the pure parts: translating a composed config into the keyword
arguments of `partitioner.profile`, `partitioner.partition` and `engine.Pipeline`, and naming
the run. The entry point (`main`) that launches workers is added once the runtime lands.

Example:
    >>> from experiments.config import Config, GPTConfig, TextDataConfig
    >>> cfg = Config(model=GPTConfig(), data=TextDataConfig())
    >>> microbatch_size(cfg), run_name(cfg)
    (4, 'default-1f1b-p2')
"""

from __future__ import annotations

from typing import Any, Sequence

from experiments.config import choice_text as _text
from experiments.config import get_field as _get
from experiments.config import optimizer_kwargs, parse_memory_limit, validate_config

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
