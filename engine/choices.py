"""The engine's closed choices and their checks, in one place.

Optimizer names, compute precisions, ZeRO stages, optimizer backends and non-finite policies
(schedule names live in ``engine.schedules.SCHEDULES``). The runtime, both optimizer backends,
the partitioner's memory model and the experiment config all read these; nothing else lists
them. Pure Python: importing this module imports no torch.

Example::

    >>> from engine.choices import OPTIMIZERS, check_precision, precision_problem
    >>> OPTIMIZERS
    ('sgd', 'adam', 'adamw')
    >>> precision_problem("bf16+fp16")
    'bf16 and fp16 cannot be combined (one compute precision per run: bf16 needs no loss scaling, fp16 uses dynamic loss scaling)'
    >>> check_precision("bf16")
    'bf16'
"""
from __future__ import annotations

from typing import Any

__all__ = ["OPTIMIZERS", "PRECISIONS", "GRAD_ACCUM_DTYPES", "ZERO_STAGES", "BACKENDS",
           "NONFINITE", "FSDP_ZERO_STAGE", "precision_problem", "check_precision", "check_optimizer_name",
           "check_zero_stage", "check_nonfinite", "resolve_backend", "weight_bytes",
           "compute_name", "loss_scaled", "check_grad_accum_dtype", "STEP_SYNCS", "check_step_sync",
           "RECOMPUTE_GRANULARITIES", "check_recompute_granularity"]

OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
# "bf16" / "fp16": the modules hold 16-bit weights; DeepSpeed's optimizer keeps the fp32 masters
# (and moments), ZeRO-sharded, and refreshes the 16-bit weights after each step.
# "*-autocast": fp32 weights and gradients, compute under torch.autocast.
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16-autocast", "fp16-autocast")
GRAD_ACCUM_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
ZERO_STAGES: tuple[int, ...] = (0, 1, 2)   # DeepSpeed's
FSDP_ZERO_STAGE = 3                          # ZeRO-3: torch's FSDP2 per stage (engine.fsdp)
BACKENDS: tuple[str, ...] = ("auto", "torch", "deepspeed")
NONFINITE: tuple[str, ...] = ("raise", "skip")
# How a rank's optimizer step learns the global quantities (norm, non-finite flags, fp16 scale):
# "global" resolves them before every rank steps; "post_validate" steps at once and validates
# one step later, rolling back (engine.optim, docs/schedules.md "Rank-local optimizer step").
STEP_SYNCS: tuple[str, ...] = ("global", "post_validate")
# What one checkpoint of a recomputing chunk covers (engine.stage): the whole chunk, or each layer
# (torchtitan's "full" activation checkpointing); the planner models both (partitioner.recompute).
RECOMPUTE_GRANULARITIES: tuple[str, ...] = ("chunk", "layer")


def precision_problem(value: Any) -> str | None:
    """None for a valid precision, else why it is not one (for the caller's message)."""
    if isinstance(value, str) and value in PRECISIONS:
        return None
    if not isinstance(value, str):
        return "give exactly one precision, as a string"
    asked = [x for x in PRECISIONS if x in value.lower()]
    if len(asked) > 1:
        return (f"{' and '.join(asked)} cannot be combined (one compute precision per run: bf16 "
                "needs no loss scaling, fp16 uses dynamic loss scaling)")
    return "not a known precision"


def check_precision(value: Any) -> str:
    """``value`` if it is one of :data:`PRECISIONS`, else ``ValueError`` saying why."""
    problem = precision_problem(value)
    if problem is None:
        return value
    how = "exactly one, as a string" if not isinstance(value, str) else "exactly one"
    raise ValueError(f"precision must be one of {PRECISIONS} ({how}), got {value!r}; {problem}")


def weight_bytes(precision: str) -> int:
    """Bytes per element of the modules' weights under ``precision``.

    >>> weight_bytes("bf16"), weight_bytes("bf16-autocast")
    (2, 4)
    """
    return 2 if precision in ("bf16", "fp16") else 4


def compute_name(precision: str) -> str | None:
    """The autocast dtype's name under ``precision`` (None: no autocast).

    >>> compute_name("fp16-autocast"), compute_name("bf16"), compute_name("fp32")
    ('fp16', 'bf16', None)
    """
    return None if precision == "fp32" else precision.split("-")[0]


def loss_scaled(precision: str) -> bool:
    """Whether ``precision`` computes in fp16 (dynamic loss scaling).

    >>> loss_scaled("fp16-autocast"), loss_scaled("bf16")
    (True, False)
    """
    return precision.startswith("fp16")


