"""Per-stage optimizers: the StageOptimizer protocol, the plain torch backend, the lr schedule.

A backend owns everything between "gradients were produced on this rank" and "parameters were
updated": loss scaling, the data-parallel gradient average, global gradient-norm clipping, the
non-finite check and the update. The runtime only calls the protocol; ``engine.backend.make_optimizer``
picks this module's torch backend or the DeepSpeed one (``engine.zero``). What both backends
share lives here: the config, the lr schedule, the fp16 loss scaler and the torch optimizer.

Example::

    cfg = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, grad_clip=1.0)
    opt = TorchStageOptimizer(cfg, dict(nn.ModuleDict({"0": layer0}).named_parameters()), mesh,
                              microbatches=4)
    opt.backward([opt.scale_loss(loss)], None)
    skipped, grad_norm = opt.step()
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

from engine import choices
from engine.choices import PRECISIONS
from engine.footprint import GRAD_BUCKET_MB
from engine.overlap import GradBucketReducer

__all__ = ["OptimizerConfig", "StageOptimizer", "TorchStageOptimizer", "NonFiniteError",
           "LossScaler", "lr_at", "make_torch_optimizer", "resolve_backend",
           "check_optimizer_config", "PRECISIONS", "weight_dtype", "compute_dtype"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype of the modules' parameters under ``precision`` (``engine.choices``).

    >>> weight_dtype("bf16"), weight_dtype("bf16-autocast")
    (torch.bfloat16, torch.float32)
    """
    return torch.float32 if choices.weight_bytes(precision) == 4 else _DTYPES[precision]


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of the forward under ``precision`` (None: no autocast).

    >>> compute_dtype("fp16-autocast"), compute_dtype("fp32")
    (torch.float16, None)
    """
    name = choices.compute_name(precision)
    return None if name is None else _DTYPES[name]



@dataclass
class OptimizerConfig:
    """Optimizer, lr schedule, clipping and backend choice (see docs/contracts.md)."""
    name: str = "sgd"                    # sgd | adam | adamw
    lr: float = 1e-3
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 0
    decay_steps: int | None = None       # cosine decay to min_lr_ratio * lr over this many steps
    min_lr_ratio: float = 0.1
    grad_clip: float | None = None       # global norm across the whole pipeline (and replicas)
    zero_stage: int = 0                  # 0, 1, 2 (DeepSpeed); 3 (FSDP2, engine.fsdp)
    backend: str = "auto"                # auto | torch | deepspeed
    grad_accum_dtype: str = "fp32"       # fp32 | bf16 | fp16 (16-bit only with 16-bit weights)
    overlap_grad_reduce: bool = True     # torch backend, data_parallel > 1: all-reduce buckets during the last backward
    grad_bucket_mb: float = GRAD_BUCKET_MB  # data-parallel all-reduce bucket size (DDP's bucket_cap_mb)
    reshard_after_forward: str = "auto"  # zero_stage=3: auto | true | false (engine.fsdp.resolve_reshard)
    step_sync: str = "global"            # global | post_validate (rank-local step, validated and rolled back later)


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient under ``nonfinite="raise"``."""


def lr_at(config: OptimizerConfig, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine decay.

    >>> lr_at(OptimizerConfig(lr=1.0, warmup_steps=4), 1)
    0.5
    """
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if not config.decay_steps:
        return config.lr
    t = min(1.0, (step - config.warmup_steps) / config.decay_steps)
    lo = config.min_lr_ratio
    return config.lr * (lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * t)))


class LossScaler:
    """The fp16 dynamic loss scale both backends use (torch.amp.GradScaler's defaults).

    Starts at ``init_scale``; an overflow halves it, never below ``min_scale`` (1.0, as
    DeepSpeed's scaler); ``growth_interval`` clean steps in a row double it. Disabled (fp32,
    bf16) it stays 1.0.

    >>> s = LossScaler(enabled=True, init_scale=4.0)
    >>> s.update(overflow=True); s.update(overflow=True); s.update(overflow=True); s.scale
    1.0
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 min_scale: float = 1.0):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        """After a step: halve on overflow (to the floor), double after a clean interval."""
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"loss_scale": float(self.scale), "good_steps": self.good_steps}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.scale = float(sd.get("loss_scale", self.scale))
        self.good_steps = int(sd.get("good_steps", 0))


