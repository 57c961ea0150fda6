"""Per-layer costs by measurement on a device or by counting on the meta device.

``layers`` is an ``nn.Sequential``, a list of modules, or a list of zero-argument factories
(one per layer; a factory is called once, so a model larger than memory can be profiled).
Layers are called like ``nn.Sequential`` does: each gets the previous layer's output as its
single argument (a tensor or a tuple of tensors).

Example::

    import torch, torch.nn as nn
    from partitioner import profile
    layers = [lambda: nn.Linear(256, 256) for _ in range(4)]
    prof = profile(layers, torch.randn(32, 256), mode="measure", repeats=3)
    big = profile(layers, torch.randn(32, 256), mode="analytic", device_spec="h100")

"measure": forward, backward and (with ``weight_grad=True``) the split backward of zero-bubble
schedules are timed with warm-up and the median of ``repeats`` (device synchronisation on CUDA).
The backward runs as the engine's does (gradients accumulate into ``.grad``); the split is the
engine's own (``engine.stage.Chunk``: forward with ``split=True``, ``backward_input`` timed as
``input_grad_s``, ``backward_weight`` as ``weight_grad_s``), so a schedule that splits is charged
what splitting costs (a second pass over the graph; I + W exceeds the whole backward by about
10% on a transformer block on CPU). Activation bytes are the storages the layer
saves for backward (``saved_tensors_hooks``), deduplicated by storage, without parameters and
buffers, and without the layer's input when the previous layer already saved that same tensor
(it is counted once, by the producer). The gradients a microbatch keeps between its I and its
deferred W (``pending_grad_bytes``, zero-bubble schedules) are the distinct storages the same
split path keeps after ``backward_input``.

With ``loss_fn`` and ``example_target`` (both modes) the last layer is profiled together with
the loss, as the engine's last chunk runs it (``loss_fn(last_layer(x), target)``): its times
include the loss's forward and backward, its ``activation_bytes`` what the loss saves (an LM's
fp32 upcast log-softmax), and its ``workspace_bytes`` the backward's transient measured by
torch's ``MemTracker`` (the gradient of the logits and its copies; parameter gradients and
the saved tensors excluded). ``loss_variants`` (``{name: (last_layer_factory, loss_fn)}``, e.g. the other LM
head) profiles the last layer again for each variant with its loss; the costs go to
``Profile.meta["loss_variants"]`` (``{name: LayerCost as a dict}``) so the planner can say when
another head would fit. Without ``loss_fn`` the loss is not in the profile.

"analytic": every layer is built under ``torch.device("meta")`` (nothing is allocated). Each
aten op of the forward and of the backward is costed by ``device_spec``: per op class (GEMM
by its shape, fused attention, memory-bound; ``partitioner.kernels``, docs/device-model.md) on the
GPU presets and calibrated specs, else by its flat roofline
(``max(flops / peak, bytes / bandwidth) + overhead``), FLOPs from
``torch.utils.flop_counter`` (its registry, cross-checked by ``FlopCounterMode``) and bytes from
the op's tensor shapes. ``pending_grad_bytes`` is the output bytes of the ops that take a
parameter (the gradients the split backward records at the weight-owning nodes).
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from typing import Any, Callable

from engine.caches import CacheEvictor, check_caches
from .costs import LayerCost, Profile
from .devices import ATTENTION_BACKENDS, DeviceSpec, get_device_spec
from .meta import meta_device

__all__ = ["forward_op_times", "profile", "layer_sources", "split_times"]


def layer_sources(layers: Any) -> list[Callable[[], Any]]:
    """Normalise ``layers`` to a list of zero-argument callables returning a module."""
    import torch.nn as nn

    if isinstance(layers, nn.Module):
        if not isinstance(layers, nn.Sequential):
            raise TypeError("pass an nn.Sequential, a list of modules, or a list of zero-argument factories; "
                            f"got a single {type(layers).__name__}")
        layers = list(layers)
    out = []
    for i, item in enumerate(layers):
        if isinstance(item, nn.Module):
            out.append((lambda m=item: m))
        elif callable(item):
            out.append(item)
        else:
            raise TypeError(f"layer {i}: expected an nn.Module or a zero-argument factory, got {type(item).__name__}")
    if not out:
        raise ValueError("layers is empty")
    return out


def _tensors(obj: Any) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _map(fn: Callable, obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map(fn, o) for o in obj)
    if isinstance(obj, list):
        return [_map(fn, o) for o in obj]
    if isinstance(obj, dict):
        return {k: _map(fn, v) for k, v in obj.items()}
    return obj


def _shapes(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return tuple(obj.shape)
    if isinstance(obj, (tuple, list)):
        return tuple(_shapes(o) for o in obj)
    return type(obj).__name__


def _prep_input(x: Any, device, dtype, requires_grad: bool) -> Any:
    def f(t):
        t = t.detach()
        if device is not None and t.device != device:
            t = t.to(device) if device.type != "meta" else t.new_empty(t.shape, device="meta")
        if t.is_floating_point():
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
            t.requires_grad_(requires_grad)
        return t

    return _map(f, x)


def _param_numels(layer: Any) -> tuple[int, ...]:
    """The elements of each trainable parameter tensor, in ``parameters()`` order."""
    return tuple(int(p.numel()) for p in layer.parameters() if p.requires_grad)


def _largest_param_bytes(layer: Any) -> int:
    """Bytes of the layer's largest parameter tensor (0 without parameters)."""
    return max((p.numel() * p.element_size() for p in layer.parameters()), default=0)


