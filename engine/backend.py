"""Which optimizer backend a rank gets: the torch one (``engine.optim``), DeepSpeed ZeRO 1-2
(``engine.zero``) or FSDP2 for ZeRO-3 (``engine.fsdp``).

Example::

    cfg = OptimizerConfig(name="adamw", lr=1e-3, zero_stage=1)       # zero_stage > 0: DeepSpeed
    opt = make_optimizer(cfg, nn.ModuleDict({"0": layer0}), mesh, microbatches=4)
    opt.backward([opt.scale_loss(loss)], None)
    skipped, grad_norm = opt.step()
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from engine.optim import (
    OptimizerConfig,
    StageOptimizer,
    TorchStageOptimizer,
    check_optimizer_config,
)

__all__ = ["make_optimizer"]


def make_optimizer(config: OptimizerConfig, module: torch.nn.Module, mesh: Any, *,
                   microbatches: int, precision: str = "fp32", nonfinite: str = "raise",
                   norm_skip: Iterable[str] = ()) -> StageOptimizer:
    """Build this rank's optimizer backend.

    ``module``: this rank's layers, e.g. ``nn.ModuleDict({"3": layer3, "4": layer4})``, so that
    parameter names are ``"<global layer>.<param name>"`` (checkpoints re-split by these names);
    ``norm_skip``: names counted elsewhere in the global norm (the second copy of a tied
    parameter). The DeepSpeed backend is imported only when selected.
    """
    backend = check_optimizer_config(config, precision)
    if getattr(mesh, "tensor_parallel", 1) > 1 and backend != "fsdp":
        from engine.tp import TpStageOptimizer
        return TpStageOptimizer(config, dict(module.named_parameters()), mesh,
                                microbatches=microbatches, precision=precision,
                                nonfinite=nonfinite, norm_skip=norm_skip)
    if backend == "fsdp":
        from engine.fsdp import FsdpStageOptimizer, resolve_reshard
        return FsdpStageOptimizer(config, module, mesh, microbatches=microbatches,
                                  precision=precision, nonfinite=nonfinite, norm_skip=norm_skip,
                                  reshard_after_forward=resolve_reshard(
                                      getattr(config, "reshard_after_forward", "auto")))
    if backend == "deepspeed":
        from engine.zero import DeepSpeedStageOptimizer  # lazy: DeepSpeed is heavy
        return DeepSpeedStageOptimizer(config, module, dp_group=mesh.dp_group,
                                       pipeline_group=mesh.pipeline_group,
                                       microbatches=microbatches, precision=precision,
                                       nonfinite=nonfinite, norm_skip=norm_skip)
    return TorchStageOptimizer(config, dict(module.named_parameters()), mesh,
                               microbatches=microbatches, precision=precision,
                               nonfinite=nonfinite, norm_skip=norm_skip)
