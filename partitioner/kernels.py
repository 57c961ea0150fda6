"""A device model per op class: what one aten op costs on a GPU (or a CPU), by its shape.

The analytic profile (``partitioner.profile(..., mode="analytic")``) sees every aten op of a
layer's forward and backward. :class:`OpCharger` classifies each and charges it:

- **GEMM** (``mm``, ``addmm``, ``bmm``, ``baddbmm``; ``nn.Linear`` dispatches to these):
  ``M x N x K`` (times the batch) is cut into output tiles; each tile shape the library may pick
  (:data:`GEMM_TILES`) gives ``waves = ceil(tiles / units)`` rounds over the ``units`` (SMs).
  Time = ``waves * 2 * tm * tn * (K + k0) / (unit_rate * tile_eff)`` with ``unit_rate`` the
  per-SM share of ``gemm_efficiency x peak``; the fastest tile wins (as cuBLAS's heuristic
  aims to). ``k0`` is each tile's prologue/epilogue in units of K. Small GEMMs thus run far
  below peak (one partial wave, a short K); a GEMM never runs faster than its bytes allow.
- **attention** (the fused SDPA kernels, forward and backward): FLOPs (halved when causal:
  the kernel skips masked blocks) at ``peak x attn_fwd|attn_bwd x s / (s + s0) x head_dim
  factor`` -- throughput grows with the sequence (``s0``) and with the head dim up to 128.
- **memory-bound** (everything else: norms, activations, residual adds, softmax, casts, the
  optimizer's elementwise update): bytes read + written at the achieved bandwidth.
- every kernel also pays ``launch_s``.

``fuse_elementwise`` (what ``torch.compile`` / Inductor does to pointwise chains): a
memory-bound op that consumes the output of the memory-bound op before it joins its kernel:
no launch, and it does not re-read that intermediate.

Example::

    >>> from partitioner.kernels import KERNEL_PRESETS, gemm_time
    >>> k = KERNEL_PRESETS["a100"]
    >>> big = gemm_time(k, 312e12, 2.039e12, 2, 8192, 8192, 8192)
    >>> round(2 * 8192**3 / big / 1e12)   # S3 measured 253.7 TFLOP/s on an A100
    262
    >>> small = gemm_time(k, 312e12, 2.039e12, 2, 256, 256, 256)
    >>> 2 * 8192**3 / big > 10 * (2 * 256**3 / small)   # small GEMMs far below peak
    True
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = ["KernelModel", "KERNEL_PRESETS", "GEMM_TILES", "OpCharger", "gemm_time", "attention_time",
           "memory_time", "gemm_shape", "OP_CLASSES", "OPTIMIZER_STATE_TRAFFIC", "optimizer_s_per_byte"]

OP_CLASSES: tuple[str, ...] = ("gemm", "attention", "memory")

# (tile_m, tile_n, relative efficiency) of the output tiles a GEMM library picks among. The
# largest (256x128, the CTA tile of cuBLAS's large Ampere/Hopper bf16 kernels; NVIDIA "Matrix
# Multiplication Background User's Guide", tile quantization section) runs at full rate; a smaller
# tile re-reads its operands more often: relative rate sqrt(intensity / intensity(256x128)),
# intensity = tm*tn/(tm+tn) (an assumption of this model, fitted through k0 below).
GEMM_TILES: tuple[tuple[int, int, float], ...] = tuple(
    (m, n, math.sqrt((m * n / (m + n)) / (256 * 128 / 384)))
    for m, n in ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64)))


@dataclass(frozen=True)
class KernelModel:
    """The constants of the per-op-class model (see the module docstring); each preset's are
    sourced in :data:`KERNEL_PRESETS`, a calibrated one's come from ``partitioner.calibrate``."""

    units: int                     # SMs (GPU) or cores (CPU) that tiles are spread over
    gemm_efficiency: float         # fraction of peak the best large GEMM reaches
    gemm_k0: float = 0.0           # per-tile prologue/epilogue, in units of K
    tiles: bool = True             # tile and wave quantisation (False: a CPU's smooth blocking)
    attn_fwd: float = 0.5          # fraction of peak a long-sequence, head-dim-128 SDPA forward reaches
    attn_bwd: float = 0.4          # the same for its backward
    attn_s0: float = 256.0         # sequence length at which attention runs at half its asymptote
    bandwidth: float = 0.85        # fraction of the datasheet memory bandwidth streaming kernels reach
    launch_s: float = 4e-6         # per kernel
    fuse_elementwise: bool = False  # torch.compile: pointwise chains run as one kernel
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("gemm_efficiency", "attn_fwd", "attn_bwd", "bandwidth"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"KernelModel.{name}={v}: a fraction of peak in (0, 1]")
        if self.units < 1 or self.gemm_k0 < 0 or self.attn_s0 < 0 or self.launch_s < 0:
            raise ValueError("KernelModel: units >= 1 and gemm_k0, attn_s0, launch_s >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KernelModel":
        return cls(**d)

    def with_fusion(self, on: bool = True) -> "KernelModel":
        return replace(self, fuse_elementwise=on)


# Sources (S1-S6 in docs/device-model.md):
# S1 NVIDIA A100 / H100 / H200 datasheets and whitepapers: 108 SMs (A100), 132 SMs (H100/H200 SXM).
# S2 stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS"
#    table (bf16, best shape): A100 SXM 271.2 of 312 TFLOP/s (86.9%), H100 SXM 794.5 of 989 (80.3%),
#    GH200 (H200-class HBM3e) 828.6 of 989 (83.8%).
# S3 samuel-bohman/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md: cuBLASLt fp16
#    1024^3 119.4, 2048^3 221.8, 4096^3 228.0, 8192^3 253.7 TFLOP/s and four more shapes (10,000
#    warm-up iterations: sustained clocks). partitioner.calibrate's own GEMM fit on these eight gives
#    gemm_efficiency 0.858, k0 160 (6.5% mean error, worst 2048^3 at -23%); HBM add/triad 1.70 TB/s (A100 80GB, 83% of 2.039);
#    ND_H100_v5: add/triad 2.97 TB/s (89% of 3.35), FlashAttention-2 hd128 b2 s8192 327.9 TFLOP/s;
#    ND_H200_v5: add/triad 4.15 TB/s (86% of 4.8), FlashAttention-2 329.3 TFLOP/s.
# S4 Dao, FlashAttention-2 (arXiv 2307.08691): forward up to 73% of A100 peak (hd 128), backward
#    up to 63%; throughput rises with the sequence (half of it by ~256-512 tokens); hd 64 runs
#    ~15% below hd 128.
# S5 Shah et al., FlashAttention-3 (arXiv 2407.08608): FlashAttention-2 (what PyTorch's SDPA flash
#    backend runs) reaches only ~35% of H100 peak; S3's 327.9 TFLOP/s at s=8192 agrees (33%).
# S6 NVIDIA developer blog "Getting Started with CUDA Graphs": 3.8 us per short kernel launched
#    on a stream (3.4 us in a graph); we charge 4 us per kernel.
KERNEL_PRESETS: dict[str, KernelModel] = {
    "a100": KernelModel(units=108, gemm_efficiency=0.858, gemm_k0=160.0, attn_fwd=0.70, attn_bwd=0.55,
                        attn_s0=256.0, bandwidth=0.834, launch_s=4e-6,
                        source="S1 SMs, S3 GEMM fit (S2 agrees: 0.869) + bandwidth, S4 attention, S6 launch"),
    "h100": KernelModel(units=132, gemm_efficiency=0.803, gemm_k0=160.0, attn_fwd=0.35, attn_bwd=0.275,
                        attn_s0=256.0, bandwidth=0.887, launch_s=4e-6,
                        source="S1 SMs, S2 GEMM, S3 k0+bandwidth, S5 attention (bwd: S4's bwd/fwd ratio), S6 launch"),
    "h200": KernelModel(units=132, gemm_efficiency=0.838, gemm_k0=160.0, attn_fwd=0.35, attn_bwd=0.275,
                        attn_s0=256.0, bandwidth=0.865, launch_s=4e-6,
                        source="S1 SMs, S2 GEMM (GH200), S3 k0+bandwidth, S5 attention, S6 launch"),
}

_HEAD_D0 = 27.4  # head-dim factor d/(d+d0), relative to d=128: hd 64 at 85% of hd 128 (S4)


def gemm_time(k: KernelModel, peak: float, bandwidth: float, elem_bytes: int,
              m: int, n: int, kk: int, batch: int = 1) -> float:
    """Seconds of a ``batch x (m x kk) @ (kk x n)`` GEMM, launch included (see module docstring)."""
    rate = peak * k.gemm_efficiency
    kfac = (kk + k.gemm_k0) / max(kk, 1)
    if k.tiles:
        best = math.inf
        for tm, tn, eff in GEMM_TILES:
            tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
            waves = math.ceil(tiles / k.units)
            best = min(best, waves * k.units * 2.0 * tm * tn * kk * kfac / (rate * eff))
        compute = best
    else:
        compute = 2.0 * batch * m * n * kk * kfac / rate
    moved = elem_bytes * batch * (m * kk + kk * n + m * n)
    return max(compute, moved / (bandwidth * k.bandwidth)) + k.launch_s


def attention_time(k: KernelModel, peak: float, flops: float, seq: int, head_dim: int, causal: bool,
                   backward: bool) -> float:
    """Seconds of a fused (flash / memory-efficient) SDPA forward or backward of ``flops``."""
    frac = k.attn_bwd if backward else k.attn_fwd
    s0 = k.attn_s0 * (2.0 if causal else 1.0)  # half the blocks: a causal kernel ramps up later
    dfac = min(1.0, (head_dim / (head_dim + _HEAD_D0)) / (128.0 / (128.0 + _HEAD_D0)))
    rate = peak * frac * (seq / (seq + s0)) * dfac
    return (flops * (0.5 if causal else 1.0)) / rate + k.launch_s


def memory_time(k: KernelModel, bandwidth: float, moved: float, launch: bool = True) -> float:
    """Seconds of a memory-bound kernel moving ``moved`` bytes."""
    return moved / (bandwidth * k.bandwidth) + (k.launch_s if launch else 0.0)


# Bytes an optimizer step reads and writes per parameter, fp32 master weights and gradients:
# sgd reads p, g and writes p (12); adam / adamw read p, g, m, v and write p, m, v (28). With
# 16-bit weights the step also writes the 16-bit copy of each parameter (+ itemsize).
OPTIMIZER_STATE_TRAFFIC: dict[str, float] = {"sgd": 12.0, "adam": 28.0, "adamw": 28.0}


def optimizer_s_per_byte(k: KernelModel, bandwidth: float, itemsize: int) -> dict[str, float]:
    """Seconds per parameter byte (``itemsize`` bytes a parameter) of each optimizer's step, a
    memory-bound sweep at the achieved bandwidth (``partitioner.FixedCosts.optimizer_s_per_byte``).

    >>> round(optimizer_s_per_byte(KERNEL_PRESETS["h100"], 3.35e12, 2)["adamw"] * 2 * 1e12, 2)  # ps per param
    10.1
    """
    extra = itemsize if itemsize < 4 else 0
    return {name: (moved + extra) / itemsize / (bandwidth * k.bandwidth) for name, moved in OPTIMIZER_STATE_TRAFFIC.items()}


_GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
_ATTN_CAUSAL_ARG = {  # op name -> positional index of is_causal
    "_scaled_dot_product_flash_attention": 4, "_scaled_dot_product_flash_attention_backward": 11,
    "_scaled_dot_product_efficient_attention": 6, "_scaled_dot_product_efficient_attention_backward": 11,
    "_flash_attention_forward": 7, "_flash_attention_backward": 9,
    "_efficient_attention_forward": 7, "_efficient_attention_backward": 10,
    "_scaled_dot_product_cudnn_attention": 6, "_scaled_dot_product_cudnn_attention_backward": 10,
}


def gemm_shape(name: str, args: tuple) -> tuple[int, int, int, int] | None:
    """``(batch, M, N, K)`` of a GEMM aten op from its arguments, None if not a GEMM."""
    if name not in _GEMM_OPS:
        return None
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    if name in ("mm", "addmm"):
        return 1, int(a.shape[0]), int(b.shape[1]), int(a.shape[1])
    return int(a.shape[0]), int(a.shape[1]), int(b.shape[2]), int(a.shape[2])


class OpCharger:
    """Charges aten ops by class with a :class:`KernelModel`; keeps per-class totals.

    >>> from partitioner.kernels import KERNEL_PRESETS, OpCharger
    >>> c = OpCharger(KERNEL_PRESETS["h100"], peak=989e12, bandwidth=3.35e12)
    >>> c.charge_memory(3 * 2**20) > 0 and c.by_class["memory"] > 0
    True
    """

    def __init__(self, model: KernelModel, peak: float, bandwidth: float) -> None:
        self.model, self.peak, self.bandwidth = model, peak, bandwidth
        self.by_class: dict[str, float] = {c: 0.0 for c in OP_CLASSES}
        self.kernels = 0
        self._chain: set[int] = set()  # storages written by the running fused pointwise chain

    def charge(self, func: Any, args: tuple, kwargs: dict, out: Any, flops: float, moved: float,
               ins: list, outs: list) -> float:
        """Seconds of one aten op (``ins`` / ``outs``: its input and output tensors)."""
        name = func._overloadpacket.__name__
        shape = gemm_shape(name, args)
        elem = max((t.element_size() for t in ins), default=2)
        if shape is not None:
            self._chain.clear()
            b, m, n, kk = shape
            return self._add("gemm", gemm_time(self.model, self.peak, self.bandwidth, elem, m, n, kk, b))
        if name in _ATTN_CAUSAL_ARG:
            self._chain.clear()
            q = ins[1] if name.endswith("backward") else ins[0]
            idx = _ATTN_CAUSAL_ARG[name]
            causal = bool(kwargs.get("is_causal", args[idx] if len(args) > idx else False))
            t = attention_time(self.model, self.peak, flops, int(q.shape[-2]), int(q.shape[-1]), causal,
                               name.endswith("backward"))
            return self._add("attention", t)
        if flops and not moved:
            return self._add("gemm", flops / (self.peak * self.model.gemm_efficiency) + self.model.launch_s)
        return self._charge_pointwise(moved, ins, outs, flops)

    def _charge_pointwise(self, moved: float, ins: list, outs: list, flops: float) -> float:
        fused = False
        if self.model.fuse_elementwise:
            keys = [_key(t) for t in ins]
            fused = bool(self._chain) and any(k in self._chain for k in keys)
            if fused:
                moved -= sum(t.numel() * t.element_size() for t, k in zip(ins, keys) if k in self._chain)
            else:
                self._chain.clear()
            self._chain.update(_key(t) for t in outs)
        t = memory_time(self.model, self.bandwidth, max(moved, 0.0), launch=not fused)
        if flops:  # e.g. a convolution: no worse than its FLOPs at the GEMM rate
            t = max(t, flops / (self.peak * self.model.gemm_efficiency))
        return self._add("memory", t)

    def charge_memory(self, moved: float) -> float:
        """A standalone memory-bound kernel (e.g. an optimizer update's bytes)."""
        return self._add("memory", memory_time(self.model, self.bandwidth, moved))

    def _add(self, cls: str, t: float) -> float:
        self.by_class[cls] += t
        self.kernels += 1
        return t


def _key(t: Any) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)