def _storage_key(t) -> int:
    return t.untyped_storage()._cdata


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _call(layer, x, i: int, prev_name: str, name: str):
    try:
        return layer(x)
    except Exception as e:  # noqa: BLE001 - re-raised with both layers named
        src = "example_input" if i == 0 else f"the output of layer {i - 1} ({prev_name})"
        raise ValueError(
            f"layer {i} ({name}) cannot take {src} with shapes {_shapes(x)}: {type(e).__name__}: {e}. "
            "Check that consecutive layers agree on shapes (each layer gets the previous output as its single argument)."
        ) from e


def _forward_saved(layer, x, i, prev_name, name, skip_keys):
    """One forward under saved_tensors_hooks; returns (out, activation_bytes, saved_keys,
    shared_bytes), shared_bytes being what it saved of storages in ``skip_keys``."""
    import torch

    exclude = {_storage_key(p) for p in layer.parameters()} | {_storage_key(b) for b in layer.buffers()}
    saved: dict[int, int] = {}
    shared: dict[int, int] = {}

    def pack(t):
        k = _storage_key(t)
        if k in skip_keys:
            shared[k] = t.untyped_storage().nbytes()
        elif k not in exclude and k not in saved:
            saved[k] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _call(layer, x, i, prev_name, name)
    return out, sum(saved.values()), set(saved), sum(shared.values())


def _output_saved_bytes(out_tensors: list, saved_keys: set[int]) -> int:
    """Bytes of a layer's output storages that the layer saved for backward itself."""
    seen = {_storage_key(t): t.untyped_storage().nbytes() for t in out_tensors}
    return sum(nb for k, nb in seen.items() if k in saved_keys)


def _backward(outs, inputs, grads):
    import torch

    if outs and inputs:
        torch.autograd.grad(outs, inputs, grads, allow_unused=True)


def profile(layers: Any, example_input: Any, *, mode: str = "measure", device: Any = None, dtype: Any = None,
            repeats: int = 5, warmup: int = 2, weight_grad: bool = True, min_time_s: float = 0.2,
            sweeps: int = 1, device_spec: "str | DeviceSpec | None" = None, cache: bool = True,
            attention: str | None = None, loss_fn: Callable | None = None, example_target: Any = None,
            loss_variants: dict[str, tuple[Callable, Callable]] | None = None, caches: str = "hot") -> Profile:
    """Profile every layer; see the module docstring. Returns a :class:`Profile`.

    ``device``: where "measure" runs (default: CPU). ``repeats`` is the least number of timed
    runs per layer: a fast layer runs until its timed runs add up to ``min_time_s`` (at most
    40 runs), since the median of five runs of a millisecond is noise on a shared machine.
    ``sweeps`` > 1 profiles the whole model that many times, one layer after the other each
    time, and keeps each time figure's median over the sweeps: a slow spell of the machine
    then hits one sweep of a layer, not the layer's figure (identical blocks measured 1.6-3.0 ms
    apart within one sweep on this 2-core machine). ``dtype``: cast floating parameters and
    inputs (default: keep). ``device_spec``: for "analytic" (a preset name or a
    :class:`DeviceSpec`; default ``"cpu"``, measured once). ``cache`` (analytic only): cost
    identical layers once (same class, parameter shapes, plain attributes of every submodule
    such as a head count, and input shapes). ``attention`` (analytic only): the SDPA backend
    the target runs, one of :data:`ATTENTION_BACKENDS` (default: the device spec's, flash on
    the presets): ``F.scaled_dot_product_attention`` is costed through that kernel, so a
    flash/efficient attention saves O(s) per head, not the s x s probabilities of the meta
    device's math path. "measure" runs the device's own choice. ``loss_fn`` /
    ``example_target`` (one microbatch's target) / ``loss_variants``: the loss profiled with the
    last layer (module docstring). ``caches`` ("measure"): ``"hot"`` times each layer as it
    repeats (the default: what plans use); ``"cold"`` first reads other data through the caches
    before each timed phase, an instrument to bound what the caches cost a step
    (:mod:`engine.caches`; the profile's meta says which).
    """
    import torch

    if mode not in ("measure", "analytic"):
        raise ValueError(f"mode must be 'measure' or 'analytic', got {mode!r}")
    if repeats < 1 or warmup < 0 or sweeps < 1:
        raise ValueError("repeats and sweeps must be >= 1 and warmup >= 0")
    sources = _with_loss(layer_sources(layers), loss_fn, example_target, loss_variants)
    tdtype = dtype if (dtype is None or isinstance(dtype, torch.dtype)) else getattr(torch, str(dtype))
    # The engine differentiates a chunk's inputs only where they require grad (engine.stage): the
    # first chunk's input is the data (token ids, or float features that do not require grad), so
    # its I has nothing to do and it runs its whole, unsplit backward at W, keeping its output
    # gradient until then. The time and memory models read this from here.
    grad_in = any(t.is_floating_point() and t.requires_grad for t in _tensors(example_input))
    if mode == "analytic":
        spec = get_device_spec(device_spec or "cpu")
        backend = attention or spec.attention
        with _attention_mode(backend, spec):
            prof = _profile_analytic(sources, example_input, tdtype, spec, cache)
        prof.meta.update(attention=backend, input_requires_grad=grad_in)
        return _loss_meta(_with_optimizer_costs(prof, spec), loss_fn)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "meta":
        raise ValueError("mode='measure' needs a real device; use mode='analytic' for the meta device")
    if check_caches(caches) == "cold" and dev.type != "cpu":
        raise ValueError(f"caches='cold' evicts the CPU's caches, not a {dev.type} device's: profile on "
                         f"{dev.type} with caches='hot' (partitioner.caches=hot)")
    evict = CacheEvictor() if caches == "cold" else None
    runs = [_profile_measure(sources, example_input, dev, tdtype, repeats, warmup, weight_grad,
                             min_time_s, evict=evict) for _ in range(sweeps)]
    prof = _median_profile(runs)
    prof.meta.update(input_requires_grad=grad_in, caches=caches)
    return _loss_meta(prof, loss_fn)


