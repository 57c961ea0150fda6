"""Tensor parallelism within a pipeline stage: DTensor ``parallelize_module`` on each layer of a
rank over the mesh's tp axis (``pipeline.tensor_parallel``), the vocabulary-parallel
cross-entropy and the optimizer backend that steps DTensor-sharded parameters.

A layer says how it is sharded: ``layer.tp_plan(tp)`` returns ``parallelize_module``'s plan (a
dict ``{submodule fqn: ParallelStyle}``) and switches the layer to its local sizes (attention
heads per tp rank). The GPT layers (``experiments.models.gpt``) write theirs once (colwise q/k/v
and MLP up, rowwise attention out and MLP down, vocabulary-parallel embedding and LM head); the
Hugging Face layers translate the model's own ``base_model_tp_plan``
(:func:`styles_from_hf_plan`). A layer without parameters is left replicated; one with
parameters and no ``tp_plan`` is refused.

With sequence parallelism (the GPT layers' ``sequence_parallel``, and the Hugging Face
Llama-style layers': ``experiments.models.hf.with_sequence_parallel``) the norms and the residual
stream are split on the sequence (``SequenceParallel``, ``Shard(1)``): the sharded matmuls
all-gather their input and reduce-scatter their output (gloo has both collectives).

Inside a stage every tp rank runs the same program; between stages each tp rank exchanges
activations and gradients with the same tp rank of the neighbouring stage (the pipeline group
of its (replica, tp rank), ``engine.mesh``). Activations crossing a stage boundary are whole
(replicated over tp), or ``[b, t / tp, d]`` under sequence parallelism; a sharded LM head's logits stay sharded on the vocabulary (a DTensor
``Shard(-1)``) and :func:`vocab_parallel_cross_entropy` computes the loss from the shards (two
all-reduces of ``[tokens]`` floats and one of the picked logits; nothing ``[tokens, vocab]`` is
gathered).

:class:`TpStageOptimizer` is torch.optim (foreach kernels) on the DTensor parameters: gradients
are summed over the data-parallel group only (the local shards, bucketed), the global norm
counts a sharded gradient's shards on every tp rank and a replicated one once, and checkpoints
hold whole tensors (gathered on save, re-sharded on load), so they load into any layout. Under
``zero_stage=3`` ``engine.fsdp`` shards the tp-sharded layers over dp instead (2-D parameters).

Example::

    layer = GPTBlock(64, heads=4)
    parallelize_layer(layer, mesh.submesh("tp"))      # 2 heads per rank with tp=2
    loss = vocab_parallel_cross_entropy(head(x), targets)   # head(x): DTensor logits
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine.fsdp import WholeTensorState
from engine.optim import OptimizerConfig, TorchStageOptimizer, make_torch_optimizer

__all__ = ["parallelize_layer", "shard_shapes", "FusedColwiseParallel", "ReplicateWithGradSum",
           "vocab_parallel_cross_entropy", "styles_from_hf_plan", "TpStageOptimizer", "HF_STYLES"]

IGNORE_INDEX = -100


def _colwise_cls() -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel


class FusedColwiseParallel(_colwise_cls()):  # type: ignore[misc]
    """``ColwiseParallel`` for a Linear whose output is ``parts`` projections side by side (a
    fused q/k/v): each part is sharded over tp on its own (``_StridedShard``), so a rank's
    output is its slice of every part, ``[..., parts * out / parts / tp]``, in part order.
    Keywords as ``ColwiseParallel``'s (``input_layouts=Shard(1)`` under sequence parallelism).

    >>> FusedColwiseParallel(3).parts
    3
    """

    def __init__(self, parts: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.parts = int(parts)

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        for pname, param in module.named_parameters():
            dist_param = nn.Parameter(
                distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.parts)],
                                  src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad)
            module.register_parameter(pname, dist_param)

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module,
                           outputs: Any, device_mesh: Any) -> Any:
        return outputs.to_local()   # the strided shard is what the caller splits locally


def parallelize_layer(layer: nn.Module, tp_mesh: Any) -> nn.Module:
    """Shard ``layer`` over ``tp_mesh`` with its own plan (``layer.tp_plan(tp)``); a layer
    without parameters stays as it is.

    >>> parallelize_layer(nn.GELU(), None)
    GELU(approximate='none')
    """
    if not any(True for _ in layer.parameters()):
        return layer
    plan_of = getattr(layer, "tp_plan", None)
    if plan_of is None:
        raise TypeError(f"{type(layer).__name__} has parameters but no tensor-parallel plan (a "
                        "tp_plan(tp) method); pipeline.tensor_parallel > 1 runs the GPT and "
                        "Hugging Face models only: set pipeline.tensor_parallel=1")
    from torch.distributed.tensor.parallel import parallelize_module

    plan = plan_of(tp_mesh.size())
    if plan:
        parallelize_module(layer, tp_mesh, plan)
    return layer


def shard_shapes(layer: nn.Module, tp: int) -> nn.Module:
    """``layer`` with the shapes of one tensor-parallel rank's shards and no DTensor (what the
    planner profiles for ``pipeline.tensor_parallel=tp``): for each entry of its own plan
    (``layer.tp_plan(tp)``, which also switches it to its local sizes) a column-parallel
    Linear's outputs and a row-parallel Linear's inputs or Embedding's rows divided by ``tp``,
    freshly initialised; sequence-parallel norms kept whole.

    >>> from experiments.models.gpt import GPTBlock
    >>> blk = shard_shapes(GPTBlock(64, heads=4), 2)
    >>> blk.heads, tuple(blk.qkv.weight.shape), tuple(blk.fc_out.weight.shape)
    (2, (96, 64), (64, 128))
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for fqn, style in layer.tp_plan(int(tp)).items():
        mod = layer.get_submodule(fqn)
        if isinstance(style, ColwiseParallel) and isinstance(mod, nn.Linear):
            new: nn.Module = nn.Linear(mod.in_features, mod.out_features // tp, bias=mod.bias is not None)
        elif isinstance(style, RowwiseParallel) and isinstance(mod, nn.Linear):
            new = nn.Linear(mod.in_features // tp, mod.out_features, bias=mod.bias is not None)
        elif isinstance(style, RowwiseParallel) and isinstance(mod, nn.Embedding):
            new = nn.Embedding(mod.num_embeddings // tp, mod.embedding_dim)
        else:
            continue
        parent, _, name = fqn.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, name, new.to(mod.weight.dtype))
    return layer


# ---- Hugging Face plans ------------------------------------------------------------------------
def _parallel_style_cls() -> Any:
    from torch.distributed.tensor.parallel.style import ParallelStyle

    return ParallelStyle


class ReplicateWithGradSum(_parallel_style_cls()):  # type: ignore[misc]
    """A module kept whole on every tp rank whose gradient is a partial sum per rank (a norm over
    each rank's own heads: transformers' ``replicated_with_grad_allreduce``): its parameters are
    marked, and :class:`TpStageOptimizer` sums their gradients over the tp group.

    >>> lin = ReplicateWithGradSum()._apply(nn.Linear(2, 2), None)
    >>> lin.weight._tp_grad_sum
    True
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for prm in module.parameters():
            prm._tp_grad_sum = True   # type: ignore[attr-defined]
        return module


def _hf_style(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "replicated_with_grad_allreduce": ReplicateWithGradSum,
    }
    if name not in styles:
        raise ValueError(f"tensor-parallel style {name!r} of the model's base_model_tp_plan is "
                         f"not supported (supported: {sorted(styles)}); set "
                         "pipeline.tensor_parallel=1")
    return styles[name]()


HF_STYLES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep",
             "rowwise_split_input", "embedding_rowwise", "replicated_with_grad_allreduce")


def styles_from_hf_plan(plan: Mapping[str, str], module: nn.Module,
                        prefix: str = "") -> dict[str, Any]:
    """``parallelize_module``'s plan for ``module`` from a transformers ``base_model_tp_plan``
    (``{"layers.*.self_attn.q_proj": "colwise", ...}``): the entries under ``prefix`` (e.g.
    ``"layers.*."`` for a decoder layer) whose submodule exists, with their style names
    (:data:`HF_STYLES`) mapped to DTensor styles; others (expert-parallel ``local_*``, ...) are
    refused.

    >>> blk = nn.Module(); blk.mlp = nn.Module(); blk.mlp.up_proj = nn.Linear(2, 4)
    >>> sorted(styles_from_hf_plan({"layers.*.mlp.up_proj": "colwise", "norm": "x"}, blk,
    ...                            "layers.*."))
    ['mlp.up_proj']
    """
    names = {n for n, _ in module.named_modules()}
    out: dict[str, Any] = {}
    for key, style in plan.items():
        if not key.startswith(prefix):
            continue
        fqn = key[len(prefix):]
        if fqn in names:
            out[fqn] = _hf_style(str(style))
    return out


# ---- the loss ------------------------------------------------------------------------------------
class _VocabParallelCE(torch.autograd.Function):
    """Mean cross-entropy over the targets that are not ``IGNORE_INDEX``, from logits sharded on
    the vocabulary (``local``: ``[N, V / tp]``, this rank's columns from ``start``)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, targets: Tensor, group: Any, start: int) -> Tensor:
        x = local.float()
        mx = x.max(dim=-1).values
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        z = x - mx.unsqueeze(-1)
        ez = z.exp()
        sumexp = ez.sum(dim=-1)
        dist.all_reduce(sumexp, group=group)
        mine = (targets >= start) & (targets < start + x.shape[-1])
        idx = (targets - start).clamp(0, x.shape[-1] - 1)
        picked = z.gather(1, idx.unsqueeze(1)).squeeze(1) * mine
        dist.all_reduce(picked, group=group)
        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        loss = ((sumexp.log() - picked) * valid).sum() / count
        ctx.save_for_backward(ez, sumexp, idx, mine, valid, count)
        ctx.in_dtype = local.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        ez, sumexp, idx, mine, valid, count = ctx.saved_tensors
        g = ez / sumexp.unsqueeze(-1)
        g.scatter_add_(1, idx.unsqueeze(1), -mine.to(g.dtype).unsqueeze(1))
        g.mul_((valid.to(g.dtype) * grad / count).unsqueeze(-1))
        return g.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: Any, targets: Tensor) -> Tensor:
    """``F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())`` (mean over the
    targets that are not -100) for DTensor ``logits`` sharded on the last (vocabulary) dim, from
    each rank's shard: the same loss on every tp rank, gradients only into this rank's logits.

    Example (inside a tp group; ``head`` a ``ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False)`` Linear)::

        loss = vocab_parallel_cross_entropy(head(hidden), targets)   # == F.cross_entropy
    """
    from torch.distributed.tensor import Shard

    mesh = logits.device_mesh
    last = logits.ndim - 1
    if mesh.ndim != 1 or not (isinstance(logits.placements[0], Shard)
                              and logits.placements[0].dim in (-1, last)):
        raise ValueError(f"vocab_parallel_cross_entropy wants logits sharded on the vocabulary "
                         f"over one mesh dimension, got {logits.placements}")
    local = logits.to_local()
    vl = local.shape[-1]
    if vl * mesh.size() != logits.shape[-1]:
        raise ValueError(f"vocabulary {logits.shape[-1]} is not divisible by tensor_parallel "
                         f"{mesh.size()}; choose a vocabulary that tp divides")
    start = mesh.get_local_rank() * vl
    return _VocabParallelCE.apply(local.reshape(-1, vl), targets.reshape(-1).to(local.device),
                                  mesh.get_group(), start)


# ---- the optimizer -------------------------------------------------------------------------------
def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded(t: Tensor) -> bool:
    """Whether a (DTensor) parameter is split over tp (else every tp rank holds all of it)."""
    return hasattr(t, "placements") and any(not p.is_replicate() for p in t.placements)


class TpStageOptimizer(WholeTensorState, TorchStageOptimizer):
    """torch.optim on this rank's DTensor-sharded (and replicated) parameters under tensor
    parallelism (see the module docstring). Foreach kernels (DTensor has no rule for the fused
    ones); the data-parallel sum is on the local shards, not overlapped with the backward."""

    backend = "torch"
    accepts_gradient_edges = True

    def __init__(self, config: OptimizerConfig, named_params: Mapping[str, Tensor], mesh: Any, *,
                 microbatches: int, precision: str = "fp32", nonfinite: str = "raise",
                 norm_skip: Iterable[str] = ()):
        if list(norm_skip):
            raise ValueError("tensor_parallel > 1 does not support tied parameters; untie them "
                             "(model.tie_embeddings=false) or set tensor_parallel=1")
        if getattr(config, "step_sync", "global") == "post_validate":
            raise ValueError("tensor_parallel > 1 does not support step_sync='post_validate' (the rank-local "
                             "norm would not sum the tp shards); use step_sync='global' or tensor_parallel=1")
        config = dataclasses.replace(config, overlap_grad_reduce=False)
        super().__init__(config, named_params, mesh, microbatches=microbatches,
                         precision=precision, nonfinite=nonfinite)
        # foreach kernels take DTensors or plain tensors, not both: one param group for each
        groups = [{"params": g} for g in ([p for p in self.params if hasattr(p, "to_local")],
                                          [p for p in self.params if not hasattr(p, "to_local")])
                  if g]
        self.opt = make_torch_optimizer(config, groups or [nn.Parameter(torch.zeros(0))],
                                        fused=False)
        self.reducer = None

    def sync_gradients(self) -> None:
        """Sum the local gradient shards over the data-parallel group (once per step); first,
        the gradients of :class:`ReplicateWithGradSum` modules over the tp group."""
        if self._synced:
            return
        self._synced = True
        for prm in self.params:
            g = prm.grad
            # a backward may leave a gradient placed otherwise than its parameter (the
            # vocabulary-parallel embedding's comes out replicated): keep only this rank's shard
            if g is not None and hasattr(g, "placements") and g.placements != prm.placements:
                prm.grad = g.redistribute(prm.device_mesh, prm.placements)
        partial = [self._grad(p) for p in self.params if getattr(p, "_tp_grad_sum", False)]
        if partial and self.mesh.tensor_parallel > 1:
            self._all_reduce_buckets(partial, self.mesh.tp_group)
        if self.mesh.data_parallel > 1:
            self._all_reduce_buckets([_local(self._grad(p)) for p in self.params],
                                     self.mesh.dp_group)

    def step(self, need_norm: bool = True) -> tuple[bool, float | None]:
        """As the torch backend's, with the norm and the non-finite check always global: tp
        ranks hold different shards, so a rank-local check could disagree."""
        return super().step(need_norm=True)

    def _global_norm(self) -> tuple[float, list[int]]:
        """Sharded gradients: every tp rank's shard; replicated ones: tp rank 0's copy. One
        all-reduce over the tp group, one over the pipeline."""
        p = self.mesh.num_stages
        dev = _local(self.params[0]).device if self.params else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float64, device=dev)
        for name, prm in self.named.items():
            if prm.grad is None or (not _sharded(prm) and self.mesh.tp_rank != 0):
                continue
            sq += _local(prm.grad).detach().double().pow(2).sum()
        finite = torch.isfinite(sq)
        buf = torch.zeros(1 + p, dtype=torch.float64, device=dev)
        buf[0] = torch.where(finite, sq, torch.zeros_like(sq))
        buf[1 + self.mesh.pipeline_rank] = (~finite).double()
        if self.mesh.distributed:
            dist.all_reduce(buf, group=self.mesh.tp_group)
            if p > 1:
                dist.all_reduce(buf, group=self.mesh.pipeline_group)
        buf = buf.cpu()
        return float(buf[0]) ** 0.5, [j for j in range(p) if buf[1 + j] > 0]

    def optimizer_state_bytes(self) -> int:
        return sum(_local(t).numel() * t.element_size() for st in self.opt.state.values()
                   for t in st.values() if isinstance(t, Tensor))

    # ---- whole tensors: a checkpoint loads into any (pp, dp, tp) -----------------------------
