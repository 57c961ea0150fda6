"""A configured model as a benchmark problem: BenchSpec from a config, profiling, link speed.

Everything here runs the measuring part in fresh single-threaded worker processes (the same
harness as the peers), so a profile is taken under the same conditions as the runs it predicts.

- :func:`bench_spec`: the config's model (``experiments.models``) and data
  (``experiments.data``) as a picklable :class:`~experiments.peers.spec.BenchSpec`.
- :func:`profile_model`: ``partitioner.profile(mode="measure")`` of every layer at the
  microbatch size, with the loss folded into the last layer (the last stage pays for it).
- :func:`measure_link`: one-way gloo loopback bandwidth for a message of the boundary's size.

Example::

    from experiments.bench.problem import bench_spec, profile_model, measure_link
    spec = bench_spec(cfg, stage_ranges=[(0, 4), (4, 8)])
    prof = profile_model(cfg)
    link = measure_link(prof.layers[3].output_bytes)
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from experiments.bench.measure import launch_fresh
from experiments.bench.spec import BenchSpec, uniform_ranges
from experiments.fields import choice_text

__all__ = ["DatasetBatches", "bench_spec", "profile_model", "measure_link", "LossLayer"]


class DatasetBatches:
    """``batches(step)`` of a BenchSpec from the config's dataset (built lazily in each worker,
    so a text corpus is read there instead of being pickled)."""

    def __init__(self, cfg: Any, batch: int) -> None:
        self.cfg, self.batch = cfg, batch
        self._ds: Any = None

    def __getstate__(self) -> dict:
        return {"cfg": self.cfg, "batch": self.batch, "_ds": None}

    def __call__(self, step: int) -> tuple[Tensor, Tensor]:
        if self._ds is None:
            from experiments.data import make_dataset

            self._ds = make_dataset(self.cfg)
        return self._ds.train_batch(step, self.batch)


def bench_spec(cfg: Any, stage_ranges: Sequence[tuple[int, int]] | None = None,
               chunk_ranges: Sequence[tuple[int, int]] | None = None) -> BenchSpec:
    """The configured model / data / batch / microbatches as a BenchSpec (SGD with
    ``optimizer.lr``; ``bench.steps`` timed after ``bench.warmup_steps``). ``stage_ranges``
    default to equal layer counts."""
    from experiments.models import build_model

    from experiments.config import as_config

    c = as_config(cfg)
    model = build_model(c.model)
    n = len(model.layers)
    p = int(c.pipeline.stages)
    return BenchSpec(
        layers=list(model.layers), loss_fn=model.loss_fn,
        batches=DatasetBatches(c, int(c.train.batch_size)),
        stage_ranges=tuple(tuple(r) for r in (stage_ranges or uniform_ranges(n, p))),
        chunk_ranges=None if chunk_ranges is None else tuple(tuple(r) for r in chunk_ranges),
        microbatches=int(c.pipeline.microbatches), steps=int(c.bench.steps),
        warmup=int(c.bench.warmup_steps), seed=int(c.train.seed),
        lr=float(c.optimizer.lr), name=model.name)


class LossLayer(nn.Module):
    """``loss_fn(x, target)`` as a layer, so the profiler times the loss with the last layer."""

    def __init__(self, loss_fn: Callable[[Tensor, Tensor], Tensor], target: Tensor) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.register_buffer("target", target, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.loss_fn(x, self.target)


def _profile_worker(cfg: Any, repeats: int, warmup: int, sweeps: int = 1, caches: str = "hot") -> Any:
    import partitioner
    from experiments.models import build_model
    from partitioner import LayerCost, Profile

    model = build_model(cfg.model)
    mb = int(cfg.train.batch_size) // int(cfg.pipeline.microbatches)
    x, y = DatasetBatches(cfg, mb)(0)
    layers = list(model.layers) + [functools.partial(LossLayer, model.loss_fn, y)]
    prof = partitioner.profile(layers, x, mode="measure", repeats=repeats, warmup=warmup, sweeps=sweeps,
                               caches=caches)
    *body, last, loss = prof.layers
    merged = LayerCost(
        forward_s=last.forward_s + loss.forward_s, backward_s=last.backward_s + loss.backward_s,
        param_bytes=last.param_bytes, activation_bytes=last.activation_bytes + loss.activation_bytes,
        output_bytes=last.output_bytes, weight_grad_s=last.weight_grad_s, name=last.name,
        largest_param_bytes=last.largest_param_bytes, param_numels=last.param_numels,
        input_grad_s=None if last.input_grad_s is None else last.input_grad_s + loss.input_s,
        shared_input_bytes=last.shared_input_bytes, pending_grad_bytes=last.pending_grad_bytes)
    meta = dict(prof.meta, loss_folded_into_last_layer=True, microbatch=mb)
    return Profile(list(body) + [merged], dtype=prof.dtype, meta=meta)


def profile_model(cfg: Any, *, repeats: int | None = None, warmup: int | None = None,
                  timeout_s: float = 600.0) -> Any:
    """``partitioner.Profile`` of the configured model at the microbatch size, measured in one
    fresh single-threaded process (``partitioner.repeats`` / ``warmup`` by default)."""
    from experiments.config import as_config

    c = as_config(cfg)
    part = c.partitioner
    return launch_fresh(_profile_worker, 1, c, int(repeats or part.repeats),
                        int(warmup if warmup is not None else part.warmup), int(part.sweeps),
                        choice_text(part.caches), timeout_s=timeout_s)[0]


def _link_worker(nbytes: int, repeats: int) -> float:
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    peer = 1 - rank
    times = []
    for k in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if k >= 2:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def measure_link(nbytes: int, *, repeats: int = 20, timeout_s: float = 120.0) -> float:
    """Bytes per second of a one-way gloo transfer of ``nbytes`` between two fresh local ranks
    (half the median round trip; latency included, so it is the effective rate at that size)."""
    one_way = launch_fresh(_link_worker, 2, int(nbytes), repeats, timeout_s=timeout_s)[0]
    return max(1, int(nbytes)) / max(one_way, 1e-9)