class LayerWithLoss:
    """Marks the last source when the loss is profiled with it: ``variants`` are the other
    heads' sources (``{name: source}``), profiled on the same input."""

    def __init__(self, source: Callable, variants: dict[str, Callable]) -> None:
        self.source, self.variants = source, variants

    def __call__(self) -> Any:
        return self.source()


def _loss_module(factory: Callable, loss_fn: Callable, target: Any) -> Any:
    import torch.nn as nn

    class _WithLoss(nn.Module):
        """``loss_fn(layer(x), target)``: the last layer as the engine's last chunk runs it."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = factory()
            if not isinstance(self.layer, nn.Module):
                raise TypeError(f"a layer factory returned {type(self.layer).__name__}, expected an nn.Module")

        def forward(self, x: Any) -> Any:
            return loss_fn(self.layer(x), _map(lambda t: t.to(_device_of(x)), target))

        @property
        def loss_fn(self) -> Callable:
            return loss_fn

        @property
        def target(self) -> Any:
            return target

    _WithLoss.__name__ = "WithLoss"
    return _WithLoss()


def _device_of(x: Any):
    return next(t.device for t in _tensors(x))


def _with_loss(sources: list, loss_fn: Callable | None, target: Any,
               variants: dict[str, tuple[Callable, Callable]] | None) -> list:
    """``sources`` with the last one running the loss too (and its variants), or unchanged."""
    if loss_fn is None:
        if target is not None or variants:
            raise ValueError("example_target / loss_variants need loss_fn (the loss to profile with the last layer)")
        return sources
    if target is None:
        raise ValueError("loss_fn needs example_target: one microbatch's target (e.g. spec.example_target(mb))")
    last = sources[-1]
    others = {name: (lambda f=f, fn=fn: _loss_module(f, fn, target)) for name, (f, fn) in (variants or {}).items()}
    return sources[:-1] + [LayerWithLoss(lambda: _loss_module(last, loss_fn, target), others)]


def _loss_meta(prof: Profile, loss_fn: Callable | None) -> Profile:
    if loss_fn is not None:
        prof.meta["loss"] = _callable_name(loss_fn)
    return prof


def _callable_name(fn: Callable) -> str:
    """``lm_loss``, ``chunked_lm_loss(chunk=1024)``: a label for the profile's meta."""
    import functools

    if isinstance(fn, functools.partial):
        args = ", ".join(f"{k}={v}" for k, v in fn.keywords.items())
        return f"{_callable_name(fn.func)}({args})"
    return getattr(fn, "__name__", type(fn).__name__)


def _loss_workspace(layer, x) -> int:
    """The transient of the loss layer's backward (MemTracker's temporaries at the backward's
    peak: the logits' gradient and its copies; parameter gradients and the saved tensors,
    alive before, are not counted), on any device, the meta device included."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return 0
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    saved: list = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = layer(x)
    tracker = MemTracker()
    # the saved tensors exist before the backward: known to the tracker, a backward that
    # unpacks (detaches) one does not count it as a new temporary
    tracker.track_external(layer, *saved, *_tensors(x))
    with tracker:
        torch.autograd.backward([loss], inputs=params)   # into .grad: MemTracker books them as gradients
    for p, g in zip(params, kept):
        p.grad = g
    peak = tracker.get_tracker_snapshot("peak")
    temp = 0
    for per_kind in peak.values():
        temp = max(temp, sum(int(v) for k, v in per_kind.items() if getattr(k, "value", str(k)) == "Temp"))
    return temp


def _with_loss_costs(cost: LayerCost, src: LayerWithLoss, layer, x, variants: dict[str, dict],
                     profile_one: Callable) -> LayerCost:
    """The loss layer's cost with its backward workspace; fills ``variants`` with the other
    heads' costs on the same input (``profile_one(source) -> LayerCost``)."""
    import dataclasses

    for name, other in src.variants.items():
        variants[name] = dataclasses.asdict(profile_one(LayerWithLoss(other, {})))
    given, saved = _loss_cut_bytes(layer, x)
    return dataclasses.replace(cost, workspace_bytes=_loss_workspace(layer, x), loss_input_bytes=given,
                               loss_saved_bytes=saved)


