"""pipeshard's engine: schedules as data, a simulator, and the multi-process pipeline runtime.

Names are resolved lazily (PEP 562), so ``import engine`` (and ``engine.schedules``, which the
partitioner uses) does not import torch, DeepSpeed or anything else heavy.

Example::

    from engine import Pipeline, OptimizerConfig, launch
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Pipeline": "engine.runtime", "StepResult": "engine.runtime",
    "check_stage_ranges": "engine.runtime",
    "OptimizerConfig": "engine.optim", "StageOptimizer": "engine.optim",
    "TorchStageOptimizer": "engine.optim", "make_optimizer": "engine.backend",
    "lr_at": "engine.optim", "NonFiniteError": "engine.optim", "LossScaler": "engine.optim",
    "launch": "engine.launch", "WorkerError": "engine.launch",
    "Mesh": "engine.mesh", "CommError": "engine.comm",
    "Action": "engine.schedules", "Comm": "engine.schedules", "Schedule": "engine.schedules",
    "ScheduleError": "engine.schedules", "SCHEDULES": "engine.schedules",
    "SCHEDULE_INFO": "engine.schedules", "ScheduleInfo": "engine.schedules",
    "chunk_ranks": "engine.schedules",
    "build_schedule": "engine.schedules", "validate": "engine.schedules",
    "lower": "engine.schedules",
    "simulate": "engine.simulate", "SimResult": "engine.simulate",
    "Generator": "engine.generate", "SamplingConfig": "engine.generate",
    "GenerationResult": "engine.generate", "CachedChunk": "engine.generate",
}

__all__ = sorted(_EXPORTS)

# `launch` and `simulate` are both a submodule and a function: bind the functions now, so that a
# later `import engine.launch` elsewhere cannot shadow them (both modules are light).
from engine.launch import launch  # noqa: E402
from engine.simulate import simulate  # noqa: E402
import engine.autoschedule  # noqa: E402,F401 - registers zb-auto's builder with engine.schedules


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
