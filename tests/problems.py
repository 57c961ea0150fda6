"""Shared pieces of the parity tests: a split, the batches of a step, the single-process reference.

Every multi-process parity test trains some layers with the pipeline and compares the losses,
gradients and parameters with one process training the same layers on the same global batches.
The layers differ per test (each test module keeps its own factories); these helpers are the
rest. Module-level functions, so spawned workers import them too (``tests`` is on the path
through pytest's ``pythonpath``).

Example::

    from problems import batches, ranges, reference

    data = functools.partial(batches, seed=500, batch=16, in_dim=8, out_dim=4)
    ref = reference(factories(), data, OptimizerConfig(name="sgd", lr=0.1), steps=3, seed=3)
    ref["losses"], ref["params"]["0.weight"]
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from engine.optim import OptimizerConfig, lr_at, make_torch_optimizer
from engine.stage import build_layers
from partitioner.solve import uniform_split

__all__ = ["ranges", "batches", "reference"]


def ranges(num_layers: int, chunks: int) -> list[tuple[int, int]]:
    """Equal layer counts, the first chunks one more: the partitioner's ``uniform`` rule."""
    return uniform_split(num_layers, chunks)


def batches(step: int, *, seed: int, batch: int | Sequence[int], in_dim: int, out_dim: int,
            learnable: bool = False) -> tuple[Tensor, Tensor]:
    """The global batch ``(x, y)`` of ``step``: ``batch`` rows (or ``batch[step]``: the size may
    change between steps), random targets, or with ``learnable`` targets a noisy linear
    function of ``x`` (so that a loss can fall)."""
    g = torch.Generator().manual_seed(seed + step)
    n = batch if isinstance(batch, int) else batch[step]
    x = torch.randn(n, in_dim, generator=g)
    if learnable:
        return x, x[:, :out_dim] * 0.5 + 0.1 * torch.randn(n, out_dim, generator=g)
    return x, torch.randn(n, out_dim, generator=g)


def _tie(model: nn.Module, ties: Sequence[tuple[str, str]]) -> None:
    for a, b in ties:
        owner, _, leaf = b.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(a))


def reference(factories: Sequence[Callable[[], nn.Module]], data: Callable[[int], tuple],
              config: OptimizerConfig, steps: int | Sequence[int], *, seed: int = 0,
              loss_fn: Callable[..., Tensor] = nn.functional.mse_loss,
              ties: Sequence[tuple[str, str]] = (), autocast: torch.dtype | None = None
              ) -> dict[str, Any]:
    """One process trains all layers (built as the engine builds them) on whole batches.

    ``steps``: a count, or the data steps whose updates are applied in order (a skipped step's
    data left out); the lr follows ``lr_at`` over the applied steps. Returns ``losses``,
    ``grads`` (per step, before clipping), ``norms`` (global, before clipping), the final
    ``params`` by ``"<layer>.<name>"`` and the ``model``.
    """
    model = nn.Sequential(*build_layers(factories, 0, len(factories), seed))
    _tie(model, ties)
    opt = make_torch_optimizer(config, list(model.parameters()))
    losses, grads, norms = [], [], []
    for applied, step in enumerate(range(steps) if isinstance(steps, int) else steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(config, applied)
        x, y = data(step)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(x)
        loss = loss_fn(out.float(), y)
        opt.zero_grad()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if config.grad_clip:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)))
        else:
            norms.append(float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "norms": norms, "params": params, "model": model}