def _loss_cut_bytes(layer, x) -> tuple[int, int]:
    """``(loss_input_bytes, loss_saved_bytes)`` of a ``_WithLoss`` layer (see ``LayerCost``):
    the float tensors its layer hands to the loss (0 when that is no tensor or flat tuple of
    tensors: a fused head, one graph with its loss) and the distinct storages the loss alone
    saves for backward (parameters excluded), on any device, the meta device included."""
    import torch

    from engine.comm import flatten, unflatten

    with torch.no_grad():
        out = layer.layer(x)
    try:
        tensors = flatten(out)[1]
    except TypeError:
        return 0, 0
    is_tuple, _ = flatten(out)
    given = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    # the layer's own output is kept by its segment whether or not the loss saves it
    known = {t.untyped_storage()._cdata for t in [*layer.parameters(), *tensors]}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in known:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.loss_fn(unflatten(is_tuple, given), _map(lambda t: t.to(_device_of(x)), layer.target))
    return sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point()), sum(seen.values())


def _variants_meta(variants: dict[str, dict]) -> dict[str, Any]:
    return {"loss_variants": variants} if variants else {}


def _build(src, dev, dtype):
    import torch

    mod = src()
    if not isinstance(mod, torch.nn.Module):
        raise TypeError(f"a layer factory returned {type(mod).__name__}, expected an nn.Module")
    params = list(mod.parameters()) + list(mod.buffers())
    needs_move = any(p.device != dev for p in params) or (
        dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in params))
    if needs_move:
        if any(p.device.type != "meta" for p in params):
            mod = copy.deepcopy(mod)  # never change the caller's module in place
        if dev.type == "meta":
            mod = mod.to("meta")
        else:
            mod = mod.to(dev)
        if dtype is not None:
            mod = mod.to(dtype)
    return mod


def _dtype_name(layer_dtype, x) -> str:
    import torch

    if layer_dtype is not None:
        return str(layer_dtype).replace("torch.", "")
    for t in _tensors(x):
        if t.is_floating_point():
            return str(t.dtype).replace("torch.", "")
    return str(torch.get_default_dtype()).replace("torch.", "")


def _profile_measure(sources, example_input, dev, dtype, repeats, warmup, weight_grad,
                     min_time_s, input_grad: bool = False, evict: Callable[[], None] | None = None) -> Profile:
    import torch

    costs: list[LayerCost] = []
    variants: dict[str, dict] = {}
    x = _prep_input(example_input, dev, dtype, input_grad)
    prev_name: str = ""
    skip_keys: set[int] = set()
    found_dtype = None
    for i, src in enumerate(sources):
        with torch.device(dev):
            layer = _build(src, dev, dtype)
        name = type(layer).__name__
        for p in layer.parameters():
            if p.is_floating_point():
                found_dtype = found_dtype or p.dtype
                break
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        out, act_bytes, saved_keys, shared_bytes = _forward_saved(layer, x, i, prev_name, name, skip_keys)
        out_tensors = _tensors(out)
        out_bytes = sum(t.numel() * t.element_size() for t in out_tensors)
        out_saved = _output_saved_bytes(out_tensors, saved_keys)
        # what the next layer gets: the output, detached (same storage), graph freed
        nxt = _map(lambda t: t.detach(), out)
        skip_keys = {_storage_key(t) for t in out_tensors} & saved_keys
        grads = [torch.ones_like(t) for t in out_tensors if t.requires_grad]
        params = [p for p in layer.parameters() if p.requires_grad]
        xs = [t for t in _tensors(x) if t.requires_grad]
        del out, out_tensors
        f_s, b_s, split, pending = _time_layer(layer, x, grads, params, xs, dev, repeats, warmup,
                                               weight_grad, min_time_s, evict=evict)
        i_s, w_s = split_times(b_s, split, bool(params), bool(xs))
        costs.append(LayerCost(forward_s=f_s, backward_s=b_s, param_bytes=int(param_bytes),
                               activation_bytes=int(act_bytes), output_bytes=int(out_bytes),
                               weight_grad_s=w_s, input_grad_s=i_s, name=name,
                               shared_input_bytes=int(shared_bytes), output_saved_bytes=out_saved,
                               largest_param_bytes=_largest_param_bytes(layer), param_numels=_param_numels(layer), pending_grad_bytes=pending))
        if isinstance(src, LayerWithLoss):
            costs[-1] = _with_loss_costs(costs[-1], src, layer, x, variants, lambda v: _profile_measure(
                [v], x, dev, dtype, repeats, warmup, weight_grad, min_time_s, input_grad=True, evict=evict).layers[0])
        x = _map(lambda t: t.requires_grad_(True) if t.is_floating_point() else t, nxt)
        prev_name = name
        del layer, nxt
    return Profile(costs, dtype=_dtype_name(dtype or found_dtype, example_input),
                   meta={"mode": "measure", "device": str(dev), "repeats": repeats, "warmup": warmup,
                         "min_time_s": min_time_s,
                         "threads": torch.get_num_threads(), **_variants_meta(variants)})


