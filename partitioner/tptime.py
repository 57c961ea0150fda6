"""Tensor-parallel layers timed as they run: DTensor over a real tp process group.

A tensor-parallel layout's profile is one tp rank's shapes as plain modules
(``experiments.wiring.tp_model_spec``): its bytes are the rank's, but its times miss what the run
adds on top of the rank's compute. The run executes each layer as DTensors (``engine.tp``'s
``parallelize_layer``, DTensor's ``parallelize_module``): every sharded Linear converts its input
and output (``from_local`` / ``to_local``, redistribution) and each op goes through DTensor's
dispatch in Python, on the rank's core (one Llama-style decoder block of d 256, a 4 x 128-token
microbatch: about 26 ms of CPU forward + backward as DTensor on a tp rank against 18 ms as plain
tp-rank shapes, docs/performance.md).

:func:`measure_tp_times` starts ``tensor_parallel`` local gloo ranks of one thread each
(``engine.launch``), builds every layer whole on each rank, shards it with the engine's own
``parallelize_layer`` over the tp mesh (``engine.mesh.Mesh.submesh("tp")``) and times it with the
profiler's own timing code (``partitioner.profile``: forward, whole backward and the engine's
split backward I / W, the median of timed runs, the median over sweeps), the last layer with the
loss as the engine's last chunk runs it. Every rank runs the same number of timed runs (agreed
before timing: the collectives must match), and a layer's figure is the mean over the ranks.

**Compute only** (the rule, stated in ``Profile.meta["tp_time"] == "dtensor"``): the clock is the
rank's own thread's CPU time (``time.thread_time``), so a figure holds the layer's compute and
DTensor's dispatch and redistribution work (``engine.launch`` runs each rank with one intra-op
thread, so all of its compute is on that thread), and not the tp collectives: gloo runs them on
its own threads while the rank's thread waits. Collectives the model issues outside DTensor (the
vocabulary-parallel loss's three all-reduces of ``[tokens]`` floats) are therefore in neither
the times nor the link charge (``megatron_allreduces`` leaves them out). The planner charges the collectives on top, once,
from the links as for any tp profile (``partitioner.planner``'s ``_collective_times``, the one
place; on the CPU the measured gloo fits, ``experiments.wiring.device_links``: the busy fit when
the job's ranks outnumber the cores, where a collective waits for its peer to get a core, which
no idle measurement of the layer would show). A wall-clock figure would hold the collectives as
they run on an idle pair, and count their waits as compute the simulator time-shares.
:func:`with_tp_times` puts the times into the plain-shape profile, whose bytes (parameters,
activations, outputs, workspace) stay as profiled.

Example::

    times = measure_tp_times(spec.layers, spec.example_input(4), 2, loss_fn=spec.loss_fn,
                             example_target=spec.example_target(4))
    prof = with_tp_times(partitioner.profile(tp_spec.layers, ...), times, 2)
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Sequence

from .costs import Profile

__all__ = ["measure_tp_times", "with_tp_times", "TP_TIME_KEY", "TIMES"]

TP_TIME_KEY = "tp_time"
"""``Profile.meta`` key of a tp rank's profile: ``"dtensor"`` (the layers' compute timed as DTensor
over a tp group, :func:`measure_tp_times`) or ``"shapes"`` (plain modules of one tp rank's shapes,
or counted analytically); both without the tp collectives, which the planner adds."""

TIMES = ("forward_s", "backward_s", "input_grad_s", "weight_grad_s")
"""The time figures :func:`measure_tp_times` gives per layer (``LayerCost``'s)."""


def measure_tp_times(layers: Any, example_input: Any, tensor_parallel: int, *, dtype: Any = None,
                     autocast: Any = None, repeats: int = 5, warmup: int = 2, sweeps: int = 1,
                     min_time_s: float = 0.2, weight_grad: bool = True, loss_fn: Callable | None = None,
                     example_target: Any = None, timeout_s: float = 900.0) -> list[dict[str, float | None]]:
    """Per layer, ``{forward_s, backward_s, input_grad_s, weight_grad_s}`` of the whole
    ``layers`` (factories of the un-sharded model's layers, picklable) run as DTensor tensor
    parallelism on ``tensor_parallel`` local gloo ranks of one thread each on the CPU, in each
    rank's thread's CPU time (compute only: module docstring). ``dtype``: the layers' and
    inputs' floating dtype (default: keep); ``autocast``: a 16-bit compute dtype to run under ``torch.autocast`` (as the engine does with
    ``bf16-autocast``); ``loss_fn`` / ``example_target``: the last layer timed with the loss.
    ``repeats``, ``warmup``, ``sweeps``, ``min_time_s``: as ``partitioner.profile``'s (a layer
    runs until ``min_time_s`` is timed, the same count on every rank). ``input_grad_s`` is None
    where the layer takes no input gradient (or ``weight_grad`` is off)."""
    from engine.launch import launch

    from .profile import layer_sources

    tp = int(tensor_parallel)
    if tp < 2:
        raise ValueError(f"measure_tp_times needs tensor_parallel >= 2, got {tp}")
    if repeats < 1 or warmup < 0 or sweeps < 1:
        raise ValueError("repeats and sweeps must be >= 1 and warmup >= 0")
    if (loss_fn is None) != (example_target is None):
        raise ValueError("loss_fn and example_target go together (the last layer timed with the loss)")
    settings = {"dtype": dtype, "autocast": autocast, "repeats": int(repeats), "warmup": int(warmup),
                "sweeps": int(sweeps), "min_time_s": float(min_time_s), "weight_grad": bool(weight_grad),
                "loss_fn": loss_fn, "target": example_target}
    items = list(layers)
    layer_sources(items)   # refuse what is no layer before starting ranks
    per_rank = launch(_tp_worker, tp, items, example_input, settings,
                      timeout_s=timeout_s, backend="gloo", local=True)
    return [{f: _mean([r[i][f] for r in per_rank]) for f in TIMES} for i in range(len(per_rank[0]))]


def _mean(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.fmean(values)  # type: ignore[arg-type]


def with_tp_times(profile: Profile, times: Sequence[dict[str, float | None]], tensor_parallel: int) -> Profile:
    """``profile`` (one tp rank's shapes) with its layers' time figures replaced by ``times``
    (:func:`measure_tp_times`) and ``meta["tp_time"] = "dtensor"``: the bytes stay, and the
    planner charges the tp collectives on top as for any tp profile.

    >>> from partitioner import LayerCost
    >>> prof = Profile([LayerCost(1.0, 2.0, 8, 16, 4, weight_grad_s=1.0, input_grad_s=1.2)])
    >>> out = with_tp_times(prof, [dict(forward_s=3.0, backward_s=5.0, input_grad_s=2.5, weight_grad_s=3.0)], 2)
    >>> out.layers[0].forward_s, out.layers[0].param_bytes, out.meta["tp_time"]
    (3.0, 8, 'dtensor')
    """
    if len(times) != len(profile):
        raise ValueError(f"{len(times)} timed layers for a profile of {len(profile)}; time the same model's layers")
    layers = [dataclasses.replace(c, **{f: t[f] for f in TIMES}) for c, t in zip(profile.layers, times)]
    return dataclasses.replace(profile, layers=layers, meta=dict(profile.meta, **{
        TP_TIME_KEY: "dtensor", "tensor_parallel": int(tensor_parallel)}))


# ---- the ranks ---------------------------------------------------------------------------------
def _tp_worker(items: list, example_input: Any, settings: dict) -> list[dict[str, float | None]]:
    """One tp rank: every layer sharded over the tp mesh and timed, ``sweeps`` times; per layer
    the median over the sweeps. A module given as a layer is copied for each sweep (sharding
    changes it in place)."""
    import contextlib
    import copy

    import torch

    from engine.mesh import Mesh

    sources = [(lambda m=m: copy.deepcopy(m)) if isinstance(m, torch.nn.Module) else m for m in items]

    tp_mesh = Mesh(1, 1, torch.distributed.get_world_size()).submesh("tp")
    compute = settings["autocast"]
    ctx: Any = torch.autocast("cpu", dtype=compute) if compute is not None else contextlib.nullcontext()
    with ctx:
        runs = [_tp_sweep(sources, example_input, tp_mesh, settings) for _ in range(settings["sweeps"])]
    return [{f: _median([r[i][f] for r in runs]) for f in TIMES} for i in range(len(sources))]


def _median(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.median(values)  # type: ignore[arg-type]


def _tp_sweep(sources: list, example_input: Any, tp_mesh: Any, settings: dict) -> list[dict[str, float | None]]:
    """Every layer once, as ``partitioner.profile``'s measuring sweep: each gets the previous
    one's output (detached, requiring grad), the last one with the loss."""
    import torch

    from engine.tp import parallelize_layer

    from .profile import _build, _loss_module, _map, _prep_input, _tensors, _time_layer, split_times

    dev, dtype = torch.device("cpu"), settings["dtype"]
    x = _prep_input(example_input, dev, dtype, False)
    out: list[dict[str, float | None]] = []
    for i, src in enumerate(sources):
        def make(src: Callable = src) -> Any:
            return parallelize_layer(_build(src, dev, dtype), tp_mesh)

        last = i == len(sources) - 1 and settings["loss_fn"] is not None
        layer = _loss_module(make, settings["loss_fn"], settings["target"]) if last else make()
        o = layer(x)
        nxt = _map(lambda t: t.detach(), o)
        grads = [torch.ones_like(t) for t in _tensors(o) if t.requires_grad]
        params = [p for p in layer.parameters() if p.requires_grad]
        xs = [t for t in _tensors(x) if t.requires_grad]
        del o
        n = _agreed_repeats(layer, x, grads, params, xs, settings)
        f_s, b_s, split, _ = _time_layer(layer, x, grads, params, xs, dev, n, settings["warmup"],
                                         settings["weight_grad"], 0.0, kept_bytes=False,
                                         clock=time.thread_time)
        i_s, w_s = split_times(b_s, split, bool(params), bool(xs))
        out.append({"forward_s": f_s, "backward_s": b_s, "input_grad_s": i_s, "weight_grad_s": w_s})
        x = _map(lambda t: t.requires_grad_(True) if t.is_floating_point() else t, nxt)
        del layer, nxt
    return out


def _agreed_repeats(layer: Any, x: Any, grads: list, params: list, xs: list, settings: dict) -> int:
    """The timed runs every rank makes of ``layer``: enough for ``min_time_s`` by one untimed
    forward + backward (twice that with the split backward), the slowest rank's, within
    ``[repeats, partitioner.profile``'s cap``]``."""
    import torch
    import torch.distributed as dist

    from .profile import _MAX_REPEATS, _tensors

    t0 = time.perf_counter()
    o = [t for t in _tensors(layer(x)) if t.requires_grad]
    if o and params + xs:
        torch.autograd.backward(o, grads, inputs=params + xs)
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    per_run = float(took) * (2.0 if settings["weight_grad"] and params and xs else 1.0)
    want = math.ceil(settings["min_time_s"] / max(per_run, 1e-9))
    return int(min(max(settings["repeats"], want), _MAX_REPEATS))
