"""One rank's model chunk: build its own layers; forward, full backward, and the split
input-gradient (I) / weight-gradient (W) backward of zero-bubble schedules.

Layers are built from zero-argument factories under ``torch.manual_seed(seed + i)`` for global
layer index ``i``, so a layer's weights do not depend on the split. A chunk runs its layers like
``nn.Sequential`` (a layer that returns a tuple hands the tuple to the next layer).

The I/W split works on the autograd graph, node by node (no extra graph cuts in the forward).
``I`` analyses the microbatch's graph once: the "input region" is the set of nodes from which a
chunk input is reachable; a node of that region with an edge to a parameter-only subgraph (a
Linear's ``AddmmBackward`` and its weight/bias edges) is a boundary. ``I`` runs one
``torch.autograd.grad`` w.r.t. the chunk inputs (autograd skips every weight-gradient output)
while pre-hooks on the boundaries record the gradient arriving at each of them. ``W`` then runs
each boundary's backward once more, restricted to the parameters under its parameter edges
(only the weight-gradient kernels, e.g. ``x^T dy``), straight into their ``.grad``. No
input-gradient work is repeated. A parameter under several boundaries (tied) is summed first:
each boundary's backward stops at its parameter edges and one backward takes the sums into the
parameters, so every parameter is accumulated once per microbatch.
Outputs that do not depend on a chunk input (the first chunk of a language model) go to ``W``
whole. With an optimizer backend that cannot take ``GradientEdge`` roots (DeepSpeed's), the
split falls back to a per-layer graph cut: each layer's input a detached leaf, ``I`` walks the
layers with ``torch.autograd.grad``, ``W`` backpropagates the per-layer graphs into the
parameters (repeating the intra-layer input-gradient chain, so slower).

Activation checkpointing is chosen per chunk, at one of ``engine.choices.RECOMPUTE_GRANULARITIES``:
``"chunk"`` makes the whole chunk one ``torch.utils.checkpoint`` unit (a held microbatch keeps
only the chunk's input; its backward recomputes the chunk, so one microbatch's activations of
every layer exist at once); ``"layer"`` wraps each layer in its own non-reentrant checkpoint, the
last chunk's last layer together with the loss (torchtitan's and Megatron's "full" recompute: a
held microbatch keeps every layer's input; its backward recomputes one layer at a time, so only
one layer's activations exist at once). Either way a checkpointed chunk does not split: ``I``
runs the full backward, ``W`` is empty (deferring W would keep the recomputed activations alive,
or recompute every layer a second time).

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
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.checkpoint import checkpoint

from engine.choices import check_recompute_granularity
from engine.comm import flatten, unflatten

__all__ = ["Chunk", "build_layers", "LayerSpec", "PlainBackward"]

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


def _storage(t: Tensor) -> Any:
    """A tensor's storage; a DTensor's (tensor parallelism, FSDP2): its local shard's; an
    in-flight collective's result (``AsyncCollectiveTensor``): its result's, once done."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "trigger_wait"):
        t = t.trigger_wait()
    return t.untyped_storage()


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
    node_split: bool = False                   # graph-node I/W split (else per-layer cuts)
    boundaries: list[tuple[Any, list[tuple[Any, int]], tuple]] | None = None
    saved_bytes: int = 0
    loss: Tensor | None = None
    whole: bool = False                        # one checkpointed unit: I is the full backward


class PlainBackward:
    """The optimizer interface :class:`Chunk` calls in backward, without an optimizer: the loss
    unscaled, plain autograd (to time or run a chunk alone, e.g. in ``partitioner.profile``).

    >>> PlainBackward.loss_grad(torch.tensor(2.0))
    tensor(1.)
    """

    @staticmethod
    def scale_loss(loss: Tensor) -> Tensor:
        return loss

    @staticmethod
    def loss_grad(loss: Tensor) -> Tensor:
        return torch.ones_like(loss)

    @staticmethod
    def backward(outs: Sequence[Tensor], grads: Sequence[Tensor] | None, inputs: Sequence[Tensor] | None = None) -> None:
        torch.autograd.backward(outs, grads, inputs=inputs)