def split_times(backward_s: float, split: tuple[float, float] | None, params: bool, input_grad: bool
                ) -> tuple[float | None, float | None]:
    """A measured layer's ``(input_grad_s, weight_grad_s)``: without parameters no W (0) and no I;
    without an input gradient the whole backward is W; else the timed split ``(I, W)``, or
    ``(None, None)`` when the split was not timed.

    >>> split_times(2.0, None, True, False), split_times(2.0, (1.5, 0.7), True, True)
    ((None, 2.0), (1.5, 0.7))
    """
    if not params:
        return None, 0.0
    if not input_grad:
        return None, backward_s
    return split if split is not None else (None, None)


_MAX_REPEATS = 40   # a fast layer repeats until ``min_time_s`` is timed, at most this often
_TIMES = ("forward_s", "backward_s", "weight_grad_s", "input_grad_s")


def _median_profile(runs: list[Profile]) -> Profile:
    """Per layer, the median of each time figure over several sweeps (bytes: the first's)."""
    import dataclasses

    if len(runs) == 1:
        return runs[0]
    layers = []
    for costs in zip(*(r.layers for r in runs)):
        times = {f: [getattr(c, f) for c in costs] for f in _TIMES}
        layers.append(dataclasses.replace(costs[0], **{
            f: None if any(v is None for v in vs) else statistics.median(vs) for f, vs in times.items()}))
    return Profile(layers, dtype=runs[0].dtype, meta=dict(runs[0].meta, sweeps=len(runs)))


def _time_layer(layer, x, grads, params, xs, dev, repeats, warmup, weight_grad, min_time_s,
                kept_bytes: bool = True, clock: Callable[[], float] = time.perf_counter,
                evict: Callable[[], None] | None = None):
    """Medians of one layer's forward, whole backward and (``weight_grad``, a layer with
    parameters and an input gradient) the engine's split backward ``(I, W)``, plus the bytes the
    split keeps from I to W (0 without ``kept_bytes``: times only, e.g. of DTensor layers,
    ``partitioner.tptime``). ``clock``: wall time (default), or e.g. ``time.thread_time`` for
    the calling thread's CPU time. Backwards run as the engine runs them: gradients accumulate
    into the parameters' ``.grad``. ``evict`` (untimed) runs before each timed forward, backward
    and backward half (cold caches, :mod:`engine.caches`)."""
    import torch

    _warm_autograd()
    fw, bw, bi, bwt = [], [], [], []
    chunk = _split_chunk(layer) if weight_grad and params and xs else None
    pending = 0
    r, measured = -1, 0.0
    while True:
        r += 1
        if r >= warmup + repeats and (measured >= min_time_s or r >= warmup + _MAX_REPEATS):
            break
        for t in xs:
            t.grad = None
        f_s, o = _timed(lambda: layer(x), dev, clock, evict)
        oo = [t for t in _tensors(o) if t.requires_grad]
        b_s, _ = _timed(lambda: torch.autograd.backward(oo, grads, inputs=params + xs) if oo and params + xs
                        else None, dev, clock, evict)
        del o, oo
        if r >= warmup:
            fw.append(f_s)
            bw.append(b_s)
            measured += f_s + b_s
        if chunk is not None:
            ti, tw, pending = _time_split(chunk, x, grads, dev, kept_bytes, clock, evict)
            if r >= warmup:
                bi.append(ti)
                bwt.append(tw)
                measured += ti + tw
    if params and not (weight_grad and xs) and kept_bytes:
        pending = _measure_pending(layer, x, grads)
    split = (statistics.median(bi), statistics.median(bwt)) if bi else None
    return statistics.median(fw), statistics.median(bw), split, pending


def _timed(fn: Callable[[], Any], dev, clock: Callable[[], float], evict: Callable[[], None] | None
           ) -> tuple[float, Any]:
    """``(seconds, fn())``, the device synchronised around it; ``evict`` first, untimed."""
    if evict is not None:
        evict()
    _sync(dev)
    t0 = clock()
    out = fn()
    _sync(dev)
    return clock() - t0, out


@functools.cache
def _warm_autograd() -> None:
    """One untimed backward through ``torch.autograd.backward``'s Python path, once per process.
    Its first call imports torch.fx's symbolic shapes (sympy, about 0.3 s here), which a
    profile without warm-up (``warmup=0``) would time as its first layer's backward."""
    import torch

    t = torch.ones(1, requires_grad=True)
    torch.autograd.backward([t * 2], [torch.ones(1)])


def _split_chunk(layer):
    """``layer`` alone as the engine's model chunk, to run its split backward."""
    from engine.stage import Chunk

    return Chunk(0, 0, [layer], measure_activations=False)


def _time_split(chunk, x, grads, dev, kept_bytes: bool = True,
                clock: Callable[[], float] = time.perf_counter,
                evict: Callable[[], None] | None = None) -> tuple[float, float, int]:
    """One run of the engine's split backward on ``chunk``: (I seconds, W seconds, kept bytes;
    0 without ``kept_bytes``)."""
    from engine.stage import PlainBackward

    chunk.forward(0, x, split=True)
    i_s, _ = _timed(lambda: chunk.backward_input(0, list(grads), PlainBackward()), dev, clock, evict)
    kept = chunk.kept_grad_bytes(0) if kept_bytes else 0
    w_s, _ = _timed(lambda: chunk.backward_weight(0, PlainBackward()), dev, clock, evict)
    return i_s, w_s, kept