def check_grad_accum_dtype(grad_accum_dtype: Any, precision: str) -> str:
    """``optimizer.grad_accum_dtype`` if it suits ``precision``, else ``ValueError``.

    fp32 (the default) accumulates gradients across microbatches in fp32 whatever the weights;
    a 16-bit accumulation must be the dtype of 16-bit weights (precision bf16 or fp16).
    """
    if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        raise ValueError(f"optimizer.grad_accum_dtype must be one of {GRAD_ACCUM_DTYPES}, got "
                         f"{grad_accum_dtype!r}")
    if grad_accum_dtype != "fp32" and grad_accum_dtype != precision:
        raise ValueError(
            f"optimizer.grad_accum_dtype={grad_accum_dtype!r} needs precision={grad_accum_dtype!r}"
            f" (16-bit weights, whose gradients can accumulate in their own dtype); with "
            f"precision={precision!r} gradients accumulate in fp32: set grad_accum_dtype=fp32")
    return grad_accum_dtype


def check_optimizer_name(name: Any) -> str:
    """The lower-cased optimizer name if it is one of :data:`OPTIMIZERS`, else ``ValueError``."""
    key = str(name).lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not supported: optimizer name must be one of "
                         f"{', '.join(OPTIMIZERS)}")
    return key


def check_zero_stage(stage: Any) -> int:
    """``stage`` as an int if it is one of :data:`ZERO_STAGES` (DeepSpeed's) or
    :data:`FSDP_ZERO_STAGE` (torch's FSDP2), else ``ValueError``."""
    if int(stage) not in ZERO_STAGES + (FSDP_ZERO_STAGE,):
        raise ValueError(f"zero_stage={stage} is not supported; use 0, 1 or 2 (DeepSpeed) or 3 "
                         "(FSDP2: parameters, gradients and optimizer state sharded)")
    return int(stage)


def check_nonfinite(value: Any) -> str:
    """``value`` if it is one of :data:`NONFINITE`, else ``ValueError``."""
    if value not in NONFINITE:
        raise ValueError(f"nonfinite must be 'raise' or 'skip', got {value!r}")
    return value


def check_step_sync(value: Any, backend: str = "torch") -> str:
    """``value`` if it is one of :data:`STEP_SYNCS` and the optimizer ``backend`` can take it:
    ``post_validate`` rolls back a rank's update, which only the torch backend can do.

    >>> check_step_sync("post_validate")
    'post_validate'
    """
    if value not in STEP_SYNCS:
        raise ValueError(f"step_sync must be one of {list(STEP_SYNCS)}, got {value!r}")
    if value == "post_validate" and backend != "torch":
        raise ValueError(f"step_sync='post_validate' needs the torch optimizer backend (it snapshots "
                         f"and rolls back the rank's parameters and optimizer state); the "
                         f"{backend} backend (zero_stage > 0, or 16-bit weights) cannot roll back "
                         "its update: use step_sync='global', or zero_stage=0 with fp32 weights "
                         "(precision fp32, bf16-autocast or fp16-autocast)")
    return value


def resolve_backend(backend: str, zero_stage: int, precision: str = "fp32") -> str:
    """``"torch"``, ``"deepspeed"`` or ``"fsdp"`` (``auto``: fsdp for ``zero_stage=3``, deepspeed
    iff ``zero_stage`` is 1 or 2 or the precision keeps 16-bit weights, whose fp32 masters live
    in DeepSpeed's optimizer).

    >>> resolve_backend("auto", 1), resolve_backend("auto", 0, "bf16")
    ('deepspeed', 'deepspeed')
    """
    if backend not in BACKENDS:
        raise ValueError(f"optimizer.backend must be auto, torch or deepspeed, got {backend!r}")
    if zero_stage == FSDP_ZERO_STAGE:
        if backend != "auto":
            raise ValueError(f"zero_stage=3 runs on torch's FSDP2, not the {backend} backend: set "
                             "optimizer.backend=auto (DeepSpeed's ZeRO-3 cannot run pipeline "
                             "stages), or use zero_stage 1 or 2 with DeepSpeed")
        return "fsdp"
    low = weight_bytes(precision) < 4
    if backend == "auto":
        return "deepspeed" if zero_stage > 0 or low else "torch"
    if backend == "torch" and zero_stage > 0:
        raise ValueError(f"zero_stage={zero_stage} needs backend='deepspeed' (or 'auto'); "
                         "the torch backend does not shard optimizer state")
    if backend == "torch" and low:
        raise ValueError(f"precision={precision!r} keeps {precision} weights with fp32 master "
                         "weights inside DeepSpeed's optimizer: use optimizer.backend=auto or "
                         f"deepspeed, or precision={precision}-autocast (fp32 weights) with the "
                         "torch backend")
    return backend


def check_recompute_granularity(value: Any) -> str:
    """``value`` as one of :data:`RECOMPUTE_GRANULARITIES`; ValueError naming them otherwise.

    >>> check_recompute_granularity("layer")
    'layer'
    """
    text = str(getattr(value, "value", value)).strip().lower()
    if text not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity={value!r}; use 'chunk' (one checkpoint per recomputing chunk: "
                         f"a held microbatch keeps the chunk's input) or 'layer' (one per layer: it keeps every "
                         f"layer's input, and a backward recomputes one layer at a time)")
    return text
