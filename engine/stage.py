"""One rank's model chunk: build its own layers; forward, full backward, and the split
input-gradient (I) / weight-gradient (W) backward of zero-bubble schedules.

Layers are built from zero-argument factories under ``torch.manual_seed(seed + i)`` for global
layer index ``i``, so a layer's weights do not depend on the split. A chunk runs its layers like
``nn.Sequential`` (a layer that returns a tuple hands the tuple to the next layer).

The I/W split: when a microbatch's backward is split, the forward cuts the autograd graph at
every layer boundary (each layer's input is a detached leaf). ``I`` then walks the layers
backwards with ``torch.autograd.grad`` w.r.t. each layer's input only (weight-gradient kernels
are skipped by autograd) and remembers the gradient at every boundary; ``W`` is then one
backward over the disjoint per-layer graphs restricted to the parameters, so no input-gradient
work is repeated and parameters shared between layers still accumulate every use.

Example::

    chunk = Chunk.build(index=1, factories=fs, start=3, stop=6, seed=0)
    y = chunk.forward(0, x)                   # keeps what backward needs for microbatch 0
    gx = chunk.backward(0, [gy], optimizer)   # grads w.r.t. x (float inputs requiring grad)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from engine.comm import flatten, unflatten

__all__ = ["Chunk", "build_layers", "LayerSpec"]

LayerSpec = Any  # an nn.Sequential, or a sequence of zero-argument nn.Module factories


def build_layers(layers: LayerSpec, start: int, stop: int, seed: int = 0,
                 device: torch.device | str | None = None) -> list[nn.Module]:
    """Build layers ``start..stop-1``: from factories (seeded per global index) or taken from an
    ``nn.Sequential`` / list of modules."""
    out = []
    for i in range(start, stop):
        item = layers[i]
        if isinstance(item, nn.Module):
            mod = item
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + i)
                mod = item()
            if not isinstance(mod, nn.Module):
                raise TypeError(f"layer factory {i} returned {type(mod).__name__}, expected an "
                                "nn.Module; pass zero-argument callables that build one layer")
        out.append(mod.to(device) if device is not None else mod)
    return out


def _rg(ts: Sequence[Tensor]) -> list[Tensor]:
    return [t for t in ts if t.requires_grad]


def _cut(value: Any) -> Any:
    """Detach the float tensors requiring grad into fresh leaves (a graph cut)."""
    is_tuple, ts = flatten(value)
    return unflatten(is_tuple, [t.detach().requires_grad_(True) if t.requires_grad else t
                                for t in ts])


@dataclass
class _MbState:
    inputs: list[Tensor]                       # chunk-input tensors requiring grad
    outputs: list[Tensor]                      # chunk-output tensors requiring grad (or loss)
    split: bool
    segments: list[tuple[list[Tensor], list[Tensor], bool]] = field(default_factory=list)
    pending_w: list[tuple[list[Tensor], list[Tensor]]] | None = None
    saved_bytes: int = 0
    loss: Tensor | None = None


class Chunk:
    """Model chunk ``index`` holding global layers ``[start, stop)``."""

    def __init__(self, index: int, start: int, layers: list[nn.Module], *,
                 loss_fn: Callable[[Any, Any], Tensor] | None = None,
                 activation_checkpointing: bool = False,
                 autocast: Callable[[], Any] | None = None,
                 measure_activations: bool = True):
        self.index, self.start, self.stop = index, start, start + len(layers)
        self.module = nn.Sequential(*layers)
        self.loss_fn = loss_fn                    # set on the last chunk only
        self.checkpointing = activation_checkpointing
        self.autocast = autocast or contextlib.nullcontext
        self.measure = measure_activations
        self.state: dict[int, _MbState] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.refresh_params()

    def refresh_params(self) -> None:
        """Re-read the layers' parameters (after parameters were replaced, e.g. tied)."""
        self._layer_params = [[p for p in m.parameters() if p.requires_grad]
                              for m in self.module]
        self.params = list({id(p): p for ps in self._layer_params for p in ps}.values())
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.module.parameters()}

    @classmethod
    def build(cls, index: int, factories: LayerSpec, start: int, stop: int, seed: int = 0,
              device: torch.device | str | None = None, **kw: Any) -> "Chunk":
        return cls(index, start, build_layers(factories, start, stop, seed, device), **kw)

    @property
    def is_last(self) -> bool:
        return self.loss_fn is not None

    # ---- forward -----------------------------------------------------------------------------
    def _run_layer(self, layer: nn.Module, x: Any) -> Any:
        if self.checkpointing and any(p.requires_grad for p in layer.parameters()) \
                and torch.is_grad_enabled():
            return checkpoint(layer, x, use_reentrant=False)
        return layer(x)

    def forward(self, mb: int, x: Any, target: Any = None, *, split: bool = False,
                keep: bool = True) -> Any:
        """Run microbatch ``mb``; returns the output (the loss on the last chunk). With ``keep``
        (training) the state for backward is kept; ``split`` prepares the I/W split."""
        seen: dict[int, int] = {}
        hooks = (torch.autograd.graph.saved_tensors_hooks(*self._hooks(seen))
                 if keep and self.measure and not self.checkpointing
                 else contextlib.nullcontext())
        chunk_in = _rg(flatten(x)[1])
        segments: list[tuple[list[Tensor], list[Tensor], bool]] = []
        cur = x
        with hooks, self.autocast():
            for j, layer in enumerate(self.module):
                if split and j > 0:
                    cur = _cut(cur)
                if keep and self.checkpointing:
                    self._count(flatten(cur)[1], seen)
                out = self._run_layer(layer, cur)
                if split:
                    segments.append((_rg(flatten(cur)[1]), _rg(flatten(out)[1]),
                                     bool(self._layer_params[j])))
                cur = out
            if self.loss_fn is not None:
                if split and len(self.module):
                    cur = _cut(cur)
                loss = self.loss_fn(cur, target)
                if split:
                    segments.append((_rg(flatten(cur)[1]), [loss], False))
                cur = loss
        if keep and torch.is_grad_enabled():
            outs = [cur] if self.loss_fn is not None else _rg(flatten(cur)[1])
            st = _MbState(chunk_in, outs, split, segments, saved_bytes=sum(seen.values()),
                          loss=cur if self.loss_fn is not None else None)
            self.state[mb] = st
            self.live_bytes += st.saved_bytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return cur

    def _hooks(self, seen: dict[int, int]) -> tuple[Callable, Callable]:
        def pack(t: Tensor) -> Tensor:
            self._count([t], seen)
            return t.detach()  # not `t`: holding an output with its grad_fn would form a cycle

        return pack, lambda t: t

    def _count(self, ts: Sequence[Tensor], seen: dict[int, int]) -> None:
        for t in ts:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            ptr = st.data_ptr()
            if ptr not in self._param_ptrs:
                seen[ptr] = st.nbytes()

    # ---- backward ----------------------------------------------------------------------------
    def _free(self, mb: int) -> None:
        st = self.state.pop(mb)
        self.live_bytes -= st.saved_bytes

    def _out_grads(self, st: _MbState, grads: Sequence[Tensor] | None, optimizer: Any
                   ) -> tuple[list[Tensor], list[Tensor] | None]:
        if self.loss_fn is not None:
            return [optimizer.scale_loss(st.outputs[0])], None
        if grads is None or len(grads) != len(st.outputs):
            raise RuntimeError(f"chunk {self.index}: got {0 if grads is None else len(grads)} "
                               f"output gradients for {len(st.outputs)} outputs requiring grad")
        return list(st.outputs), list(grads)

    def _input_grads(self, st: _MbState) -> list[Tensor]:
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in st.inputs]

    def backward(self, mb: int, grads: Sequence[Tensor] | None, optimizer: Any) -> list[Tensor]:
        """Full backward of ``mb``; returns the gradients w.r.t. the chunk's inputs that require
        grad (in order). ``grads``: gradients w.r.t. the outputs (None on the last chunk)."""
        st = self.state[mb]
        if st.split:
            gx = self.backward_input(mb, grads, optimizer)
            self.backward_weight(mb, optimizer)
            return gx
        outs, gs = self._out_grads(st, grads, optimizer)
        if outs and outs[0].requires_grad:
            optimizer.backward(outs, gs)
        gx = self._input_grads(st)
        self._free(mb)
        return gx

    def backward_input(self, mb: int, grads: Sequence[Tensor] | None, optimizer: Any
                       ) -> list[Tensor]:
        """The I half: gradients w.r.t. the chunk's inputs; weight gradients are left for W."""
        st = self.state[mb]
        if not st.split:
            raise RuntimeError(f"chunk {self.index} microbatch {mb}: I without a split forward")
        outs, gs = self._out_grads(st, grads, optimizer)
        if gs is None:  # last chunk: start from the scaled loss, which depends on the loss
            gs = [torch.ones_like(o) for o in outs]
            seg_in, _, _ = st.segments[-1]
            st.segments[-1] = (seg_in, outs, False)
        pending: list[tuple[list[Tensor], list[Tensor]]] = []
        for k in range(len(st.segments) - 1, -1, -1):
            seg_in, seg_out, has_params = st.segments[k]
            live = [(o, g) for o, g in zip(seg_out, gs) if o.requires_grad]
            if has_params and live:
                pending.append(([o for o, _ in live], [g for _, g in live]))
            if not seg_in:
                gs = []
                continue
            if live:
                got = torch.autograd.grad([o for o, _ in live], seg_in, [g for _, g in live],
                                          retain_graph=True, allow_unused=True)
            else:
                got = (None,) * len(seg_in)
            gs = [g if g is not None else torch.zeros_like(t) for g, t in zip(got, seg_in)]
        st.pending_w = pending
        st.segments = []
        # The chunk's inputs are the first segment's inputs, so `gs` holds their gradients.
        return gs if st.inputs else []

    def backward_weight(self, mb: int, optimizer: Any) -> None:
        """The W half: parameter gradients of ``mb`` from the boundaries' saved gradients."""
        st = self.state[mb]
        if st.pending_w is None:
            raise RuntimeError(f"chunk {self.index} microbatch {mb}: W before I")
        outs = [o for os_, _ in st.pending_w for o in os_]
        gs = [g for _, gs_ in st.pending_w for g in gs_]
        if outs and self.params:
            optimizer.backward(outs, gs, inputs=self.params)
        self._free(mb)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
