"""Measure one rank's memory over a training step with torch's ``MemTracker``.

The measurement is independent of the planner's memory model: every tensor alive on the rank
when the step starts (found by the garbage collector, not by asking the model what should
exist) is registered with ``torch.distributed._tools.mem_tracker.MemTracker``, which then sees
every allocation of the step through a ``TorchDispatchMode`` and reports the peak of live
tensor bytes (storages counted once) and its breakdown by kind: parameters (and buffers),
gradients, optimizer state, activations (made in forward), temporaries (made in backward) and
other tensors alive before the step (DeepSpeed's buffers, data). On CUDA the allocator's own
``max_memory_allocated`` over the step is recorded as well.

Known tensors can be given their kind (``kinds``): e.g. DeepSpeed's flat fp32 gradient buffer
is a gradient, its fp32 master partition optimizer state; without it they count as "other".

``MemTracker`` refuses a root module that runs forward twice in one tracking context (it takes
that for a second iteration); a pipeline chunk runs once per microbatch, so this tracker forgets
a root module's statistics before it runs again (the peak is global and unaffected).

Example::

    mem = StepMemory.measure(lambda: pipe.train_step(x, y), modules=[pipe.layer_module],
                             optimizers=[inner_torch_optimizer], device=pipe.device)
    result, report = mem
    report.peak_bytes, report.breakdown["activations"]
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["MemoryReport", "measure_step", "MEASURED_KINDS", "modelled_peak"]

# MemTracker's reference types -> the names reported (and compared with the plan's breakdown)
_KIND_OF = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients",
            "Optstate": "optimizer_state", "Activation": "activations",
            "Temp": "temporary", "Other": "other"}
MEASURED_KINDS: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations",
                                   "temporary", "other")


@dataclass
class MemoryReport:
    """One rank's measured peak over a step: ``peak_bytes`` (MemTracker, live tensor bytes),
    ``breakdown`` (bytes per kind at that peak, :data:`MEASURED_KINDS`) and, on CUDA,
    ``device_peak_bytes`` (``torch.cuda.max_memory_allocated`` over the step)."""

    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    device_peak_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "breakdown": dict(self.breakdown),
                "device_peak_bytes": self.device_peak_bytes}


def modelled_peak(measured: Mapping[str, Any]) -> int:
    """The part of a measured peak (``MemoryReport.to_dict()``) that a plan models: the peak
    less the "other" tensors alive before the step (neither parameters, gradients nor
    optimizer state: the data the process keeps, buffers the plan does not know). The one rule
    by which a plan's per-rank peak is compared with MemTracker's.

    >>> modelled_peak({"peak_bytes": 30, "breakdown": {"activations": 20, "other": 8}})
    22
    """
    return int(measured["peak_bytes"]) - int(measured.get("breakdown", {}).get("other", 0))


def _tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class _StepTracker(MemTracker):
        """MemTracker that lets a root module run forward once per microbatch."""

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} <= {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return _StepTracker


@contextlib.contextmanager
def _removable_grad_hooks() -> Iterator[None]:
    """MemTracker's module tracker puts multi-grad hooks on every module's inputs and outputs;
    two of them break on a pipeline stage, whose inputs are leaves (received activations):

    * its "all" hook on the inputs asks autograd whether each input's node will run, which a
      leaf's node cannot answer inside ``torch.autograd.grad`` (zb-h1's input-gradient pass):
      it is registered in mode "any" (it marks when the module's backward has begun; the
      measured peak and kinds do not depend on it);
    * left in place, a hook on a leaf closes over the leaf's gradient accumulator, which holds
      the leaf: a cycle through C++ the garbage collector cannot see, so every measured step
      would keep its inputs and their gradients alive for good (``ModTracker`` keeps no
      handle): every hook is removed when the step ends."""
    from torch.distributed._tools import mod_tracker

    original = mod_tracker.register_multi_grad_hook
    handles: list[Any] = []

    def register(tensors: Any, fn: Callable, *, mode: str = "all") -> Any:
        handles.append(original(tensors, fn, mode="any"))
        return handles[-1]

    mod_tracker.register_multi_grad_hook = register
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original
        for h in handles:
            h.remove()


def _live_tensors(device: torch.device) -> list[Tensor]:
    """Every tensor object alive in this process on ``device`` (the rank's memory before the step)."""
    out = []
    gc.collect()
    with warnings.catch_warnings():   # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            try:
                if isinstance(obj, Tensor) and obj.device.type == device.type and not obj.is_meta:
                    out.append(obj)
            except (ReferenceError, RuntimeError):  # a dead weakref proxy, an odd subclass
                continue
    return out


def _storages(t: Tensor) -> set:
    from torch.distributed._tools.common_utils import get_untyped_storages

    return get_untyped_storages(t)


def measure_step(fn: Callable[[], Any], *, modules: Sequence[nn.Module],
                 optimizers: Sequence[torch.optim.Optimizer] = (),
                 kinds: Mapping[str, Iterable[Tensor]] | None = None,
                 device: torch.device | str = "cpu") -> tuple[Any, MemoryReport]:
    """Run ``fn()`` (one training step) under a MemTracker; returns its result and the report.

    ``modules`` / ``optimizers``: this rank's modules (parameters, buffers) and torch
    optimizers (their state); ``kinds``: known tensors by kind ("gradients",
    "optimizer_state"), e.g. a backend's flat buffers. Everything else alive counts as "other".
    """
    from torch.distributed._tools.mem_tracker import _MemRefType

    device = torch.device(device)
    tracker = _tracker_class()()
    live = _live_tensors(device)
    tracker.track_external(*modules, *optimizers)
    ref = {"gradients": _MemRefType.GRAD, "optimizer_state": _MemRefType.OPT}
    for kind, tensors in (kinds or {}).items():
        for t in tensors:
            tracker._update_and_maybe_create_winfos(t, ref[kind])
    known = tracker._WINFO
    # registering a known storage again would re-tag it as "other": only the unknown ones
    tracker.track_external(*[t for t in live if not any(st in known for st in _storages(t))])
    del live  # the tracker holds weak references: what the step frees must be freed
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with _removable_grad_hooks(), tracker:
        result = fn()
    snap = tracker.get_tracker_snapshot("peak").get(device, {})
    if not snap and device.type == "cuda":   # MemTracker keys by the tensors' device (index)
        snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    breakdown = dict.fromkeys(MEASURED_KINDS, 0)
    total = 0
    for key, value in snap.items():
        name = getattr(key, "value", str(key))
        if name == "Total":
            total = int(value)
        elif name in _KIND_OF:
            breakdown[_KIND_OF[name]] += int(value)
    device_peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    return result, MemoryReport(total, breakdown, device_peak)