class Chunk:
    """Model chunk ``index`` holding global layers ``[start, stop)``."""

    def __init__(self, index: int, start: int, layers: list[nn.Module], *,
                 loss_fn: Callable[[Any, Any], Tensor] | None = None,
                 activation_checkpointing: bool = False,
                 autocast: Callable[[], Any] | None = None,
                 measure_activations: bool = True, recompute_granularity: str = "chunk"):
        self.index, self.start, self.stop = index, start, start + len(layers)
        self.module = nn.Sequential(*layers)
        self.loss_fn = loss_fn                    # set on the last chunk only
        self.checkpointing = activation_checkpointing
        self.granularity = check_recompute_granularity(recompute_granularity)
        self.autocast = autocast or contextlib.nullcontext
        self.measure = measure_activations
        self.state: dict[int, _MbState] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.refresh_params()

    def refresh_params(self, params_of: Callable[[nn.Module], list[Tensor]] | None = None) -> None:
        """Re-read the layers' parameters (after parameters were replaced, e.g. tied).
        ``params_of(layer)``: the tensors a layer's forward differentiates, when they are not
        its ``parameters()`` (FSDP2: the gathered ones; ``engine.fsdp``)."""
        if params_of is None:
            self._layer_params = [[p for p in m.parameters() if p.requires_grad]
                                  for m in self.module]
            every = list(self.module.parameters())
        else:
            self._layer_params = [list(params_of(m)) for m in self.module]
            every = [p for ps in self._layer_params for p in ps]
        self.params = list({id(p): p for ps in self._layer_params for p in ps}.values())
        self._every_param = every
        # FSDP2's gathered parameters get new storage at each all-gather: read their places live
        self._moving_params = params_of is not None
        self._fixed_ptrs = {_storage(p).data_ptr() for p in every}

    @property
    def _param_ptrs(self) -> set[int]:
        """Where the parameters' storages are now (the diagnostics leave them out)."""
        if not self._moving_params:
            return self._fixed_ptrs
        return {_storage(p).data_ptr() for p in self._every_param}

    @classmethod
    def build(cls, index: int, factories: LayerSpec, start: int, stop: int, seed: int = 0,
              device: torch.device | str | None = None, **kw: Any) -> "Chunk":
        return cls(index, start, build_layers(factories, start, stop, seed, device), **kw)

    @property
    def is_last(self) -> bool:
        return self.loss_fn is not None

    # ---- forward -----------------------------------------------------------------------------
    def _run_all(self, x: Any, target: Any) -> Any:
        """Every layer (and the loss on the last chunk): one checkpointed unit."""
        for layer in self.module:
            x = layer(x)
        return self.loss_fn(x, target) if self.loss_fn is not None else x

    def _run_tail(self, x: Any, target: Any) -> Any:
        """The last layer and the loss (the last chunk under per-layer recompute): one unit."""
        return self.loss_fn(self.module[-1](x), target)

    def _run_layers_checkpointed(self, x: Any, target: Any, seen: dict[int, int] | None) -> Any:
        """Each layer its own non-reentrant checkpoint (the last one with the loss on the last
        chunk); ``seen`` (when measuring) counts each checkpoint's input, what it keeps."""
        n = len(self.module)
        for j, layer in enumerate(self.module):
            if seen is not None:
                self._count(flatten(x)[1], seen)
            if j == n - 1 and self.loss_fn is not None:
                return checkpoint(self._run_tail, x, target, use_reentrant=False)
            x = checkpoint(layer, x, use_reentrant=False)
        if self.loss_fn is not None:   # a chunk without layers: only the loss
            return checkpoint(self.loss_fn, x, target, use_reentrant=False)
        return x

    def forward(self, mb: int, x: Any, target: Any = None, *, split: bool = False,
                keep: bool = True, node_split: bool | None = None,
                measure: bool | None = None) -> Any:
        """Run microbatch ``mb``; returns the output (the loss on the last chunk). With ``keep``
        (training) the state for backward is kept; ``split`` prepares the I/W split
        (``node_split``: the graph-node split; default: unless checkpointing). ``measure``
        (default: the chunk's ``measure_activations``) counts the bytes saved for backward,
        with a Python hook per saved tensor: a diagnostic, not for every step.

        With activation checkpointing the whole chunk (its layers and, on the last chunk, the
        loss) is one checkpoint, or (``recompute_granularity="layer"``) each layer is: per
        microbatch it keeps only its input (each layer's input), and backward recomputes the
        chunk (one layer at a time). Its I/W split is then one full backward at I (the
        recomputed activations are freed at once, not held until W); W has nothing left to do."""
        if keep and self.checkpointing and torch.is_grad_enabled():
            return self._forward_checkpointed(mb, x, target, split,
                                              self.measure if measure is None else measure)
        if node_split is None:
            node_split = not self.checkpointing
        node_split = split and node_split
        split = split and not node_split  # from here on: whether to cut the graph per layer
        measure = self.measure if measure is None else measure
        seen: dict[int, int] = {}
        hooks = (torch.autograd.graph.saved_tensors_hooks(*self._hooks(seen))
                 if keep and measure else contextlib.nullcontext())
        chunk_in = _rg(flatten(x)[1])
        segments: list[tuple[list[Tensor], list[Tensor], bool]] = []
        cur, head_in = x, None
        with hooks, self.autocast():
            for j, layer in enumerate(self.module):
                if split and j > 0:
                    cur = _cut(cur)
                out = layer(cur)
                if split and self._into_loss(j, out):
                    head_in = cur  # the head and the loss form one segment (see _into_loss)
                elif split:
                    segments.append((_rg(flatten(cur)[1]), _rg(flatten(out)[1]),
                                     bool(self._layer_params[j])))
                cur = out
            if self.loss_fn is not None:
                if split and len(self.module) and head_in is None:
                    cur = _cut(cur)
                loss = self.loss_fn(cur, target)
                if split:
                    segments.append((_rg(flatten(cur if head_in is None else head_in)[1]), [loss],
                                     head_in is not None and bool(self._layer_params[-1])))
                cur = loss
        if keep and torch.is_grad_enabled():
            outs = [cur] if self.loss_fn is not None else _rg(flatten(cur)[1])
            self._keep(mb, _MbState(chunk_in, outs, split or node_split, segments,
                                    saved_bytes=sum(seen.values()),
                                    loss=cur if self.loss_fn is not None else None,
                                    node_split=node_split))
        return cur

    def _into_loss(self, j: int, out: Any) -> bool:
        """Whether layer ``j``'s output goes straight into the loss without a cut: the last
        layer of the last chunk when it returns what no stage boundary carries (a fused head's
        hidden states and weight, for a loss that computes the logits itself)."""
        if self.loss_fn is None or j != len(self.module) - 1:
            return False
        try:
            flatten(out)
        except TypeError:
            return True
        return False

    def _forward_checkpointed(self, mb: int, x: Any, target: Any, split: bool,
                              measure: bool) -> Any:
        seen: dict[int, int] = {}
        with self.autocast():
            if self.granularity == "layer":
                cur = self._run_layers_checkpointed(x, target, seen if measure else None)
            else:
                if measure:
                    self._count(flatten(x)[1], seen)   # what the checkpoint keeps: the chunk's input
                cur = checkpoint(self._run_all, x, target, use_reentrant=False)
        outs = [cur] if self.loss_fn is not None else _rg(flatten(cur)[1])
        self._keep(mb, _MbState(_rg(flatten(x)[1]), outs, split, [], whole=True,
                                saved_bytes=sum(seen.values()),
                                loss=cur if self.loss_fn is not None else None))
        return cur

    def _keep(self, mb: int, st: "_MbState") -> None:
        self.state[mb] = st
        self.live_bytes += st.saved_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _hooks(self, seen: dict[int, int]) -> tuple[Callable, Callable]:
        def pack(t: Tensor) -> Tensor:
            self._count([t], seen)
            return t.detach()  # not `t`: holding an output with its grad_fn would form a cycle

        return pack, lambda t: t

    def _count(self, ts: Sequence[Tensor], seen: dict[int, int]) -> None:
        params = self._param_ptrs
        for t in ts:
            try:
                st = _storage(t)
                ptr = st.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if ptr not in params:
                seen[ptr] = st.nbytes()

    # ---- backward ----------------------------------------------------------------------------
    def _free(self, mb: int) -> None:
        st = self.state.pop(mb)
        self.live_bytes -= st.saved_bytes

    def _out_grads(self, st: _MbState, grads: Sequence[Tensor] | None, optimizer: Any
                   ) -> tuple[list[Tensor], list[Tensor]]:
        if self.loss_fn is not None:
            # seeded with d(scaled loss)/d(loss): the same gradients as scaling the loss, without
            # a multiply and its backward node per microbatch
            loss = st.outputs[0]
            return [loss], [optimizer.loss_grad(loss)]
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
        if st.split and not st.whole:
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
        if st.whole:  # checkpointed: one full backward (recompute, input and weight gradients)
            outs, gs = self._out_grads(st, grads, optimizer)
            if outs and outs[0].requires_grad:
                optimizer.backward(outs, gs)
            st.pending_w = []
            return self._input_grads(st)
        if st.node_split:
            return self._node_input(st, grads, optimizer)
        # the outputs are the last segment's outputs, which the loop below walks from
        _, gs = self._out_grads(st, grads, optimizer)
        pending: list[tuple[list[Tensor], list[Tensor]]] = []
        for k in range(len(st.segments) - 1, -1, -1):
            seg_in, seg_out, has_params = st.segments[k]
            live = [(o, g) for o, g in zip(seg_out, gs) if o.requires_grad]
            if has_params and live:
                pending.append(([o for o, _ in live], [g for _, g in live]))
            if not seg_in:
                gs = []
                continue
            if live:  # W re-walks only segments with parameters: free the others' graphs now
                got = torch.autograd.grad([o for o, _ in live], seg_in, [g for _, g in live],
                                          retain_graph=has_params, allow_unused=True)
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
        if st.node_split:
            self._node_weight(st, optimizer)
            self._free(mb)
            return
        outs = [o for os_, _ in st.pending_w for o in os_]
        gs = [g for _, gs_ in st.pending_w for g in gs_]
        if outs and self.params:
            optimizer.backward(outs, gs, inputs=self.params)
        self._free(mb)

    # ---- graph-node I/W split ----------------------------------------------------------------
    def _node_input(self, st: _MbState, grads: Sequence[Tensor] | None, optimizer: Any
                    ) -> list[Tensor]:
        outs, gs = self._out_grads(st, grads, optimizer)
        roots = [(o, g) for o, g in zip(outs, gs) if o.requires_grad]
        if not st.inputs:   # nothing to differentiate at I (token ids in): W is the whole backward
            st.boundaries, st.pending_w = [], [([o for o, _ in roots], [g for _, g in roots])]
            return []
        in_nodes = {get_gradient_edge(t).node for t in st.inputs}
        prm_nodes = {get_gradient_edge(p).node for p in self.params}
        root_edges = [get_gradient_edge(o) for o, _ in roots]
        kids, ri, rp = _analyse([e.node for e in root_edges], in_nodes, prm_nodes)
        # Boundaries: input-region nodes with edges into parameter-only subgraphs.
        bounds = []
        indeg: dict[Any, int] = {}
        for ks in kids.values():
            for c, _ in ks:
                indeg[c] = indeg.get(c, 0) + 1
        for node, ks in kids.items():
            if ri[node]:
                po = [(c, nr) for c, nr in ks if rp[c] and not ri[c]]
                if po:
                    bounds.append((node, po, ()))
        if any(indeg[c] > 1 for _, po, _ in bounds for c, _ in po):
            # A parameter node fed directly from two places (a parameter used twice without a
            # view in between): re-running one boundary could reach the other. Do the whole
            # backward now; W has nothing left to do.
            if roots:
                optimizer.backward([o for o, _ in roots], [g for _, g in roots])
            st.boundaries, st.pending_w = [], []
            return self._input_grads(st)
        direct = [(o, g) for (o, g), e in zip(roots, root_edges) if rp[e.node] and not ri[e.node]]
        grads_at: dict[Any, tuple] = {}
        handles = [node.register_prehook(_recorder(grads_at, node)) for node, _, _ in bounds]
        try:
            live = [(o, g) for (o, g), e in zip(roots, root_edges) if ri[e.node]]
            if st.inputs and live:
                got = torch.autograd.grad([o for o, _ in live], st.inputs, [g for _, g in live],
                                          retain_graph=True, allow_unused=True)
            else:
                got = (None,) * len(st.inputs)
        finally:
            for h in handles:
                h.remove()
        st.boundaries = [(node, po, grads_at.get(node, ())) for node, po, _ in bounds]
        st.pending_w = [([o for o, _ in direct], [g for _, g in direct])]
        return [g if g is not None else torch.zeros_like(t) for g, t in zip(got, st.inputs)]

    def _node_weight(self, st: _MbState, optimizer: Any) -> None:
        bounds, st.boundaries = st.boundaries or [], None
        direct = [(os_, gs_) for os_, gs_ in st.pending_w or () if os_]
        owned = None if direct else self._boundary_params(bounds)
        if owned is not None:
            # Each boundary owns its parameters: one backward per boundary from its recorded
            # gradients straight into them (only its weight-gradient kernels run, and each
            # gradient is accumulated while it is hot, not held until every boundary is done).
            for (node, _, grads_out), prms in zip(bounds, owned):
                outs = [(GradientEdge(node, k), g) for k, g in enumerate(grads_out) if g is not None]
                if outs and prms:
                    optimizer.backward([e for e, _ in outs], [g for _, g in outs], inputs=prms)
            return
        roots: list[Any] = []
        rgrads: list[Tensor] = []
        for node, po, grads_out in bounds:
            outs = [(GradientEdge(node, k), g) for k, g in enumerate(grads_out) if g is not None]
            if not outs:
                continue
            # Only this node runs: the inputs are its own parameter edges (no input-gradient
            # work, and no path into another boundary's edges).
            got = torch.autograd.grad([e for e, _ in outs], [GradientEdge(c, nr) for c, nr in po],
                                      [g for _, g in outs], allow_unused=True)
            for (c, nr), g in zip(po, got):
                if g is not None:
                    roots.append(GradientEdge(c, nr))
                    rgrads.append(g)
        for os_, gs_ in direct:
            roots += os_
            rgrads += gs_
        if roots and self.params:
            # with no chunk input and no boundary, every leaf reached is a parameter
            optimizer.backward(roots, rgrads, inputs=self.params if bounds or st.inputs else None)

    def _boundary_params(self, bounds: Sequence[tuple[Any, list, tuple]]) -> list[list[Tensor]] | None:
        """Per boundary, the parameters under its parameter-only edges; None when a parameter
        sits under two boundaries (a tied weight: its gradients must be summed before the one
        accumulation that the data-parallel reducer counts)."""
        mine = {id(p): p for p in self.params}
        seen: set[int] = set()
        out = []
        for _, po, _ in bounds:
            prms, stack, visited = [], [c for c, _ in po], set()
            while stack:
                node = stack.pop()
                if node in visited:
                    continue
                visited.add(node)
                var = getattr(node, "variable", None)
                if var is not None and id(var) in mine:
                    if id(var) in seen:
                        return None
                    seen.add(id(var))
                    prms.append(var)
                stack.extend(c for c, _ in node.next_functions if c is not None)
            out.append(prms)
        return out

    def kept_grad_bytes(self, mb: int) -> int:
        """Bytes of the distinct storages microbatch ``mb`` keeps between its I and its W (the
        gradients recorded at the boundaries and the outputs deferred whole to W), parameters
        excluded; the memory model's ``LayerCost.pending_grad_bytes`` is this, per layer."""
        st = self.state[mb]
        grads = [g for _, _, gs in st.boundaries or () for g in gs if g is not None]
        grads += [g for _, gs in st.pending_w or () for g in gs]
        seen = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
        return sum(n for ptr, n in seen.items() if ptr not in self._param_ptrs)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes


def _recorder(store: dict, node: Any) -> Callable[[tuple], None]:
    def hook(grad_outputs: tuple) -> None:
        store[node] = grad_outputs
    return hook


def _analyse(roots: Sequence[Any], in_nodes: set, prm_nodes: set
             ) -> tuple[dict[Any, list[tuple[Any, int]]], dict[Any, bool], dict[Any, bool]]:
    """The autograd graph under ``roots``: children per node, and whether each node reaches a
    chunk input (``ri``) or a parameter (``rp``). Iterative post-order (graphs can be deep)."""
    kids: dict[Any, list[tuple[Any, int]]] = {}
    ri: dict[Any, bool] = {}
    rp: dict[Any, bool] = {}
    stack: list[tuple[Any, bool]] = [(n, False) for n in roots if n is not None]
    while stack:
        node, done = stack.pop()
        if done:
            ks = kids[node]
            ri[node] = node in in_nodes or any(ri[c] for c, _ in ks)
            rp[node] = node in prm_nodes or any(rp[c] for c, _ in ks)
            continue
        if node in kids:
            continue
        ks = [(c, nr) for c, nr in node.next_functions if c is not None]
        kids[node] = ks
        stack.append((node, True))
        stack.extend((c, False) for c, _ in ks if c not in kids)
    return kids, ri, rp