def _measure_pending(layer, x, grads) -> int:
    """What one microbatch keeps between I and W on ``layer`` alone: the engine's own split path
    (``Chunk.forward(split=True)`` then ``backward_input``), its kept gradients summed."""
    from engine.stage import PlainBackward

    chunk = _split_chunk(layer)
    chunk.forward(0, x, split=True)
    chunk.backward_input(0, list(grads), PlainBackward())
    out = chunk.kept_grad_bytes(0)
    chunk.state.clear()   # W is not run: the parameters' .grad stay untouched
    return out


def _weight_ops_mode(param_keys: set):
    """A TorchDispatchMode summing the output bytes of the ops that take a parameter (views
    excluded): the gradients a split backward keeps at the weight-owning nodes until W."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class WeightOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if getattr(func, "is_view", False):
                return out
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if any(_storage_key(t) in param_keys for t in ins):
                first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
                if first is not None and first.is_floating_point():
                    self.bytes += first.numel() * first.element_size()
            return out

    return WeightOps()


def _roofline_mode(spec: DeviceSpec, dtype_name: str):
    """A TorchDispatchMode that sums per-op time, FLOPs and bytes: by the spec's per-op-class
    kernel model (``spec.kernels``, partitioner.kernels) when it has one, else by its flat
    roofline (``spec.op_time``). ``by_class``: seconds per op class (kernel model only)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    charger = spec.charger(dtype_name)
    no_kernel = _no_kernel_ops()

    class Roofline(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.time_s = 0.0
            self.flops = 0.0
            self.bytes = 0.0
            self.by_class = charger.by_class if charger is not None else {}
            self.ops: list[tuple[str, float]] = []   # (aten op name, seconds) in call order

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if getattr(func, "is_view", False) or func._overloadpacket in no_kernel:
                return out
            fl = 0
            fn = flop_registry.get(func._overloadpacket)
            if fn is not None:
                fl = fn(*args, **kwargs, out_val=out)
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            moved = sum(t.numel() * t.element_size() for t in ins + outs)
            if fl or moved:
                self.flops += fl
                self.bytes += moved
                if charger is None:
                    t = spec.op_time(fl, moved, dtype_name)
                else:
                    t = charger.charge(func, args, kwargs, out, fl, moved, ins, outs)
                self.time_s += t
                self.ops.append((func._overloadpacket.__name__, t))
            return out

    return Roofline()


def forward_op_times(factory: Callable, example_input: Any, *, device_spec: "str | DeviceSpec", dtype: Any = None,
                     attention: str | None = None) -> list[tuple[str, float]]:
    """The analytic forward of one layer, op by op: ``(aten op name, seconds)`` in call order,
    charged as :func:`profile` charges them (same device model, attention backend and dropout).
    For policies that keep some ops' outputs and recompute the rest (e.g. torchtitan's op-level
    selective checkpointing, ``scripts/device_check.py``).

    >>> import torch
    >>> ops = forward_op_times(lambda: torch.nn.Linear(64, 64), torch.randn(8, 64), device_spec="a100-kernels")
    >>> [name for name, _ in ops], ops[0][1] > 0
    (['addmm'], True)
    """
    import torch

    spec = get_device_spec(device_spec)
    meta = torch.device("meta")
    tdtype = dtype if (dtype is None or isinstance(dtype, torch.dtype)) else getattr(torch, str(dtype))
    with meta_device():
        layer = _build(factory, meta, tdtype)
    x = _prep_input(example_input, meta, tdtype, True)
    pdtype = next((p.dtype for p in layer.parameters() if p.is_floating_point()), None)
    mode = _roofline_mode(spec, _dtype_name(tdtype or pdtype, x))
    with _attention_mode(attention or spec.attention, spec), mode:
        layer(x)
    return list(mode.ops)


def _no_kernel_ops() -> frozenset:
    """Aten ops that launch no kernel and move no bytes: allocations (their output is not
    written) and ``_unsafe_view`` (a view that autograd does not track as one)."""
    import torch

    a = torch.ops.aten
    return frozenset({a.empty, a.empty_like, a.new_empty, a.empty_strided, a.new_empty_strided, a._unsafe_view})


def _attention_mode(backend: str | None, spec: DeviceSpec | None = None):
    """A TorchFunctionMode that runs ``F.scaled_dot_product_attention`` with ``backend``'s
    kernel, so that the meta device saves (and the roofline moves) what that kernel does:
    flash / efficient keep O(s) per head (output, log-sum-exp), math the s x s probabilities.
    ``None`` or "math": SDPA as dispatched (the meta device's math path).

    With a GPU ``spec`` (any but the measured ``cpu``), ``F.dropout`` runs as on a GPU, one fused
    ``native_dropout`` kernel (reads the input, writes the output and a one-byte mask, which
    backward reads); the meta device
    would take the CPU's path instead (``bernoulli_``, ``div_``, ``mul``: three kernels and a
    mask in the input's dtype), ATen's ``dropout`` choosing the fused kernel only for CUDA inputs.
    """
    import contextlib

    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    gpu_dropout = spec is not None and spec.name != "cpu"
    if backend not in (None, *ATTENTION_BACKENDS):
        raise ValueError(f"unknown attention backend {backend!r}; use one of {ATTENTION_BACKENDS}")
    sdpa = backend not in (None, "math")
    if not sdpa and not gpu_dropout:
        return contextlib.nullcontext()

    class Attention(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if gpu_dropout and func is F.dropout:
                return _fused_dropout(*args, **kwargs)
            if not sdpa or func is not F.scaled_dot_product_attention:
                return func(*args, **kwargs)
            if backend == "unfused":
                return _unfused_sdpa(*args, **kwargs)
            return _fused_sdpa(backend, *args, **kwargs)

    return Attention()


def _fused_dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """``F.dropout`` as CUDA runs it: one ``native_dropout`` kernel (``_attention_mode``)."""
    import torch
    import torch.nn.functional as F

    if not training or not 0.0 < p < 1.0:
        return F.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _unfused_sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False):
    """Megatron-LM's legacy ``CoreAttention`` (``--transformer-impl local`` without
    ``--use-flash-attn``), op for op as it charges and saves: ``baddbmm`` of the scaled scores
    into a ``[b*h, s, s]`` buffer, one fused scale-mask-softmax kernel (apex's
    ``scaled_upper_triang_masked_softmax``: reads the scores, writes the probabilities, saves
    them), ``dropout`` of the probabilities (saves its mask), ``bmm`` with the values. The mask
    lives inside the fused kernel, so on the meta device (the only place this runs: the
    analytic profile) it is one softmax; grouped key/value heads are repeated first. Heads
    transposed out of a ``[b, s, h, d]`` projection are copied to merge ``b`` and ``h`` where
    Megatron's ``[s, b, h, d]`` layout needs no copy: a small overcharge when ``b > 1``."""
    import torch

    if query.device.type != "meta":
        raise ValueError("attention='unfused' is a cost model of Megatron's core attention for the analytic "
                         "profile (meta device); a measured profile runs the model's own attention")
    if key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    *lead, s, d = query.shape
    q, k, v = (t.reshape(-1, t.shape[-2], t.shape[-1]) for t in (query, key, value))
    scores = torch.baddbmm(q.new_empty(q.shape[0], s, k.shape[-2]), q, k.transpose(1, 2), beta=0.0,
                           alpha=scale if scale is not None else d ** -0.5)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:   # one fused kernel, as on the GPU (_fused_dropout)
        probs = torch.native_dropout(probs, dropout_p, True)[0]
    return torch.bmm(probs, v).view(*lead, s, v.shape[-1])


def _fused_sdpa(backend: str, query, key, value, attn_mask=None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False):
    """SDPA through the fused kernel (flash; efficient when a mask is given or asked for).
    Flash takes grouped-query key/value heads as they are; efficient needs them repeated.
    Flash needs one head size for queries and values: a smaller value head (DeepSeek's MLA)
    goes through efficient, as PyTorch's dispatcher sends it."""
    import torch

    if backend == "flash" and attn_mask is None and value.shape[-1] == query.shape[-1]:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


_POSITION_ATTRS = frozenset({"layer_idx"})
"""Attributes that only say where a layer sits (Hugging Face's index into the KV cache), not what
it computes: left out of the analytic cache's key, so a model's identical blocks are costed once."""


def _plain_attrs(mod) -> tuple:
    plain = (int, float, str, bool, tuple, type(None))
    return tuple((name, type(m).__name__, tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                                                        if not k.startswith("_") and k not in _POSITION_ATTRS
                                                        and isinstance(v, plain))))
                 for name, m in mod.named_modules())


