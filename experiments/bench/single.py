"""The single-process reference: the whole model in one fresh process (or p at once), SGD.

Four modes, each a row with ``system="single"``:

- ``"microbatched"`` (the reference for ``ideal_step_s``): the global batch split into the
  same ``m`` microbatches as the pipelines, forward + backward of ``loss_i / m`` each, gradients
  accumulated, one optimizer step. It does exactly the work a pipeline does, minus transfers
  and bubbles, so ``single / p x (m + p - 1) / m`` is what a perfectly balanced pipeline of
  p stages would take.
- ``"full-batch"``: one forward + backward of the whole batch (``microbatches=1``): what a
  user without a pipeline would run; usually faster per sample (bigger matmuls).
- ``"loaded"``: the microbatched step run by ``min(p, cpus)`` processes at once, in step (a
  barrier per step), the row's step being the slowest copy's: the same compute with the machine
  as busy as under a pipeline of p ranks (memory bandwidth, caches and the OS shared). Its ratio
  to ``"microbatched"`` is the slowdown the pipeline's compute sees from the other ranks; the
  bench calibrates its predictions on it (``experiments.bench.predict.calibrate``).
- ``"loaded-split"``: ``"loaded"`` with the backward split as zero-bubble schedules run it: layer
  0 is one engine chunk, the rest another (``engine.stage.Chunk``, its own I/W split), and each
  microbatch runs F, then I, the first layer's whole backward, then W. The bench runs it when a
  benched schedule splits the backward and prices the split with it: the profile times I and W
  one layer at a time, and a factor fitted to the plain step need not price the split as the
  whole model runs it (on the equal-layer MLP the split's own factor came out 1.25-1.27 against
  1.15-1.18, docs/performance.md).

Example::

    from experiments.bench.single import run_single
    from experiments.bench.spec import tiny_spec

    run_single(tiny_spec(), mode="microbatched")["step_s"]
"""

from __future__ import annotations

import os
from typing import Any

import torch

from experiments.bench.trace import traced
from experiments.bench.measure import launch_fresh, make_row, named_params, timed_loop
from experiments.bench.spec import BenchSpec, build_chunk

__all__ = ["run_single", "loaded_copies", "SINGLE_MODES", "SPLIT_MODE"]

SINGLE_MODES = ("microbatched", "full-batch", "loaded")
SPLIT_MODE = "loaded-split"  # a calibration row, run only beside split-backward schedules


def _single_worker(spec: BenchSpec, mode: str, return_params: bool) -> dict[str, Any]:
    model = build_chunk(spec, 0, spec.num_layers)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    m = 1 if mode == "full-batch" else spec.microbatches

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for x, y in zip(inputs.tensor_split(m), targets.tensor_split(m)):
            loss = spec.loss_fn(model(x), y)
            (loss / m).backward()
            total += loss.detach()
        opt.step()
        return float(total / m)

    result = timed_loop(spec, _split_step(model, opt, spec) if mode == SPLIT_MODE else step)
    if return_params:
        result["params"] = named_params([model])
    return result


class _Seed:
    """What ``engine.stage.Chunk`` asks of an optimizer in backward: the loss seeded with 1 / m."""

    def __init__(self, m: int) -> None:
        self.m = m

    def loss_grad(self, loss: torch.Tensor) -> torch.Tensor:
        return torch.full_like(loss, 1.0 / self.m)

    @staticmethod
    def backward(tensors: Any, grad_tensors: Any, inputs: Any = None,
                 retain_graph: bool = False) -> None:
        torch.autograd.backward(list(tensors), grad_tensors, inputs=inputs,
                                retain_graph=retain_graph)


def _split_step(model: torch.nn.Sequential, opt: Any, spec: BenchSpec) -> Any:
    """The ``"loaded-split"`` step: layer 0 and the rest as two engine chunks, per microbatch F,
    I, the first chunk's whole backward, W (the same gradients as the plain step)."""
    from engine.stage import Chunk

    layers, m = list(model), spec.microbatches
    head = Chunk(0, 0, layers[:1], measure_activations=False)
    rest = Chunk(1, 1, layers[1:], loss_fn=spec.loss_fn, measure_activations=False)
    seed = _Seed(m)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs.tensor_split(m), targets.tensor_split(m))):
            h = head.forward(i, x)
            loss = rest.forward(i, h.detach().requires_grad_(h.requires_grad), y, split=True)
            gx = rest.backward_input(i, None, seed)
            head.backward(i, gx, seed)
            rest.backward_weight(i, seed)
            total += loss.detach()
        opt.step()
        return float(total / m)

    return step


def run_single(spec: BenchSpec, *, mode: str = "microbatched", return_params: bool = False,
               timeout_s: float = 600.0) -> dict[str, Any]:
    """One row: the whole model in one fresh process (see the module docstring for ``mode``)."""
    if mode not in (*SINGLE_MODES, SPLIT_MODE):
        raise ValueError(f"mode must be one of {(*SINGLE_MODES, SPLIT_MODE)}, got {mode!r}")
    spec = traced(spec, f"single_{mode}")
    copies = loaded_copies(spec) if mode in ("loaded", SPLIT_MODE) else 1
    results = launch_fresh(_single_worker, copies, spec, mode, return_params, timeout_s=timeout_s)
    m = 1 if mode == "full-batch" else spec.microbatches
    row = make_row("single", mode, spec, results, stages=1, microbatches=m)
    row["copies"] = copies
    return row


def loaded_copies(spec: BenchSpec) -> int:
    """How many copies the ``"loaded"`` mode runs: one per pipeline rank, at most one per CPU."""
    return max(1, min(spec.num_stages, os.cpu_count() or 1))