def check_optimizer_config(config: OptimizerConfig, precision: str = "fp32") -> str:
    """Check the name, ZeRO stage, backend and gradient accumulation dtype of ``config`` for
    ``precision``; returns the resolved backend."""
    choices.check_optimizer_name(config.name)
    choices.check_zero_stage(config.zero_stage)
    choices.check_grad_accum_dtype(getattr(config, "grad_accum_dtype", "fp32"), precision)
    backend = resolve_backend(config, precision)
    choices.check_step_sync(getattr(config, "step_sync", "global"), backend)
    return backend


def make_torch_optimizer(config: OptimizerConfig, params: Sequence[Tensor], fused: bool = True
                         ) -> torch.optim.Optimizer:
    """The torch optimizer ``config`` names over ``params``, at the schedule's first lr. Fused
    kernels (CPU and CUDA): the step makes no temporaries the size of the parameters, which
    ``engine.footprint`` relies on. ``fused=False``: the foreach kernels (DTensor parameters,
    ``engine.fsdp``: DTensor has no sharding rule for the fused SGD kernel).

    >>> opt = make_torch_optimizer(OptimizerConfig(name="sgd", lr=0.1), [torch.zeros(2, requires_grad=True)])
    """
    c, name = config, choices.check_optimizer_name(config.name)
    lr = lr_at(c, 0)
    kernels = {"fused": True} if fused else {"foreach": True}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=c.momentum, weight_decay=c.weight_decay,
                               **kernels)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay,
               **kernels)


@runtime_checkable
class StageOptimizer(Protocol):
    """What the runtime needs from an optimizer backend (torch or DeepSpeed).

    ``backend`` names it; ``accepts_gradient_edges`` says whether ``backward`` takes autograd
    ``GradientEdge`` roots (the graph-node I/W split of zero-bubble schedules); otherwise the
    runtime splits backward by per-layer graph cuts.
    """

    backend: str
    accepts_gradient_edges: bool

    def scale_loss(self, loss: Tensor) -> Tensor: ...            # loss / m * loss_scale
    def loss_grad(self, loss: Tensor) -> Tensor: ...             # d scale_loss / d loss, like loss
    def backward(self, tensors: Sequence[Tensor], grad_tensors: Sequence[Tensor] | None,
                 inputs: Sequence[Tensor] | None = None, retain_graph: bool = False) -> None: ...
    def step(self, need_norm: bool = True) -> tuple[bool, float | None]: ...  # (skipped, norm)
    def zero_grad(self) -> None: ...
    def lr(self) -> float: ...
    def optimizer_state_bytes(self) -> int: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, sd: dict) -> None: ...
    def full_grads(self) -> dict[str, Tensor]: ...
    def accumulated_grad(self, param: Tensor) -> Tensor: ...      # to sum tied copies in place
    def sync_gradients(self) -> None: ...     # sum over replicas now (before tied copies are summed)


def resolve_backend(config: OptimizerConfig, precision: str = "fp32") -> str:
    """``"torch"`` or ``"deepspeed"`` for a config (auto: deepspeed iff zero_stage > 0 or the
    precision keeps 16-bit weights)."""
    return choices.resolve_backend(config.backend, int(config.zero_stage), precision)


@dataclass
class _Pending:
    """A post-validated step awaiting its global verdict (``TorchStageOptimizer.validate``)."""

    attempt: int
    buf: Tensor                        # [counted sum of squares, flag per stage], being reduced
    work: Any                          # the all-reduce in flight (None: nothing to reduce)
    snapshot: dict | None              # before the update (None: the rank did not update)
    grads: list[Tensor] | None = None  # the step's gradients, kept by zero_grad for a redo

    def snapshot_bytes(self) -> int:
        if self.snapshot is None:
            return 0
        ts = list(self.snapshot["params"]) + [v for st in self.snapshot["state"].values()
                                               for v in st.values() if isinstance(v, Tensor)]
        return sum(t.numel() * t.element_size() for t in ts)