def _layer_key(layer, x, skip_keys) -> tuple:
    """Identity of a layer for analytic caching: class, parameter/buffer shapes, plain
    attributes of every submodule, input shapes/dtypes and whether the input is shared."""
    ts = [(tuple(p.shape), p.dtype, p.requires_grad) for p in layer.parameters()]
    bs = [(tuple(b.shape), b.dtype) for b in layer.buffers()]
    xs = [(tuple(t.shape), t.dtype, t.requires_grad) for t in _tensors(x)]
    shared = tuple(_storage_key(t) in skip_keys for t in _tensors(x))
    return (type(layer), tuple(ts), tuple(bs), _plain_attrs(layer), _shapes(x), tuple(xs), shared)


def _profile_analytic(sources, example_input, dtype, spec: DeviceSpec, cache: bool = True,
                      input_grad: bool = False) -> Profile:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    meta = torch.device("meta")
    costs: list[LayerCost] = []
    variants: dict[str, dict] = {}
    x = _prep_input(example_input, meta, dtype, input_grad)
    dname = _dtype_name(dtype, x)
    prev_name: str = ""
    skip_keys: set[int] = set()
    total_flops_check = 0.0
    found_dtype = None
    memo: dict = {}
    memo_idx: dict = {}
    classes: list[dict] = []  # per layer: seconds per op class of forward and backward (kernel model)
    for i, src in enumerate(sources):
        with meta_device():
            layer = _build(src, meta, dtype)
        name = type(layer).__name__
        for p in layer.parameters():
            if p.is_floating_point():
                found_dtype = found_dtype or p.dtype
                break
        pdname = dname if dtype is not None or found_dtype is None else str(found_dtype).replace("torch.", "")
        key = _layer_key(layer, x, skip_keys) if cache else None
        if key is not None and key in memo:  # an identical layer was already costed
            cost, nxt_c, skip_c = memo[key]
            costs.append(cost)
            classes.append(classes[memo_idx[key]])
            x, skip_keys, prev_name = nxt_c, skip_c, name
            del layer
            continue
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        fwd = _roofline_mode(spec, pdname)
        wops = _weight_ops_mode({_storage_key(p) for p in layer.parameters() if p.requires_grad})
        with FlopCounterMode(display=False) as fc_f:
            with fwd, wops:
                out, act_bytes, saved_keys, shared_bytes = _forward_saved(layer, x, i, prev_name, name, skip_keys)
        out_tensors = _tensors(out)
        out_bytes = sum(t.numel() * t.element_size() for t in out_tensors)
        outs = [t for t in out_tensors if t.requires_grad]
        grads = [torch.ones_like(t) for t in outs]
        params = [p for p in layer.parameters() if p.requires_grad]
        xs = [t for t in _tensors(x) if t.requires_grad]
        bwd = _roofline_mode(spec, pdname)
        with FlopCounterMode(display=False) as fc_b:
            with bwd:
                _backward(outs, params + xs, grads)
        w_s = _analytic_weight_s(layer, x, params, xs, grads, spec, pdname, bwd.time_s)
        total_flops_check += abs(fc_f.get_total_flops() - fwd.flops) + abs(fc_b.get_total_flops() - bwd.flops)
        classes.append({"forward": dict(fwd.by_class), "backward": dict(bwd.by_class)})
        costs.append(LayerCost(forward_s=fwd.time_s, backward_s=bwd.time_s, param_bytes=int(param_bytes),
                               activation_bytes=int(act_bytes), output_bytes=int(out_bytes), name=name,
                               weight_grad_s=min(w_s, bwd.time_s), forward_flops=float(fc_f.get_total_flops()),
                               shared_input_bytes=int(shared_bytes), backward_flops=float(fc_b.get_total_flops()),
                               output_saved_bytes=_output_saved_bytes(out_tensors, saved_keys),
                               largest_param_bytes=_largest_param_bytes(layer), param_numels=_param_numels(layer), pending_grad_bytes=int(wops.bytes)))
        if isinstance(src, LayerWithLoss):
            costs[-1] = _with_loss_costs(costs[-1], src, layer, x, variants, lambda v: _profile_analytic(
                [v], x, dtype, spec, False, input_grad=True).layers[0])
        nxt = _map(lambda t: t.detach(), out)
        skip_keys = {_storage_key(t) for t in out_tensors} & saved_keys
        del out, out_tensors, outs
        x = _map(lambda t: t.requires_grad_(True) if t.is_floating_point() else t, nxt)
        if key is not None:
            memo[key] = (costs[-1], x, skip_keys)
            memo_idx[key] = len(classes) - 1
        prev_name = name
        del layer
    return Profile(costs, dtype=_dtype_name(dtype or found_dtype, example_input),
                   meta={**_analytic_meta(spec, dname, len(memo) if cache else len(costs), total_flops_check, classes),
                         **_variants_meta(variants)})


