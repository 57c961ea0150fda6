"""Per-stage optimizers: the StageOptimizer protocol, the plain torch backend, the lr schedule.

A backend owns everything between "gradients were produced on this rank" and "parameters were
updated": loss scaling, the data-parallel gradient average, global gradient-norm clipping, the
non-finite check and the update. The runtime only calls the protocol, so the DeepSpeed backend
(``engine.zero``, imported lazily) plugs in through :func:`make_optimizer`.

Example::

    cfg = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, grad_clip=1.0)
    opt = make_optimizer(cfg, nn.ModuleDict({"0": layer0}), mesh, microbatches=4)
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

__all__ = ["OptimizerConfig", "StageOptimizer", "TorchStageOptimizer", "NonFiniteError",
           "lr_at", "make_optimizer", "resolve_backend", "PRECISIONS", "GRAD_ACCUM_DTYPES",
           "weight_dtype", "compute_dtype", "loss_scaled", "check_grad_accum_dtype"]

# "bf16" / "fp16": the modules hold 16-bit weights; DeepSpeed's optimizer keeps the fp32 masters
# (and moments), ZeRO-sharded, and refreshes the 16-bit weights after each step.
# "*-autocast": fp32 weights and gradients, compute under torch.autocast.
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-autocast", "fp16-autocast")
GRAD_ACCUM_DTYPES = ("fp32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype of the modules' parameters under ``precision``.

    >>> weight_dtype("bf16"), weight_dtype("bf16-autocast")
    (torch.bfloat16, torch.float32)
    """
    return _DTYPES[precision] if precision in _DTYPES else torch.float32


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of the forward under ``precision`` (None: no autocast).

    >>> compute_dtype("fp16-autocast"), compute_dtype("fp32")
    (torch.float16, None)
    """
    return None if precision == "fp32" else _DTYPES[precision.split("-")[0]]


def loss_scaled(precision: str) -> bool:
    """Whether ``precision`` computes in fp16 (dynamic loss scaling).

    >>> loss_scaled("fp16-autocast"), loss_scaled("bf16")
    (True, False)
    """
    return precision.startswith("fp16")


def check_grad_accum_dtype(grad_accum_dtype: str, precision: str) -> str:
    """Check ``optimizer.grad_accum_dtype`` against the precision; returns it.

    fp32 (the default) accumulates gradients across microbatches in fp32 whatever the weights;
    a 16-bit accumulation must be the dtype of 16-bit weights (precision bf16 or fp16).
    """
    if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        raise ValueError(f"grad_accum_dtype must be one of {GRAD_ACCUM_DTYPES}, got "
                         f"{grad_accum_dtype!r}")
    if grad_accum_dtype != "fp32" and grad_accum_dtype != precision:
        raise ValueError(
            f"grad_accum_dtype={grad_accum_dtype!r} needs precision={grad_accum_dtype!r} (16-bit "
            f"weights, whose gradients can accumulate in their own dtype); with precision="
            f"{precision!r} gradients accumulate in fp32: set grad_accum_dtype='fp32'")
    return grad_accum_dtype
_BUCKET_BYTES = 32 * 2**20


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
    zero_stage: int = 0                  # 0, 1, 2 (DeepSpeed)
    backend: str = "auto"                # auto | torch | deepspeed
    grad_accum_dtype: str = "fp32"       # fp32 | bf16 | fp16 (16-bit only with 16-bit weights)


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


@runtime_checkable
class StageOptimizer(Protocol):
    """What the runtime needs from an optimizer backend (torch or DeepSpeed)."""

    def scale_loss(self, loss: Tensor) -> Tensor: ...            # loss / m * loss_scale
    def backward(self, tensors: Sequence[Tensor], grad_tensors: Sequence[Tensor] | None,
                 inputs: Sequence[Tensor] | None = None, retain_graph: bool = False) -> None: ...
    def step(self, need_norm: bool = True) -> tuple[bool, float | None]: ...  # (skipped, norm)
    def zero_grad(self) -> None: ...
    def accumulated_grad(self, param: Tensor) -> Tensor: ...      # to sum tied copies in place
    def lr(self) -> float: ...
    def optimizer_state_bytes(self) -> int: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, sd: dict) -> None: ...
    def full_grads(self) -> dict[str, Tensor]: ...


def resolve_backend(config: OptimizerConfig, precision: str = "fp32") -> str:
    """``"torch"`` or ``"deepspeed"`` for a config (auto: deepspeed iff zero_stage > 0 or the
    precision keeps 16-bit weights, whose fp32 masters live in DeepSpeed's optimizer)."""
    if config.backend not in ("auto", "torch", "deepspeed"):
        raise ValueError(f"optimizer.backend must be auto, torch or deepspeed, got "
                         f"{config.backend!r}")
    low = weight_dtype(precision) != torch.float32
    if config.backend == "auto":
        return "deepspeed" if config.zero_stage > 0 or low else "torch"
    if config.backend == "torch" and config.zero_stage > 0:
        raise ValueError(f"zero_stage={config.zero_stage} needs backend='deepspeed' (or 'auto'); "
                         "the torch backend does not shard optimizer state")
    if config.backend == "torch" and low:
        raise ValueError(f"precision={precision!r} keeps {precision} weights with fp32 master "
                         "weights inside DeepSpeed's optimizer: use optimizer.backend='auto' or "
                         f"'deepspeed', or precision='{precision}-autocast' (fp32 weights) with "
                         "the torch backend")
    return config.backend


def make_optimizer(config: OptimizerConfig, module: torch.nn.Module, mesh: Any, *,
                   microbatches: int, precision: str = "fp32", nonfinite: str = "raise",
                   norm_skip: Iterable[str] = ()) -> StageOptimizer:
    """Build this rank's optimizer backend.

    ``module``: this rank's layers, e.g. ``nn.ModuleDict({"3": layer3, "4": layer4})``, so that
    parameter names are ``"<global layer>.<param name>"`` (checkpoints re-split by these names);
    ``norm_skip``: names counted elsewhere in the global norm (the second copy of a tied
    parameter). The DeepSpeed backend is imported only when selected.
    """
    check_grad_accum_dtype(getattr(config, "grad_accum_dtype", "fp32"), precision)
    if resolve_backend(config, precision) == "deepspeed":
        from engine.zero import DeepSpeedStageOptimizer  # lazy: DeepSpeed is heavy
        return DeepSpeedStageOptimizer(config, module, dp_group=mesh.dp_group,
                                       pipeline_group=mesh.pipeline_group,
                                       microbatches=microbatches, precision=precision,
                                       nonfinite=nonfinite, norm_skip=norm_skip)
    return TorchStageOptimizer(config, dict(module.named_parameters()), mesh,
                               microbatches=microbatches, precision=precision,
                               nonfinite=nonfinite, norm_skip=norm_skip)


class TorchStageOptimizer:
    """torch.optim on this rank's parameters, with data-parallel averaging (bucketed all-reduce
    over the mesh's data-parallel group), global-norm clipping across the pipeline, fp16 dynamic
    loss scaling and the non-finite policy. Gradients stay in ``.grad`` after :meth:`step` (as
    used by the update, for inspection) and are cleared by :meth:`zero_grad`."""

    def __init__(self, config: OptimizerConfig, named_params: Mapping[str, Tensor], mesh: Any, *,
                 microbatches: int, precision: str = "fp32", nonfinite: str = "raise",
                 norm_skip: Iterable[str] = (), init_loss_scale: float = 2.0**16,
                 scale_growth_interval: int = 2000):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if weight_dtype(precision) != torch.float32:
            raise ValueError(f"the torch backend keeps fp32 weights; precision={precision!r} "
                             "(16-bit weights, fp32 masters) runs on the DeepSpeed backend, or use "
                             f"precision='{precision}-autocast'")
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        self.config, self.mesh, self.m = config, mesh, microbatches
        self.precision, self.nonfinite = precision, nonfinite
        self.named = {n: p for n, p in named_params.items() if p.requires_grad}
        self.norm_skip = set(norm_skip)
        self.params = list(self.named.values())
        self.steps = 0               # optimizer steps taken (skips excluded)
        self.attempts = 0            # step() calls
        self.scaled = loss_scaled(precision)
        self.loss_scale = init_loss_scale if self.scaled else 1.0
        self.growth_interval, self._good_steps = scale_growth_interval, 0
        self.opt = self._make_torch_optimizer()

    def _make_torch_optimizer(self) -> torch.optim.Optimizer:
        # fused kernels (CPU and CUDA): no step temporaries the size of the parameters
        c, params = self.config, self.params or [torch.nn.Parameter(torch.zeros(0))]
        lr = lr_at(c, 0)
        if c.name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=c.momentum, weight_decay=c.weight_decay,
                                   fused=True)
        if c.name == "adam":
            return torch.optim.Adam(params, lr=lr, betas=tuple(c.betas), eps=c.eps,
                                    weight_decay=c.weight_decay, fused=True)
        if c.name == "adamw":
            return torch.optim.AdamW(params, lr=lr, betas=tuple(c.betas), eps=c.eps,
                                     weight_decay=c.weight_decay, fused=True)
        raise ValueError(f"optimizer name must be sgd, adam or adamw, got {c.name!r}")

    # ---- protocol ----------------------------------------------------------------------------
    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * (self.loss_scale / self.m)

    def backward(self, tensors: Sequence[Tensor], grad_tensors: Sequence[Tensor] | None,
                 inputs: Sequence[Tensor] | None = None, retain_graph: bool = False) -> None:
        torch.autograd.backward(list(tensors), grad_tensors=grad_tensors,
                                inputs=list(inputs) if inputs is not None else None,
                                retain_graph=retain_graph)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

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
        reading, no collective) and the norm is reported as None."""
        self.attempts += 1
        grads = [self._grad(p) for p in self.params]
        d = self.mesh.data_parallel
        if d > 1:
            self._all_reduce_buckets(grads, self.mesh.dp_group)
        div = d * self.loss_scale
        if div != 1.0:
            for g in grads:
                g.div_(div)
        if (need_norm or self.config.grad_clip is not None or self.scaled
                or self.nonfinite == "skip"):
            norm, bad_stages = self._global_norm()
        else:
            norm, bad_stages = None, self._local_nonfinite()
        if bad_stages:
            if self.scaled:
                self.loss_scale /= 2.0
                self._good_steps = 0
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
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.config, self.steps)
        self.opt.step()
        self.steps += 1
        if self.scaled:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.loss_scale *= 2.0
        return False, norm

    def _grad(self, p: Tensor) -> Tensor:
        if p.grad is None:  # unused on this step: a zero grad keeps replicas' buckets aligned
            p.grad = torch.zeros_like(p)
        return p.grad

    def _all_reduce_buckets(self, grads: list[Tensor], group: Any) -> None:
        bucket: list[Tensor] = []
        size = 0
        for g in grads + [None]:
            if g is not None and (not bucket or (g.dtype == bucket[0].dtype
                                                 and size < _BUCKET_BYTES)):
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
        if self.mesh.distributed and p > 1:
            dist.all_reduce(buf, group=self.mesh.pipeline_group)
        buf = buf.cpu()
        bad = [j for j in range(p) if buf[1 + j] > 0]
        return math.sqrt(float(buf[0])), bad

    def optimizer_state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.opt.state.values()
                   for t in st.values() if isinstance(t, Tensor))

    def state_dict(self) -> dict:
        """Keyed by parameter name (``"<layer>.<param>"``) so a checkpoint can be re-split."""
        state = {}
        for name, p in self.named.items():
            st = self.opt.state.get(p)
            if st:
                state[name] = {k: (v.detach().clone() if isinstance(v, Tensor) else v)
                               for k, v in st.items()}
        return {"state": state, "steps": self.steps, "attempts": self.attempts,
                "loss_scale": self.loss_scale, "good_steps": self._good_steps}

    def load_state_dict(self, sd: dict) -> None:
        """Load the entries of ``sd["state"]`` for this rank's parameter names (others ignored)."""
        for name, p in self.named.items():
            if name in sd.get("state", {}):
                self.opt.state[p] = {k: (v.to(p.device) if isinstance(v, Tensor) else v)
                                     for k, v in sd["state"][name].items()}
        self.steps = int(sd.get("steps", 0))
        self.attempts = int(sd.get("attempts", self.steps))
        self.loss_scale = float(sd.get("loss_scale", self.loss_scale))
        self._good_steps = int(sd.get("good_steps", 0))
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.config, self.steps)

    def full_grads(self) -> dict[str, Tensor]:
        return {n: p.grad.detach().clone() for n, p in self.named.items() if p.grad is not None}
