"""ZeRO-3 per pipeline stage: torch's FSDP2 (``fully_shard``) on each layer of a rank, over the
stage's data-parallel group (``optimizer.zero_stage=3``).

Each layer (a pipeline "block") is its own FSDP2 unit over ``mesh.submesh("dp")``: its
parameters are DTensors sharded on dim 0 across the stage's replicas, and the optimizer
(torch.optim, through :class:`engine.optim.TorchStageOptimizer`'s clipping, loss scaling and
non-finite policy) updates the shards. With ``precision`` bf16 / fp16, FSDP2's
``MixedPrecisionPolicy`` computes in 16 bits (all-gathers 16-bit weights) while the sharded
masters, the gradients' reduction and the optimizer state stay fp32.

How the pipeline drives FSDP (the approach of torch.distributed.pipelining's stage, which turns
FSDP's per-backward behaviour off and reduces once per step, ``perform_reduce_grad``):

* FSDP's own hooks still gather a layer before its forward and before its backward, but never
  reshard on their own and never reduce: every unit runs with ``reshard_after_forward=False``,
  ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)`` and
  ``set_is_last_backward(False)``. Gradients accumulate, unsharded, over the microbatches.
* The runtime calls :meth:`FsdpStageOptimizer.after_compute` after every F / B / I / W of a chunk;
  with ``reshard_after_forward`` on, the chunk's layers are resharded there unless one of its
  microbatches has run I and not yet W, or the chunk has finished its step's backward work (the
  reduction below needs the unsharded gradients and reshards anyway). So a zero-bubble W always
  finds its layers gathered and never all-gathers (:meth:`before_compute` checks it); the
  parameters of a microbatch between its I and W stay gathered, which is what W's kernels read.
* :meth:`sync_gradients` (once per step, after the schedule) runs each unit's post-backward with
  gradient sync on: one reduce-scatter per layer per step (summed; the step divides by the
  replicas, as the torch backend does), then reshards.

All-gathers per layer per step: 1 with ``reshard_after_forward=False``; with it on, one per
forward and one per backward (B or I) that finds the layer resharded (``stats["fsdp_all_gathers"]``
counts them per action kind).

Not supported yet (refused in ``Pipeline.check_arguments``): tied parameters.

Example::

    opt = FsdpStageOptimizer(OptimizerConfig(name="adamw", zero_stage=3),
                             nn.ModuleDict({"0": layer0, "1": layer1}), mesh, microbatches=4)
    params_of = opt.compute_parameters   # what a Chunk differentiates (the gathered parameters)
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine import choices
from engine.optim import LossScaler, OptimizerConfig, TorchStageOptimizer, make_torch_optimizer

__all__ = ["FsdpStageOptimizer", "WholeTensorState", "RESHARD_CHOICES", "resolve_reshard", "weight_dtype_for"]

RESHARD_CHOICES = ("auto", "true", "false")


def resolve_reshard(value: Any, memory_limited: bool = False) -> bool:
    """``optimizer.reshard_after_forward`` as a bool. ``auto``: reshard when the run is memory
    limited (parameters gathered only while a layer computes), else keep each layer gathered for
    the whole step (one all-gather per layer per step instead of one per forward and backward).

    >>> resolve_reshard("auto"), resolve_reshard("auto", memory_limited=True), resolve_reshard(False)
    (False, True, False)
    """
    key = str(value).lower()
    if key not in RESHARD_CHOICES:
        raise ValueError(f"reshard_after_forward={value!r}; use auto, true or false")
    return memory_limited if key == "auto" else key == "true"


def weight_dtype_for(zero_stage: int, precision: str) -> torch.dtype:
    """The dtype a rank builds its layers in: fp32 under ZeRO-3 (FSDP2 keeps fp32 sharded masters
    and casts to 16 bits itself), else the precision's weight dtype."""
    from engine.optim import weight_dtype

    return torch.float32 if int(zero_stage) == 3 else weight_dtype(precision)