def _analytic_weight_s(layer, x, params, xs, grads, spec: DeviceSpec, pdname: str, backward_s: float) -> float:
    """The weight-gradient part of a layer's analytic backward: the full backward less an
    input-only backward (all of it when the layer takes no input gradient)."""
    if not params:
        return 0.0
    if not xs:
        return backward_s
    out = layer(x)
    inp = _roofline_mode(spec, pdname)
    with inp:
        _backward([t for t in _tensors(out) if t.requires_grad], xs, grads)
    return max(backward_s - inp.time_s, 0.0)


def _with_optimizer_costs(prof: Profile, spec: DeviceSpec) -> Profile:
    """A kernel-model profile also prices the optimizer step: a memory-bound sweep over each
    rank's parameters and states at the achieved bandwidth (``partitioner.kernels``)."""
    import dataclasses

    from .costs import FixedCosts
    from .kernels import optimizer_s_per_byte

    if spec.kernels is None or prof.fixed is not None:
        return prof
    per_byte = optimizer_s_per_byte(spec.kernels, spec.memory_bandwidth, prof.itemsize)
    return dataclasses.replace(prof, fixed=FixedCosts(optimizer_s_per_byte=per_byte))


def _analytic_meta(spec: DeviceSpec, dname: str, unique: int, mismatch: float, classes: list[dict]) -> dict:
    """Provenance of an analytic profile: the device model, and (kernel model) each layer's
    seconds per op class in forward and backward."""
    meta = {"mode": "analytic", "unique_layers_costed": unique, "device_spec": spec.name,
            "flops_per_s": spec.flops_per_s(dname), "memory_bandwidth": spec.memory_bandwidth,
            "efficiency": spec.efficiency, "flop_count_mismatch": mismatch,
            "device_model": "flat-roofline" if spec.kernels is None else "kernels"}
    if spec.kernels is not None:
        meta["kernels"] = spec.kernels.to_dict()
        meta["layer_op_classes"] = classes
    return meta