class TorchStageOptimizer:
    """torch.optim on this rank's parameters, with data-parallel averaging (bucketed all-reduce
    over the mesh's data-parallel group), global-norm clipping across the pipeline, fp16 dynamic
    loss scaling and the non-finite policy. Gradients stay in ``.grad`` after :meth:`step` (as
    used by the update, for inspection) and are cleared by :meth:`zero_grad`."""

    backend = "torch"
    accepts_gradient_edges = True
    # post-validation state (class defaults: a subclass that builds itself, engine.fsdp, has none)
    step_sync = "global"
    rollback_bytes = 0
    _pending: "_Pending | None" = None
    _val_group: Any = None

    def __init__(self, config: OptimizerConfig, named_params: Mapping[str, Tensor], mesh: Any, *,
                 microbatches: int, precision: str = "fp32", nonfinite: str = "raise",
                 norm_skip: Iterable[str] = ()):
        choices.check_precision(precision)
        choices.check_nonfinite(nonfinite)
        if choices.weight_bytes(precision) < 4:
            raise ValueError(f"the torch backend keeps fp32 weights; precision={precision!r} "
                             "(16-bit weights, fp32 masters) runs on the DeepSpeed backend, or use "
                             f"precision='{precision}-autocast'")
        self.config, self.mesh, self.m = config, mesh, microbatches
        self.precision, self.nonfinite = precision, nonfinite
        self.named = {n: p for n, p in named_params.items() if p.requires_grad}
        self.norm_skip = set(norm_skip)
        self.params = list(self.named.values())
        self.steps = 0               # optimizer steps taken (skips excluded)
        self.attempts = 0            # step() calls
        self.scaler = LossScaler(choices.loss_scaled(precision))
        self.opt = make_torch_optimizer(config, self.params or [torch.nn.Parameter(torch.zeros(0))])
        self.bucket_bytes = int(getattr(config, "grad_bucket_mb", GRAD_BUCKET_MB) * 2**20)
        self.reducer = (GradBucketReducer(self.params, mesh.dp_group, microbatches, bucket_bytes=self.bucket_bytes)
                        if mesh.data_parallel > 1 and getattr(config, "overlap_grad_reduce", True) else None)
        self._synced = False
        self.step_sync = choices.check_step_sync(getattr(config, "step_sync", "global"),
                                                 self.backend)
        self._pending = None
        self.rollback_bytes = 0      # held for the pending step's rollback (snapshot, gradients)
        self._val_group = self._validation_group() if self.post_validates else None

    @property
    def post_validates(self) -> bool:
        """Whether :meth:`step` steps rank-locally and validates later (``step_sync=
        "post_validate"`` with a global quantity to wait for: clipping, the fp16 scale or
        ``nonfinite="skip"``; without one no rank waits for another in either mode)."""
        return self.step_sync == "post_validate" and (
            self.config.grad_clip is not None or self.scaler.enabled or self.nonfinite == "skip")

    @property
    def validation_pending(self) -> bool:
        """A post-validated step awaits its verdict (:meth:`validate`)."""
        return self._pending is not None

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 in fp32 / bf16)."""
        return self.scaler.scale

    # ---- protocol ----------------------------------------------------------------------------
    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * (self.loss_scale / self.m)

    def loss_grad(self, loss: Tensor) -> Tensor:
        """The gradient the last stage seeds its backward with: ``loss_scale / m``, shaped like
        ``loss``. ``backward([loss], [loss_grad(loss)])`` equals ``backward([scale_loss(loss)])``
        bit for bit, without the multiply and its backward node per microbatch."""
        return torch.full_like(loss, self.loss_scale / self.m)

    def backward(self, tensors: Sequence[Tensor], grad_tensors: Sequence[Tensor] | None,
                 inputs: Sequence[Tensor] | None = None, retain_graph: bool = False) -> None:
        torch.autograd.backward(list(tensors), grad_tensors=grad_tensors,
                                inputs=list(inputs) if inputs is not None else None,
                                retain_graph=retain_graph)

    def zero_grad(self) -> None:
        pend = self._pending
        if (pend is not None and pend.snapshot is not None and pend.grads is None
                and self.config.grad_clip is not None):   # kept for a clipped redo (validate)
            pend.grads = [self._grad(p) for p in self.params]
        for p in self.params:
            p.grad = None
        if self.reducer is not None:
            self.reducer.reset()
        self._synced = False

    def sync_gradients(self) -> None:
        """Sum this step's gradients over the replicas (once; ``step`` calls it if nobody did).
        With ``overlap_grad_reduce`` most buckets were already reduced during the last backward."""
        if self._synced:
            return
        self._synced = True
        if self.mesh.data_parallel == 1:
            return
        if self.reducer is not None:
            self.reducer.finish()
        else:
            self._all_reduce_buckets([self._grad(p) for p in self.params], self.mesh.dp_group)

    def accumulated_grad(self, param: Tensor) -> Tensor:
        """``param.grad`` (zeros if none yet): the gradient accumulated so far this step."""
        return self._grad(param)

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose state this backend holds (for memory measurement)."""
        return [self.opt]

    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])

    def step(self, need_norm: bool = True) -> tuple[bool, float | None]:
        """Average over replicas, check, clip, update; returns ``(skipped, global grad norm)``.

        The global norm costs a collective over the pipeline; it is computed when asked
        (``need_norm``) or needed (clipping, fp16, ``nonfinite="skip"``: every rank must take
        the same decision). Otherwise each rank checks its own gradients for NaN/inf (same
        reading, no collective) and the norm is reported as None.

        Post-validating (:attr:`post_validates`), the step is rank-local and optimistic (no
        clipping, no overflow): it starts the all-reduce of the norm and flags, snapshots what a
        rollback needs, updates and returns ``(False, None)``; :meth:`validate` settles it."""
        if self._pending is not None:
            raise RuntimeError("internal: the previous post-validated step was not validated; "
                               "call validate() before computing the next step's gradients")
        if self.post_validates:
            return self._step_optimistic()
        grads = self._averaged_grads()
        if (need_norm or self.config.grad_clip is not None or self.scaler.enabled
                or self.nonfinite == "skip"):
            norm, bad_stages = self._global_norm()
        else:
            norm, bad_stages = None, self._local_nonfinite()
        if bad_stages:
            if self.scaler.enabled:
                self.scaler.update(overflow=True)
                return True, None
            if self.nonfinite == "raise":
                raise NonFiniteError(
                    f"non-finite gradient at optimizer step {self.attempts - 1} on pipeline "
                    f"stage(s) {bad_stages} (rank {self.mesh.rank}); lower the lr, enable "
                    "grad_clip, or pass nonfinite='skip' to skip such steps")
            return True, None
        clip = self.config.grad_clip
        if clip is not None and norm is not None and norm > clip:
            coef = clip / (norm + 1e-6)
            for g in grads:
                g.mul_(coef)
        self._update()
        return False, norm

    def _averaged_grads(self) -> list[Tensor]:
        """Count the attempt, sum the gradients over the replicas and divide by the replicas and
        the loss scale: the step's gradients, in place in ``.grad``."""
        self.attempts += 1
        self.sync_gradients()
        grads = [self._grad(p) for p in self.params]
        div = self.mesh.data_parallel * self.loss_scale
        if div != 1.0:
            for g in grads:
                g.div_(div)
        return grads

    def _update(self) -> None:
        """The update with the gradients in ``.grad`` at the schedule's lr; counts the step."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.config, self.steps)
        self.opt.step()
        self.steps += 1
        self.scaler.update(overflow=False)

    # ---- post-validation (step_sync="post_validate") ----------------------------------------
    def _validation_group(self) -> Any:
        """A process group of this rank's pipeline for the validation all-reduce alone (it runs
        while the point-to-point transfers of the next step go on; gloo matches collectives and
        tagged transfers of one group in one tag space). Every rank creates every pipeline's."""
        m = self.mesh
        if not (m.distributed and m.num_stages > 1):
            return None
        p, t, mine = m.num_stages, getattr(m, "tensor_parallel", 1), None
        for rep in range(m.data_parallel):
            for k in range(t):
                g = dist.new_group([(rep * p + j) * t + k for j in range(p)])
                if (rep, k) == (m.replica, getattr(m, "tp_rank", 0)):
                    mine = g
        return mine

    def _step_optimistic(self) -> tuple[bool, float | None]:
        grads = self._averaged_grads()
        buf = self._local_buf()
        bad_here = bool(buf[1 + self.mesh.pipeline_rank].item() != 0)
        # one more slot: how many ranks update now (if none does, a skip voids nothing)
        buf = torch.cat([buf, buf.new_full((1,), 0.0 if bad_here else 1.0)])
        work = (dist.all_reduce(buf, group=self._val_group, async_op=True)
                if self._val_group is not None else None)
        pend = _Pending(self.attempts - 1, buf, work, None)
        if not bad_here:   # a rank whose own gradients are non-finite knows the verdict: no update
            pend.snapshot = self._snapshot()
            self._update()
        self._pending = pend
        self.rollback_bytes = pend.snapshot_bytes() + (
            sum(g.numel() * g.element_size() for g in grads)
            if pend.snapshot is not None and self.config.grad_clip is not None else 0)
        return False, None

    def _snapshot(self) -> dict:
        """What undoing the update needs: parameters, optimizer state, step count, loss scale."""
        with torch.no_grad():
            params = [p.detach().clone() for p in self.params]
        state = {id(p): {k: (v.clone() if isinstance(v, Tensor) else v)
                         for k, v in self.opt.state[p].items()}
                 for p in self.params if p in self.opt.state}
        return {"params": params, "state": state, "steps": self.steps,
                "scaler": self.scaler.state_dict()}

    def _restore(self, snap: dict) -> None:
        """Undo the update exactly: every parameter and state tensor back to its snapshot."""
        with torch.no_grad():
            for p, t in zip(self.params, snap["params"]):
                p.copy_(t)
        for p in self.params:
            if id(p) in snap["state"]:
                self.opt.state[p] = snap["state"][id(p)]
            else:
                self.opt.state.pop(p, None)
        self.steps = snap["steps"]
        self.scaler.load_state_dict(snap["scaler"])

    def validate(self) -> dict | None:
        """Settle the pending post-validated step: wait for its all-reduce (started by
        :meth:`step`, normally long done), and if the global verdict differs from the optimistic
        one, roll the update back exactly and redo it: clipped by the global norm, or skipped
        (non-finite gradients anywhere; the fp16 scale halves; ``nonfinite="raise"`` raises).
        Returns ``{"step", "grad_norm", "outcome": "ok" | "clipped" | "skipped",
        "rolled_back", "replay"}`` (None if nothing was pending); ``replay``: some rank's
        parameters were not the verdict's, so whatever the pipeline computed since the step is
        void (False for a skip where no rank had updated: its own gradients were non-finite
        everywhere, as after a non-finite loss).

        >>> from torch import nn
        >>> from engine.mesh import Mesh
        >>> lin = nn.Linear(2, 1)
        >>> cfg = OptimizerConfig(lr=0.1, grad_clip=1e-3, step_sync="post_validate")
        >>> opt = TorchStageOptimizer(cfg, dict(lin.named_parameters()), Mesh(1), microbatches=1)
        >>> lin(torch.ones(1, 2)).sum().backward()
        >>> opt.step()                   # optimistic: unclipped
        (False, None)
        >>> rec = opt.validate()         # the norm is 1.73 > 1e-3: rolled back, redone clipped
        >>> rec["outcome"], rec["rolled_back"], round(rec["grad_norm"], 2)
        ('clipped', True, 1.73)
        """
        pend, self._pending = self._pending, None
        if pend is None:
            return None
        self.rollback_bytes = 0
        if pend.work is not None:
            pend.work.wait()
        norm, bad = self._read_buf(pend.buf)
        rec = {"step": pend.attempt, "grad_norm": None if bad else norm, "outcome": "ok",
               "rolled_back": False, "replay": False}
        if bad:
            updated = float(pend.buf[-1].item()) > 0
            rec.update(outcome="skipped", rolled_back=pend.snapshot is not None, replay=updated)
            if pend.snapshot is not None:
                self._restore(pend.snapshot)
            if self.scaler.enabled:
                self.scaler.update(overflow=True)
            elif self.nonfinite == "raise":
                raise NonFiniteError(
                    f"non-finite gradient at optimizer step {pend.attempt} on pipeline stage(s) "
                    f"{bad} (rank {self.mesh.rank}); lower the lr, enable grad_clip, or pass "
                    "nonfinite='skip' to skip such steps")
            return rec
        clip = self.config.grad_clip
        if clip is not None and norm > clip:
            rec.update(outcome="clipped", rolled_back=True, replay=True)
            self._redo_clipped(pend, clip / (norm + 1e-6))
        return rec

    def _redo_clipped(self, pend: "_Pending", coef: float) -> None:
        """Restore the snapshot and update again with the step's gradients times ``coef``."""
        self._restore(pend.snapshot)
        grads = pend.grads if pend.grads is not None else [self._grad(p) for p in self.params]
        held = [p.grad for p in self.params]
        for p, g in zip(self.params, grads):
            g.mul_(coef)
            p.grad = g
        self._update()
        if pend.grads is not None:   # the next step's gradients (void: it is re-run)
            for p, g in zip(self.params, held):
                p.grad = g

    def _grad(self, p: Tensor) -> Tensor:
        if p.grad is None:  # unused on this step: a zero grad keeps replicas' buckets aligned
            p.grad = torch.zeros_like(p)
        return p.grad

    def _all_reduce_buckets(self, grads: list[Tensor], group: Any) -> None:
        bucket: list[Tensor] = []
        size = 0
        for g in grads + [None]:
            if g is not None and (not bucket or (g.dtype == bucket[0].dtype
                                                 and size < self.bucket_bytes)):
                bucket.append(g)
                size += g.numel() * g.element_size()
                continue
            if bucket:
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=group)
                off = 0
                for b in bucket:
                    b.copy_(flat[off:off + b.numel()].view_as(b))
                    off += b.numel()
            bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)

    def _local_nonfinite(self) -> list[int]:
        """``[this pipeline stage]`` if one of its gradients holds a NaN/inf, else ``[]``."""
        gs = [p.grad.detach() for p in self.params if p.grad is not None]
        if not gs:
            return []
        total = torch.stack([v.double() for v in torch._foreach_norm(gs)]).sum()
        return [] if bool(torch.isfinite(total)) else [self.mesh.pipeline_rank]

    def _global_norm(self) -> tuple[float, list[int]]:
        """Global grad norm over the pipeline (replicas hold equal averaged grads) and the list
        of pipeline stages whose local gradients are non-finite, from one all-reduce."""
        buf = self._local_buf()
        if self.mesh.distributed and self.mesh.num_stages > 1:
            dist.all_reduce(buf, group=self.mesh.pipeline_group)
        return self._read_buf(buf)

    def _read_buf(self, buf: Tensor) -> tuple[float, list[int]]:
        buf = buf.cpu()
        bad = [j for j in range(self.mesh.num_stages) if buf[1 + j] > 0]
        return math.sqrt(float(buf[0])), bad

    def _local_buf(self) -> Tensor:
        """``[sum of squares of the counted gradients (0 if non-finite), one flag per stage]``
        (float64): this rank's share of the global norm and flags, to be summed over the
        pipeline."""
        p = self.mesh.num_stages
        dev = self.params[0].device if self.params else torch.device("cpu")
        counted = torch.zeros((), dtype=torch.float64, device=dev)
        other = torch.zeros((), dtype=torch.float64, device=dev)
        # one fused norm kernel per group: a per-tensor float64 copy cost ~10x more per step
        for names, acc in (([n for n in self.named if n not in self.norm_skip], counted),
                           ([n for n in self.named if n in self.norm_skip], other)):
            gs = [self.named[n].grad.detach() for n in names if self.named[n].grad is not None]
            if gs:
                norms = torch._foreach_norm(gs)
                acc += torch.stack([v.double() for v in norms]).pow(2).sum()
        finite = torch.isfinite(counted + other)
        buf = torch.zeros(1 + p, dtype=torch.float64, device=dev)
        buf[0] = torch.where(finite, counted, torch.zeros_like(counted))
        buf[1 + self.mesh.pipeline_rank] = (~finite).double()
        return buf

    def optimizer_state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.opt.state.values()
                   for t in st.values() if isinstance(t, Tensor))

    def state_dict(self) -> dict:
        """Keyed by parameter name (``"<layer>.<param>"``) so a checkpoint can be re-split.
        A pending post-validated step is validated first."""
        self.validate()
        state = {}
        for name, p in self.named.items():
            st = self.opt.state.get(p)
            if st:
                state[name] = {k: (v.detach().clone() if isinstance(v, Tensor) else v)
                               for k, v in st.items()}
        return {"state": state, "steps": self.steps, "attempts": self.attempts,
                **self.scaler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """Load the entries of ``sd["state"]`` for this rank's parameter names (others ignored)."""
        self.validate()   # a pending step's collective completes on every rank
        for name, p in self.named.items():
            if name in sd.get("state", {}):
                self.opt.state[p] = {k: (v.to(p.device) if isinstance(v, Tensor) else v)
                                     for k, v in sd["state"][name].items()}
        self.steps = int(sd.get("steps", 0))
        self.attempts = int(sd.get("attempts", self.steps))
        self.scaler.load_state_dict(sd)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.config, self.steps)

    def full_grads(self) -> dict[str, Tensor]:
        return {n: p.grad.detach().clone() for n, p in self.named.items() if p.grad is not None}