def _mp_policy(precision: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if choices.weight_bytes(precision) >= 4:
        return MixedPrecisionPolicy()
    low = torch.bfloat16 if precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def _group(layer: nn.Module) -> Any:
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(layer)._fsdp_param_group


class WholeTensorState:
    """Checkpoint and parity methods of an optimizer whose parameters are DTensors (FSDP2's dp
    shards, tensor parallelism's tp shards): whole tensors out, each re-sharded like its
    parameter on the way in, so that a checkpoint loads into any layout. Gathering is a
    collective over the group the tensors are sharded on. Put before the optimizer class it
    extends (its ``state_dict`` / ``load_state_dict`` wrap that class's)."""

    named: dict[str, Tensor]

    def state_dict(self) -> dict:
        """As the torch backend's, with whole (gathered) state tensors."""
        sd = super().state_dict()  # type: ignore[misc]
        sd["state"] = {n: {k: _full(v) for k, v in st.items()} for n, st in sd["state"].items()}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Whole state tensors (any layout's checkpoint), each re-sharded like its parameter."""
        state = {n: {k: _like(self.named[n], v) for k, v in st.items()}
                 for n, st in sd.get("state", {}).items() if n in self.named}
        super().load_state_dict({**sd, "state": state})  # type: ignore[misc]

    def layer_state_dict(self, layer: nn.Module) -> dict[str, Tensor]:
        """``layer.state_dict()`` with whole tensors."""
        return {n: _full(t) for n, t in layer.state_dict().items()}

    def load_layer_state_dict(self, layer: nn.Module, sd: dict[str, Tensor]) -> None:
        """Load whole tensors into ``layer``, each sharded parameter keeping only its shard."""
        own = layer.state_dict()
        missing = sorted(set(own) - set(sd))
        if missing:
            raise KeyError(f"checkpoint layer lacks {missing}")
        with torch.no_grad():
            for n, t in own.items():
                _local(t).copy_(_local(_like(t, sd[n])))

    def full_grads(self) -> dict[str, Tensor]:
        """Whole gradients by name."""
        return {n: _full(p.grad).detach().clone() for n, p in self.named.items()
                if p.grad is not None}

    def full_parameters(self) -> dict[str, Tensor]:
        """Whole parameters by name (fp32 masters under FSDP2)."""
        return {n: _full(p).detach().clone() for n, p in self.named.items()}


class FsdpStageOptimizer(WholeTensorState, TorchStageOptimizer):
    """torch.optim on this rank's FSDP2-sharded layers (see the module docstring)."""

    backend = "fsdp"
    accepts_gradient_edges = True

    def __init__(self, config: OptimizerConfig, module: nn.Module, mesh: Any, *,
                 microbatches: int, precision: str = "fp32", nonfinite: str = "raise",
                 norm_skip: Iterable[str] = (), reshard_after_forward: bool = False):
        from torch.distributed.fsdp import fully_shard

        choices.check_precision(precision)
        choices.check_nonfinite(nonfinite)
        if list(norm_skip):
            raise ValueError("zero_stage=3 does not support tied parameters yet; untie them or "
                             "use zero_stage 0-2")
        if any(type(pl).__name__ == "_StridedShard" for p in module.parameters()
               for pl in getattr(p, "placements", ())):
            raise ValueError("zero_stage=3 cannot shard a fused q/k/v split over tensor_parallel "
                             "part by part (GPT's qkv): FSDP2 would shard its rows again in a layout "
                             "its gathers do not reproduce; use zero_stage=0 with tensor_parallel "
                             "(a Hugging Face model's separate projections do run), or "
                             "tensor_parallel=1")
        if any(getattr(p, "_tp_grad_sum", False) for p in module.parameters()):
            raise ValueError("zero_stage=3 with tensor parallelism does not support parameters whose "
                             "gradient is summed over tp (sequence parallelism, replicated_with_grad_"
                             "allreduce); use zero_stage=0 or tensor_parallel=1")
        self.config, self.mesh, self.m = config, mesh, microbatches
        self.precision, self.nonfinite = precision, nonfinite
        self.reshard_after_forward = bool(reshard_after_forward)
        self.layers: list[nn.Module] = []
        dp_mesh = mesh.submesh("dp")
        for layer in module.values() if isinstance(module, nn.ModuleDict) else module.children():
            if not any(p.requires_grad for p in layer.parameters()):
                continue
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False,
                        mp_policy=_mp_policy(precision))
            layer.set_gradient_divide_factor(1.0)   # sum: step() divides, as the torch backend
            layer.set_force_sum_reduction_for_comms(True)
            self._accumulate(layer)
            self.layers.append(layer)
        self.named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.norm_skip: set[str] = set()
        self.params = list(self.named.values())
        self.steps = self.attempts = 0
        self.scaler = LossScaler(choices.loss_scaled(precision))
        self.opt = make_torch_optimizer(config, self.params or [nn.Parameter(torch.zeros(0))],
                                        fused=False)
        self.reducer = None
        self._synced = False
        self.all_gathers: Counter = Counter()
        self._kind = "init"
        self._count_all_gathers()
        self._unsharded = {id(layer): self._gathered_params(layer) for layer in self.layers}
        self._done: dict[int, int] = {}     # chunk -> microbatches whose backward work is done

    # ---- FSDP plumbing -----------------------------------------------------------------------
    @staticmethod
    def _accumulate(layer: nn.Module) -> None:
        """FSDP off its per-backward behaviour: accumulate unsharded, reshard only when told."""
        layer.set_is_last_backward(False)
        layer.set_reshard_after_backward(False)
        layer.set_requires_gradient_sync(False)

    def _count_all_gathers(self) -> None:
        """Count each real all-gather of a unit by the action that caused it (FSDP's unshard is a
        no-op when the unit is gathered or its gather is in flight)."""
        for layer in self.layers:
            group = _group(layer)
            orig = group.unshard

            def unshard(async_op: bool = False, _g: Any = group, _orig: Any = orig) -> Any:
                if _g._all_gather_result is None and not _g.is_unsharded:
                    self.all_gathers[self._kind] += 1
                return _orig(async_op)

            group.unshard = unshard

    def _gathered_params(self, layer: nn.Module) -> list[Tensor]:
        """The layer's unsharded parameters (the autograd leaves its forward uses); made by one
        all-gather now, kept by FSDP across reshards (their storage is freed and refilled)."""
        layer.unshard()
        params = [p for p in layer.parameters() if p.requires_grad]
        layer.reshard()
        return params

    def compute_parameters(self, layer: nn.Module) -> list[Tensor]:
        """What a chunk differentiates for ``layer``: its gathered parameters under FSDP."""
        got = self._unsharded.get(id(layer))
        return got if got is not None else [p for p in layer.parameters() if p.requires_grad]

    def before_compute(self, kind: str, chunk: Any, microbatch: int) -> None:
        """Before F / B / I / W of ``chunk``: attribute all-gathers to ``kind``; a W must find its
        layers gathered (it reads the weights its I left gathered; it never all-gathers)."""
        self._kind = kind
        if kind == "I":
            # W reads what I leaves gathered. Gather here every layer, so that a chunk whose I
            # has nothing to differentiate (token ids in: W is its whole backward) too.
            for layer in chunk.module:
                if id(layer) in self._unsharded:
                    layer.unshard()
        if kind == "W" and self.reshard_after_forward:
            for layer in chunk.module:
                if id(layer) in self._unsharded and not _group(layer).is_unsharded:
                    raise RuntimeError(f"internal: chunk {chunk.index} W of microbatch "
                                       f"{microbatch} found layer {layer} resharded")

    def after_compute(self, kind: str, chunk: Any, microbatch: int, train: bool = True) -> None:
        """After F / B / I / W of ``chunk``: reshard its layers when the policy says so and no
        gathered weight is still needed (a pending W, or the end-of-step reduction)."""
        self._kind = "other"
        if kind in ("B", "W"):
            self._done[chunk.index] = self._done.get(chunk.index, 0) + 1
        if not self.reshard_after_forward:
            return
        if train:
            pending_w = any(st.pending_w is not None for st in chunk.state.values())
            finished = self._done.get(chunk.index, 0) >= self.m
            if pending_w or finished:
                return
        for layer in chunk.module:
            if id(layer) in self._unsharded:
                layer.reshard()

    # ---- protocol ----------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self._synced = False
        self._done = {}
        self.all_gathers = Counter()

    def sync_gradients(self) -> None:
        """Reduce-scatter this step's accumulated gradients (one per layer), then reshard."""
        from torch.distributed.fsdp import fully_shard

        if self._synced:
            return
        self._synced = True
        self._kind = "reduce"
        for layer in self.layers:
            layer.set_requires_gradient_sync(True)
            layer.set_reshard_after_backward(True)
            layer.set_is_last_backward(True)
            state = fully_shard.state(layer)
            if not _group(layer).is_unsharded:
                if any(fp._unsharded_param.grad is not None for fp in _group(layer).fsdp_params):
                    raise RuntimeError(f"internal: layer {layer} was resharded before its "
                                       "gradients were reduced")
                self._accumulate(layer)   # no backward ran on it this step: nothing to reduce
                continue
            _group(layer).post_backward()
            state._root_post_backward_final_callback()
            self._accumulate(layer)

    def accumulated_grad(self, param: Tensor) -> Tensor:
        raise NotImplementedError("zero_stage=3 does not support tied parameters yet")

    def _grad(self, p: Tensor) -> Tensor:
        if p.grad is None:   # unused this step: a zero shard
            p.grad = torch.zeros_like(p)
        return p.grad

    def step(self, need_norm: bool = True) -> tuple[bool, float | None]:
        """As the torch backend's, but the norm and the non-finite check are always global: each
        replica holds a different gradient shard, so a rank-local check could disagree."""
        return super().step(need_norm=True)

    def _global_norm(self) -> tuple[float, list[int]]:
        """Global grad norm from the local shards: one all-reduce over every rank."""
        p = self.mesh.num_stages
        dev = self.params[0].device if self.params else torch.device("cpu")
        local = [_local(pr.grad) for pr in self.params
                 if pr.grad is not None and _counted_here(pr, self.mesh)]
        sq = torch.zeros((), dtype=torch.float64, device=dev)
        if local:
            sq += torch.stack([v.double() for v in torch._foreach_norm(local)]).pow(2).sum()
        finite = torch.isfinite(sq)
        buf = torch.zeros(1 + p, dtype=torch.float64, device=dev)
        buf[0] = torch.where(finite, sq, torch.zeros_like(sq))
        buf[1 + self.mesh.pipeline_rank] = (~finite).double()
        if self.mesh.distributed and self.mesh.world_size > 1:
            dist.all_reduce(buf)
        buf = buf.cpu()
        return float(buf[0]) ** 0.5, [j for j in range(p) if buf[1 + j] > 0]

    def optimizer_state_bytes(self) -> int:
        return sum(_local(t).numel() * t.element_size() for st in self.opt.state.values()
                   for t in st.values() if isinstance(t, Tensor))


def _counted_here(param: Tensor, mesh: Any) -> bool:
    """Whether this rank's shard of ``param`` enters the global norm: always without tensor
    parallelism; with it, a parameter split over tp on every tp rank, one whole over tp (norms,
    rowwise biases) on tp rank 0 only."""
    if getattr(mesh, "tensor_parallel", 1) == 1:
        return True
    names = tuple(getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ())
    if "tp" in names and not param.placements[names.index("tp")].is_replicate():
        return True
    return mesh.tp_rank == 0


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(ref: Tensor, whole: Tensor) -> Tensor:
    """``whole`` placed as ``ref`` is (a DTensor's shard of it), or as is when ``ref`` is whole."""
    if not hasattr(ref, "device_mesh") or whole.dim() == 0:
        return whole.to(ref.device) if isinstance(whole, Tensor) else whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(ref.device, ref.dtype), ref.device_mesh, ref.placements)


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t
