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

__all__ = ["OPTIMIZERS", "PRECISIONS", "ZERO_STAGES", "BACKENDS", "NONFINITE",
           "precision_problem", "check_precision", "check_optimizer_name", "check_zero_stage",
           "check_nonfinite", "resolve_backend"]

OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
ZERO_STAGES: tuple[int, ...] = (0, 1, 2)
BACKENDS: tuple[str, ...] = ("auto", "torch", "deepspeed")
NONFINITE: tuple[str, ...] = ("raise", "skip")


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


def check_optimizer_name(name: Any) -> str:
    """The lower-cased optimizer name if it is one of :data:`OPTIMIZERS`, else ``ValueError``."""
    key = str(name).lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not supported: optimizer name must be one of "
                         f"{', '.join(OPTIMIZERS)}")
    return key


def check_zero_stage(stage: Any) -> int:
    """``stage`` as an int if it is one of :data:`ZERO_STAGES`, else ``ValueError``."""
    if int(stage) not in ZERO_STAGES:
        raise ValueError(f"zero_stage={stage} is not supported; use 0, 1 or 2 (ZeRO-3 partitions "
                         "parameters, which a pipeline stage needs whole; every schedule works "
                         "with 0, 1 and 2)")
    return int(stage)


def check_nonfinite(value: Any) -> str:
    """``value`` if it is one of :data:`NONFINITE`, else ``ValueError``."""
    if value not in NONFINITE:
        raise ValueError(f"nonfinite must be 'raise' or 'skip', got {value!r}")
    return value


def resolve_backend(backend: str, zero_stage: int) -> str:
    """``"torch"`` or ``"deepspeed"`` (``auto``: deepspeed iff ``zero_stage > 0``).

    >>> resolve_backend("auto", 1)
    'deepspeed'
    """
    if backend not in BACKENDS:
        raise ValueError(f"optimizer.backend must be auto, torch or deepspeed, got {backend!r}")
    if backend == "auto":
        return "deepspeed" if zero_stage > 0 else "torch"
    if backend == "torch" and zero_stage > 0:
        raise ValueError(f"zero_stage={zero_stage} needs backend='deepspeed' (or 'auto'); "
                         "the torch backend does not shard optimizer state")
    return backend
