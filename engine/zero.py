"""DeepSpeed ZeRO backend for one pipeline rank's parameters (the only module that imports DeepSpeed).

`DeepSpeedStageOptimizer` implements `engine.optim.StageOptimizer` for ``zero_stage`` 0, 1 and 2.
DeepSpeed is imported lazily, inside the constructor, so ``import engine`` stays light.

How the pipeline drives DeepSpeed
---------------------------------
The runtime does its own autograd (``torch.autograd.backward``) because a pipeline stage receives
the gradient of its output from the next stage and may split backward into an input half and a
weight half (zero-bubble). DeepSpeed's engine is used only for what it is good at: reducing and
sharding gradients over the data-parallel group, clipping, and the optimizer step on the fp32
(partitioned) master weights. Concretely:

* The engine is built with ``gradient_accumulation_steps=1`` and
  ``managed_gradient_accumulation=False``: every ``backward`` only accumulates gradients and the
  single ``engine.step()`` at the end of the microbatches is the accumulation boundary. Nothing is
  divided by DeepSpeed, so the usual double-division trap (``engine.backward`` dividing a
  gradient that already carries ``1/m``) cannot occur: the last stage back-propagates
  ``scale_loss(loss) = loss / m * loss_scale`` and every other gradient arrives already scaled.
  DeepSpeed then averages over the data-parallel replicas.
* ``backward`` runs plain ``torch.autograd.backward(tensors, grad_tensors, inputs=...)`` and then
  ``engine.allreduce_gradients()``. For ZeRO-2 that is DeepSpeed's per-backward epilogue (flush
  of the reduce-scatter bucket that its gradient hooks filled); for ZeRO 0/1 it is a no-op
  outside ``step()`` (they reduce once, at the boundary, like DeepSpeed's own PipelineEngine).
  So the input-gradient half of a zero-bubble backward (``inputs=[stage_input]``) touches no
  parameter and the weight half (``inputs=params``) feeds DeepSpeed's hooks exactly once.
* The mpu adapter gives DeepSpeed ``dp_group`` as its data-parallel group and ``pipeline_group``
  as its model-parallel group, and every parameter is marked ``param.model_parallel = True``
  (each stage's parameters are distinct, so each is counted once: DeepSpeed counts a
  non-model-parallel parameter only on model-parallel rank 0). DeepSpeed therefore all-reduces
  the gradient norm and the overflow flag over data-parallel *and* pipeline ranks: clipping is by
  the global norm of the whole model and a non-finite gradient on any stage skips the step on all.

Precision
---------
``fp32``, ``bf16-autocast`` and ``fp16-autocast`` keep fp32 weights in the module (the runtime
runs the forward under ``torch.autocast`` for the latter two); DeepSpeed's ZeRO then shards the
optimizer state (and, ZeRO-2, the gradients) of those fp32 weights.

``bf16`` and ``fp16`` keep 16-bit weights in the module, as large-model engines do, and use
DeepSpeed's own mixed-precision optimizers: the fp32 master weights and the moments live in the
optimizer, partitioned over the replicas under ZeRO-1/2, and the 16-bit weights are refreshed
from them (all-gathered) after each step. Gradients accumulate across microbatches in
``optimizer.grad_accum_dtype`` (fp32 by default). Which DeepSpeed optimizer runs is DeepSpeed's
own choice for the config: bf16 + ZeRO-1 + fp32 accumulation is its ``BF16_Optimizer`` (a full
fp32 gradient buffer, filled by per-parameter hooks as backward produces each 16-bit gradient:
``immediate_grad_update``); every other combination is ``DeepSpeedZeroOptimizer`` with bf16/fp16
enabled (ZeRO-1 with fp32 accumulation keeps a ``grad_accum`` per parameter, filled by
``backward_epilogue`` after each backward; ZeRO-2 accumulates its reduce-scattered partition in
fp32). Gradients produced outside ``engine.backward`` work with both: the hooks fire for any
``torch.autograd.backward``, and this module calls the epilogue itself. ``communication_data_type``
follows the accumulation dtype, so the data-parallel reduction of fp32-accumulated gradients is
in fp32 too (DeepSpeed's default would reduce them in 16 bits).
DeepSpeed has no ZeRO-0 path with fp32 accumulation (its engine refuses that mix), so ZeRO-0 with
16-bit weights runs DeepSpeed's ZeRO-1 machinery over a one-rank group (nothing is sharded: each
replica holds the whole fp32 master) and this module averages the accumulated fp32 gradients over
the replicas before the step. DeepSpeed refuses fp16 weights on a CPU without fp16 support;
use ``bf16`` or ``fp16-autocast`` there.

fp16 (either kind) uses the engine's one dynamic loss scaler (``engine.optim.LossScaler``, shared
with the torch backend):
``scale_loss`` multiplies by the current scale, DeepSpeed is told the scale
(``override_loss_scale``; its own scaler is static and never used) so it unscales before
clipping, and the scale halves after a skipped step (never below 1) and doubles after
``growth_interval`` clean ones. For ZeRO-0 with fp32 weights (DeepSpeed's plain optimizer path)
this module checks finiteness, unscales and clips itself, with the same global reductions.

Restrictions
------------
ZeRO-2 works with every schedule: interleaved chunks (several in one module) and the split
input/weight backward of zero-bubble, as the tests show (parameters equal a single process to
~1e-8). ZeRO-2 is refused for parameters tied across stages (``norm_skip`` non-empty): the
runtime sums a tie's gradients between stages before the step, and ZeRO-2 has already
reduce-scattered them. Collective calls: ``step``, ``state_dict`` and ``load_state_dict`` must
be called by every rank of the job (they reduce over the data-parallel and pipeline groups).
DeepSpeed's CPU accelerator JIT-builds a small shared-memory op on first use (about a minute,
then cached in ~/.cache/torch_extensions).

Example::

    opt = DeepSpeedStageOptimizer(OptimizerConfig(name="adamw", lr=1e-3, zero_stage=1), module,
                                  dp_group=dp, pipeline_group=pp, microbatches=4, precision="fp32")
    opt.backward([opt.scale_loss(loss)])              # last stage
    opt.backward([out], [grad_from_next_stage])       # other stages
    skipped, norm = opt.step()
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine import choices
from engine.footprint import zero_bucket_elements
from engine.optim import (LossScaler, NonFiniteError, check_optimizer_config, lr_at,
                          make_torch_optimizer, weight_dtype)

__all__ = ["DeepSpeedStageOptimizer", "ZeroMpu"]


class ZeroMpu:
    """DeepSpeed "model parallel unit": data parallel = ``dp_group``, model parallel = ``pipeline_group``.

    Example::

        mpu = ZeroMpu(dp_group, pipeline_group)
        mpu.get_model_parallel_world_size()   # number of pipeline ranks
    """

    def __init__(self, dp_group: Any, pipeline_group: Any) -> None:
        self._dp = dp_group
        self._pp = pipeline_group

    def get_data_parallel_group(self) -> Any:
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self._dp)

    def get_model_parallel_group(self) -> Any:
        return self._pp

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self._pp)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self._pp)

    def get_model_parallel_src_rank(self) -> int:
        return dist.get_process_group_ranks(self._pp)[0]


def _ensure_deepspeed_env() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _as_list(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, Tensor):
        return [x]
    return list(x)


class DeepSpeedStageOptimizer:
    """StageOptimizer over DeepSpeed ZeRO 0/1/2 for this rank's module (all of its chunks).

    Example::

        opt = DeepSpeedStageOptimizer(cfg, nn.ModuleList(chunks), dp_group=dp,
                                      pipeline_group=pp, microbatches=4, precision="bf16")
    """

    backend = "deepspeed"
    accepts_gradient_edges = False  # DeepSpeed's hooks filter backward roots by requires_grad

    def __init__(self, config: Any, module: nn.Module, *, dp_group: Any, pipeline_group: Any,
                 microbatches: int, precision: str, nonfinite: str = "raise",
                 norm_skip: Iterable[str] = ()) -> None:
        norm_skip = set(norm_skip)
        _check_arguments(config, module, precision, nonfinite, microbatches, norm_skip,
                         dp_group, pipeline_group)
        self.config, self.module = config, module
        self.name, self.zero_stage = str(config.name).lower(), int(config.zero_stage)
        self.microbatches, self.precision = int(microbatches), precision
        self.nonfinite = nonfinite
        self.dp_group, self.pipeline_group = dp_group, pipeline_group
        self.grad_clip = float(config.grad_clip) if config.grad_clip else 0.0
        self.low = choices.weight_bytes(precision) < 4          # 16-bit weights, fp32 masters
        self.scaled = choices.loss_scaled(precision)
        self.grad_accum_dtype = getattr(config, "grad_accum_dtype", "fp32")
        # DeepSpeed's ZeRO / bf16 optimizer wraps the torch one (else: ZeRO-0, fp32 weights)
        self._wrapped = self.zero_stage > 0 or self.low
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
        unknown = norm_skip - set(self._names.values())
        if unknown:
            raise ValueError(f"norm_skip names {sorted(unknown)} are not parameters of this module")
        self._norm_skip = {id(p) for p in self._params if self._names[id(p)] in norm_skip}
        self._attempts = 0
        for p in self._params:
            p.model_parallel = True  # distinct per pipeline rank: count once in the global norm
            # The second copy of a parameter tied across stages: DeepSpeed leaves it out of the
            # norm (its own pipeline engine's mechanism for tied weights).
            p.ds_pipe_replicated = id(p) in self._norm_skip

        self.scaler = LossScaler(self.scaled)   # the engine's one fp16 loss scaler
        self._applied_steps = 0
        self._last_norm: float | None = None
        self._last_overflow = False
        self._initialize_deepspeed()
        if self._wrapped and self.scaled:
            self._ds_opt.override_loss_scale(self.loss_scale)
        self._set_lr(lr_at(config, 0))

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale

    # ------------------------------------------------------------------ construction helpers
    def _ds_config(self) -> dict:
        """DeepSpeed's config for this rank (see the module docstring for each choice)."""
        bucket = zero_bucket_elements(sum(p.numel() for p in self._params),
                                      dist.get_world_size(self.dp_group))
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "gradient_clipping": self.grad_clip if self._wrapped else 0.0,
            "zero_optimization": {"stage": max(self.zero_stage, 1 if self.low else 0),
                                  "overlap_comm": False,
                                  "contiguous_gradients": self.zero_stage == 2,
                                  "reduce_scatter": True, "reduce_bucket_size": bucket,
                                  "allgather_bucket_size": bucket},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2 ** 31 - 1,
            "wall_clock_breakdown": False,
        }
        if self.low:
            cfg[self.precision] = ({"enabled": True, "immediate_grad_update": True,
                                    "check_grad_overflow": True} if self.precision == "bf16"
                                   else {"enabled": True, "loss_scale": self.loss_scale})
            cfg["data_types"] = {"grad_accum_dtype": self.grad_accum_dtype}
            cfg["communication_data_type"] = self.grad_accum_dtype
        return cfg

    def _initialize_deepspeed(self) -> None:
        """Wrap a torch optimizer over this rank's parameters in DeepSpeed's engine."""
        _ensure_deepspeed_env()
        import deepspeed  # lazy: heavy, and only this module may import it

        if self.low and self.precision == "fp16":
            _check_fp16_supported()
        base = make_torch_optimizer(self.config, self._params)
        if not self._wrapped:
            base.step = self._wrap_plain_step(base.step)  # type: ignore[method-assign]
        # ZeRO-0 with 16-bit weights: ZeRO-1's machinery over a one-rank group, reduced here.
        own_dp = self.low and self.zero_stage == 0 and dist.get_world_size(self.dp_group) > 1
        ds_dp = dist.new_group([dist.get_rank()], use_local_synchronization=True) if own_dp \
            else self.dp_group
        self._own_dp = own_dp
        # DeepSpeed imports optional packages inside initialize(); a garbage collection running a
        # finaliser that imports in the middle of that can corrupt CPython 3.11's import-lock
        # table (KeyError in importlib._bootstrap), seen when several engines are built in turn.
        gc.collect()
        gc.disable()
        try:
            self.engine, self._ds_opt, _, _ = deepspeed.initialize(
                model=self.module, optimizer=base, config=self._ds_config(),
                mpu=ZeroMpu(ds_dp, self.pipeline_group), dist_init_required=False)
        finally:
            gc.enable()
        self._base = base
        # BF16_Optimizer keeps one flat fp32 gradient buffer; its per-parameter views by id
        groups = getattr(self._ds_opt, "fp32_groups_gradients", None) if self.low else None
        self._hp_grad = {} if groups is None else {
            id(p): (i, j) for i, g in enumerate(self._ds_opt.bf16_groups) for j, p in enumerate(g)}
        self._fill_accum = bool(getattr(self._ds_opt, "use_grad_accum_attribute", False))

    def _wrap_plain_step(self, inner_step):
        """ZeRO-0: DeepSpeed all-reduced the full grads; add overflow skip, unscale and clipping."""

        def step(closure=None):
            grads = [p.grad for p in self._params if p.grad is not None]
            sq = torch.zeros(1, dtype=torch.float64)
            for p in self._params:
                if p.grad is not None and id(p) not in self._norm_skip:
                    sq += p.grad.detach().double().pow(2).sum()
            # Grads are identical across replicas after the all-reduce: sum over the pipeline only.
            dist.all_reduce(sq, group=self.pipeline_group)
            norm = math.sqrt(sq.item()) / self.loss_scale if math.isfinite(sq.item()) else math.inf
            if not math.isfinite(norm):
                self._last_overflow, self._last_norm = True, math.inf
                return None
            self._last_overflow, self._last_norm = False, norm
            factor = 1.0 / self.loss_scale
            if self.grad_clip > 0 and norm > self.grad_clip:
                factor *= self.grad_clip / (norm + 1e-6)
            if factor != 1.0:
                for g in grads:
                    g.mul_(factor)
            return inner_step(closure) if closure is not None else inner_step()

        return step

    # ------------------------------------------------------------------ StageOptimizer protocol
    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss / microbatches * loss_scale``: what the last stage back-propagates."""
        return loss * (self.loss_scale / self.microbatches)

    def loss_grad(self, loss: Tensor) -> Tensor:
        """``d scale_loss(loss) / d loss`` shaped like ``loss``: what the last stage seeds its
        backward with (the same gradients as back-propagating ``scale_loss(loss)``)."""
        return torch.full_like(loss, self.loss_scale / self.microbatches)

    def backward(self, tensors: Tensor | Sequence[Tensor], grad_tensors: Sequence[Tensor | None] | None = None,
                 inputs: Sequence[Tensor] | None = None, retain_graph: bool = False) -> None:
        """Accumulate gradients of ``tensors`` (seeded with ``grad_tensors``) into ``inputs``.

        ``inputs=None`` means every leaf (a full backward); the zero-bubble halves pass the stage
        input (I) or this chunk's parameters (W). DeepSpeed's ZeRO-2 hooks fire for parameters only.
        """
        ts = _as_list(tensors)
        gs = _as_list(grad_tensors) if grad_tensors is not None else [None] * len(ts)
        if len(gs) != len(ts):
            raise ValueError(f"backward got {len(ts)} tensors but {len(gs)} grad_tensors")
        pairs = [(t, g) for t, g in zip(ts, gs) if t is not None and t.requires_grad]
        if not pairs:
            return
        ins = list(inputs) if inputs is not None else None
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], inputs=ins,
                                retain_graph=retain_graph)
        # ZeRO-2's epilogue flushes what its gradient hooks bucketed since the last step; a
        # backward that reached no parameter yet (a chunk without any) has nothing to flush, and
        # DeepSpeed has not even allocated the bucket then (`ready_for_gradients` is False).
        touched = self.zero_stage < 2 or getattr(self._ds_opt, "ready_for_gradients", True)
        if touched and (ins is None or any(id(x) in self._names for x in ins)):
            if self._fill_accum:  # ZeRO-1, separate accumulation dtype: param.grad -> grad_accum
                self._ds_opt.backward_epilogue()
            self.engine.allreduce_gradients()

    def sync_gradients(self) -> None:
        """DeepSpeed reduces over the replicas inside its own epilogue and step: nothing here."""

    def zero_grad(self) -> None:
        """Drop parameter gradients (``step`` already leaves none behind)."""
        for p in self._params:
            p.grad = None

    def accumulated_grad(self, param: Tensor) -> Tensor:
        """The tensor holding ``param``'s gradient accumulated so far this step (to be changed
        in place, e.g. summed with a tied copy on another stage): ``param.grad``, or with 16-bit
        weights DeepSpeed's fp32 accumulation buffer for it. Created as zeros if none yet."""
        if id(param) in self._hp_grad:
            i, j = self._hp_grad[id(param)]
            self._ds_opt.fp32_groups_has_gradients[i][j] = True
            return self._ds_opt.fp32_groups_gradients[i][j].view(param.shape)
        if self._fill_accum:
            if param.grad_accum is None:
                param.grad_accum = torch.zeros_like(param, dtype=torch.float32)
            return param.grad_accum
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizer DeepSpeed steps (its state: moments, momentum)."""
        return [self._inner()]

    def memory_kinds(self) -> dict[str, list[Tensor]]:
        """DeepSpeed's long-lived buffers by kind, for memory measurement: the fp32
        accumulation buffer (gradients) and the fp32 master partitions (optimizer state)."""
        opt = self._ds_opt
        grads = list(getattr(opt, "fp32_groups_gradients_flat", []) or [])
        masters = list(getattr(opt, "fp32_groups_flat_partition", None)
                       or getattr(opt, "single_partition_of_fp32_groups", None) or [])
        return {"gradients": grads, "optimizer_state": masters if self._wrapped else []}

    def step(self, need_norm: bool = True) -> tuple[bool, float | None]:
        """Reduce over replicas, clip by the global norm, update. (DeepSpeed computes the global
        norm on every step, so ``need_norm`` changes nothing here.)

        Returns ``(skipped, grad_norm)``; ``grad_norm`` is the pre-clip global norm over all
        stages and replicas, None for a skipped step. A non-finite gradient anywhere skips the
        step on every rank (fp16, or ``nonfinite="skip"``) or raises ``NonFiniteError`` on every
        rank (``nonfinite="raise"`` with fp32/bf16).
        """
        self._attempts += 1
        self._last_norm, self._last_overflow = None, False
        previous_lr = self.lr()
        self._set_lr(lr_at(self.config, self._applied_steps))
        if self._own_dp:
            self._average_over_replicas()
        self.engine.step()
        if self._wrapped:
            overflow = bool(getattr(self._ds_opt, "overflow", False))
            raw = self._ds_opt._global_grad_norm if not overflow else math.inf
            norm = float(raw) if raw is not None else None
            if norm is not None and norm < 0:  # DeepSpeed's sentinel for a non-finite norm
                norm = math.inf
        else:
            overflow, norm = self._last_overflow, self._last_norm
            for p in self._params:  # a skipped step must not leak its grads into the next one
                p.grad = None
        self._update_loss_scale(overflow)
        if overflow and not self.scaled and self.nonfinite == "raise":
            raise NonFiniteError(
                f"non-finite gradient at optimizer step {self._attempts - 1} (found by the global "
                "check over all stages and replicas; rank "
                f"{dist.get_rank()}); lower the lr, enable grad_clip, or pass nonfinite='skip'")
        if overflow:
            self._set_lr(previous_lr)
        else:
            self._applied_steps += 1
        return overflow, (None if overflow else norm)

    def _average_over_replicas(self) -> None:
        """ZeRO-0 with 16-bit weights: average the accumulated gradients over ``dp_group``."""
        d = dist.get_world_size(self.dp_group)
        if self._hp_grad:
            flats = list(self._ds_opt.fp32_groups_gradients_flat)
            for g in self._ds_opt.fp32_groups_has_gradients:
                g[:] = [True] * len(g)  # every replica counts every gradient in the norm
        else:
            grads = [self.accumulated_grad(p) for p in self._params]
            flats = [torch.cat([g.reshape(-1) for g in grads])] if grads else []
        for flat in flats:
            dist.all_reduce(flat, group=self.dp_group)
            flat.div_(d)
        if not self._hp_grad and flats:
            off = 0
            for g in grads:
                g.copy_(flats[0][off:off + g.numel()].view_as(g))
                off += g.numel()

    def lr(self) -> float:
        """Learning rate of the last applied step (before any: the first step's), as the torch
        backend reports it."""
        return float(self._base.param_groups[0]["lr"]) if not self._wrapped else float(self._ds_opt.param_groups[0]["lr"])

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state (momentum / Adam moments) held by this rank: ~1/d under ZeRO>=1."""
        inner = self._base if not self._wrapped else self._ds_opt.optimizer
        total = 0
        for st in inner.state.values():
            for v in st.values():
                if isinstance(v, Tensor) and v.dim() > 0:
                    total += v.numel() * v.element_size()
        return int(total)

    def full_grads(self) -> dict[str, Tensor]:
        """This rank's accumulated parameter gradients before ``step`` (ZeRO 0/1: not yet reduced;
        16-bit weights: the fp32 accumulation, still multiplied by the loss scale)."""
        if self.zero_stage == 2:
            raise NotImplementedError("full_grads() is unavailable with zero_stage=2: DeepSpeed "
                                      "reduce-scatters each gradient as soon as it is computed; "
                                      "compare parameters after step() instead")
        if self.low:
            return {self._names[id(p)]: self.accumulated_grad(p).detach().float().clone()
                    for p in self._params}
        return {self._names[id(p)]: p.grad.detach().clone() for p in self._params if p.grad is not None}

    # ------------------------------------------------------------------ masters
    def master_weights(self) -> dict[str, Tensor]:
        """Every parameter's fp32 master weight, whole, keyed by name (with 16-bit weights:
        gathered from DeepSpeed's partitions, a collective over the data-parallel group; with
        fp32 weights: the module's own tensors)."""
        if not self.low:
            return {self._names[id(p)]: p.detach() for p in self._params}
        from deepspeed.utils import safe_get_full_fp32_param
        return {self._names[id(p)]: safe_get_full_fp32_param(p).detach().to("cpu", copy=True)
                .reshape(p.shape) for p in self._params}

    def load_master_weights(self, named: dict[str, Tensor]) -> None:
        """Set the fp32 masters (and the module's weights, rounded) of the parameters named in
        ``named``; others are left as they are. Call after ``load_state_dict``."""
        if self.low:
            from deepspeed.utils import safe_set_full_fp32_param
        with torch.no_grad():
            for p in self._params:
                v = named.get(self._names[id(p)])
                if v is None:
                    continue
                if tuple(v.shape) != tuple(p.shape):
                    raise ValueError(f"master weight {self._names[id(p)]} has shape "
                                     f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
                if self.low:
                    safe_set_full_fp32_param(p, v.to(p.device, torch.float32))
                p.copy_(v)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Full (unsharded) per-parameter state keyed by the module's parameter names.

        Same layout as the torch backend's (``{"state": {name: {key: tensor}}, "steps": ...}``,
        Adam entries carry a per-parameter ``"step"``), so either backend loads the other's
        state, with any split. Collective over ``dp_group`` for ZeRO 1/2 (shards are gathered).
        The fp32 master weights are not part of it: see :meth:`master_weights`.
        """
        per_param: dict[str, dict[str, Tensor]] = {}
        keys = self._state_keys()
        for p in self._params:
            entry: dict[str, Tensor] = {}
            for k in keys:
                v = self._get_state(p, k)
                if v is not None:
                    entry[k] = v.detach().to("cpu", copy=True).reshape(p.shape)
            if entry and self.name in ("adam", "adamw"):
                entry["step"] = torch.tensor(float(self._applied_steps))
            if entry:
                per_param[self._names[id(p)]] = entry
        return {"optimizer": self.name, "state": per_param, "steps": self._applied_steps,
                "attempts": self._attempts, **self.scaler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Load state from either backend's ``state_dict()`` (any split or replica count).

        Entries for parameters this rank does not hold are ignored. Call it after the module's
        weights were loaded: the fp32 master copy is re-synced from them (with 16-bit weights,
        then load the exact masters with :meth:`load_master_weights`). Collective over all
        ranks (for ZeRO 1/2 a zero-gradient, lr = 0 step first creates DeepSpeed's state).
        """
        name = sd.get("optimizer")
        if name is not None and name != self.name:
            raise ValueError(f"optimizer state is for {name!r}, this run uses {self.name!r}; "
                             "use the same optimizer or start without optimizer state")
        state = sd.get("state", {})
        self._prime_state()
        self._sync_master_from_module()
        keys = set(self._state_keys())
        for p in self._params:
            entry = state.get(self._names[id(p)], {})
            for k, v in entry.items():
                if isinstance(v, Tensor) and v.dim() > 0 and k in keys:
                    if v.shape != p.shape:
                        raise ValueError(f"optimizer state {self._names[id(p)]}.{k} has shape "
                                         f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
                    self._set_state(p, k, v)
        steps = int(sd.get("steps", sd.get("applied_steps", 0)))
        self._applied_steps = steps
        self._attempts = int(sd.get("attempts", steps))
        self._set_step_counters(steps)
        self.scaler.load_state_dict(sd)
        if self._wrapped and self.scaled:
            self._ds_opt.override_loss_scale(self.loss_scale)
        self._set_lr(lr_at(self.config, self._applied_steps))

    # ------------------------------------------------------------------ internals
    def _set_lr(self, lr: float) -> None:
        groups = self._base.param_groups if not self._wrapped else self._ds_opt.param_groups
        for g in groups:
            g["lr"] = lr

    def _update_loss_scale(self, overflow: bool) -> None:
        self.scaler.update(overflow)
        if self._wrapped and self.scaled:
            self._ds_opt.override_loss_scale(self.loss_scale)

    def _inner(self) -> torch.optim.Optimizer:
        return self._base if not self._wrapped else self._ds_opt.optimizer

    def _state_keys(self) -> list[str]:
        """Names of the per-parameter state tensors (identical on every replica of this stage)."""
        keys: set[str] = set()
        for st in self._inner().state.values():
            keys |= {k for k, v in st.items() if isinstance(v, Tensor) and v.dim() > 0}
        return sorted(keys)

    def _get_state(self, p: nn.Parameter, key: str) -> Tensor | None:
        if not self._wrapped:
            return self._base.state.get(p, {}).get(key)
        from deepspeed.utils import safe_get_full_optimizer_state
        # Collective over dp_group: ranks owning no slice of p contribute zeros.
        return safe_get_full_optimizer_state(p, key)

    def _set_state(self, p: nn.Parameter, key: str, value: Tensor) -> None:
        if not self._wrapped:
            self._base.state[p][key] = value.to(p.device, p.dtype).clone()
            return
        from deepspeed.utils import safe_set_full_optimizer_state
        safe_set_full_optimizer_state(p, value.to(p.device, torch.float32), key)

    def _set_step_counters(self, steps: int) -> None:
        for st in self._inner().state.values():
            if "step" in st:
                st["step"] = torch.tensor(float(steps)) if isinstance(st["step"], Tensor) else steps

    def _sync_master_from_module(self) -> None:
        if not self._wrapped:
            return
        from deepspeed.utils import safe_set_full_fp32_param
        for p in self._params:
            safe_set_full_fp32_param(p, p.detach().float())

    def _prime_state(self) -> None:
        """Create the optimizer's state tensors by a step with zero gradients and lr = 0."""
        if self._inner().state:
            return
        saved = [(p.detach().clone()) for p in self._params]
        groups = self._base.param_groups if not self._wrapped else self._ds_opt.param_groups
        for g in groups:
            g["lr"] = 0.0
        scale, self.scaler.scale = self.scaler.scale, 1.0
        if self._wrapped and self.scaled:
            self._ds_opt.override_loss_scale(1.0)
        zero = sum((p * 0.0).sum() for p in self._params)
        self.backward([zero])
        self.engine.step()
        self.scaler.scale = scale
        with torch.no_grad():
            for p, s in zip(self._params, saved):
                p.copy_(s)


def _check_arguments(config: Any, module: nn.Module, precision: str, nonfinite: str,
                     microbatches: int, norm_skip: set[str], dp_group: Any,
                     pipeline_group: Any) -> None:
    """Refuse what this backend cannot run, before DeepSpeed is imported."""
    choices.check_nonfinite(nonfinite)
    choices.check_precision(precision)
    check_optimizer_config(config, precision)
    stage = int(config.zero_stage)
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if norm_skip and stage == 2:
        raise ValueError(
            "zero_stage=2 cannot be used with parameters tied across pipeline stages "
            f"({sorted(norm_skip)}): their gradients must be summed between the stages "
            "before the step, but ZeRO-2 reduce-scatters every gradient over the "
            "data-parallel group as soon as backward produces it. Use zero_stage=1, or untie.")
    if dp_group is None or pipeline_group is None:
        raise ValueError("DeepSpeedStageOptimizer needs torch.distributed initialised and the "
                         "mesh's dp_group and pipeline_group; for one process use the torch "
                         "backend (optimizer.backend='torch', zero_stage=0)")
    want = weight_dtype(precision)
    for p in module.parameters():
        if p.dtype != want:
            raise ValueError(f"precision={precision!r} keeps {want} weights in the module: found "
                             f"a {p.dtype} parameter; build the layers and cast them with "
                             "module.to(engine.optim.weight_dtype(precision))")


def _check_fp16_supported() -> None:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if not acc.is_fp16_supported():
        raise ValueError(f"precision='fp16' keeps fp16 weights, which DeepSpeed does not support "
                         f"on this device ({acc.device_name()}); use precision='bf16', or "
                         "'fp16-autocast' (fp32 weights, fp16 compute)")
