"""Device descriptions that turn FLOPs and bytes into seconds (analytic profiles).

Presets: ``"a100"``, ``"h100"``, ``"h200"`` (SXM datasheet peaks, dense) and ``"cpu"``,
which is measured once per process by timing a matmul and a large copy::

    from partitioner import get_device_spec
    h100 = get_device_spec("h100")
    t = h100.op_time(flops=2 * 4096**3, bytes_moved=3 * 4096**2 * 2, dtype="bfloat16")

``"a100-kernels"``, ``"h100-kernels"``, ``"h200-kernels"`` carry a per-op-class device model
(``DeviceSpec.kernels``, a :class:`partitioner.kernels.KernelModel`: GEMM tile and wave
quantisation, flash attention by sequence length and head dim, memory-bound ops at achieved
bandwidth, a launch cost per kernel; docs/device-model.md sources every constant). The plain
names (and their ``"-flat"`` aliases) are a flat roofline at ``efficiency`` (0.7) of the datasheet
peaks plus ``overhead_s`` (5 us) per op: on held-out published steps (planned as those runs
executed) it is the closer of the two today, though the kernel model is closer to the published
per-stage kernel times (docs/device-model.md). The measured ``"cpu"`` is flat too (its figures are achieved ones)
unless calibrated (``partitioner.calibrate``). ``fuse=True`` (``get_device_spec(..., fuse=True)``)
costs pointwise chains as ``torch.compile`` fuses them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from .collectives import Links
from .kernels import KERNEL_PRESETS, KernelModel, OpCharger

__all__ = ["DeviceSpec", "DEVICE_PRESETS", "ATTENTION_BACKENDS", "get_device_spec", "measure_cpu_spec"]

# The SDPA kernels an analytic profile can cost attention through (partitioner.profile):
# flash / efficient keep O(s) per head for backward, math the s x s probabilities; "unfused" is
# Megatron-LM's legacy core attention (materialised s x s scores: baddbmm, one fused
# scale-mask-softmax kernel, dropout, bmm), what runs without --use-flash-attn.
ATTENTION_BACKENDS: tuple[str, ...] = ("flash", "efficient", "math", "unfused")


@dataclass(frozen=True)
class DeviceSpec:
    """Peak FLOP/s per dtype, memory bandwidth, memory size and link bandwidth of one device."""

    name: str
    peak_flops: dict[str, float]          # dtype name -> FLOP/s
    memory_bandwidth: float               # bytes/s
    memory_bytes: int = 0
    link_bytes_per_s: float | None = None  # the next GPU of a node (not read by the planner: it prices pipeline transfers from links)
    efficiency: float = 1.0               # fraction of peak reached in practice
    overhead_s: float = 0.0               # per-op launch/dispatch overhead
    notes: str = ""
    attention: str = "flash"              # SDPA kernel it runs: one of ATTENTION_BACKENDS
    kernels: KernelModel | None = None    # per-op-class model (None: the flat roofline of op_time)
    # collectives of the 3-D layout (partitioner.collectives): per-GPU rates, one direction
    intra_node_bytes_per_s: float | None = None   # tensor parallel: NVLink
    inter_node_bytes_per_s: float | None = None   # data parallel: the GPU's NIC
    intra_node_latency_s: float = 0.0             # per collective
    inter_node_latency_s: float = 0.0
    collective_efficiency: float = 1.0            # fraction of the rate a ring collective reaches
    gpus_per_node: int | None = None              # GPUs per node (NVLink domain): which pipeline neighbours share a node

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"DeviceSpec.attention={self.attention!r}; use one of {ATTENTION_BACKENDS}")

    def flops_per_s(self, dtype: str = "float32") -> float:
        d = dtype.replace("torch.", "")
        if d in self.peak_flops:
            return self.peak_flops[d] * self.efficiency
        return self.peak_flops.get("float32", max(self.peak_flops.values())) * self.efficiency

    def op_time(self, flops: float, bytes_moved: float, dtype: str = "float32") -> float:
        """Roofline time of one op: max(compute time, memory time) plus the per-op overhead."""
        return max(flops / self.flops_per_s(dtype), bytes_moved / (self.memory_bandwidth * self.efficiency)) + self.overhead_s

    def peak_flops_for(self, dtype: str = "float32") -> float:
        """Datasheet (or measured) peak FLOP/s of ``dtype``, before any efficiency."""
        d = dtype.replace("torch.", "")
        return self.peak_flops.get(d, self.peak_flops.get("float32", max(self.peak_flops.values())))

    @property
    def links(self) -> Links | None:
        """The collectives' links (:class:`partitioner.collectives.Links`), None when the spec
        gives no intra- or inter-node rate (the measured CPU).

        >>> get_device_spec("h100").links.inter_bytes_per_s
        50000000000.0
        """
        if self.intra_node_bytes_per_s is None or self.inter_node_bytes_per_s is None:
            return None
        return Links(self.intra_node_bytes_per_s, self.inter_node_bytes_per_s, self.intra_node_latency_s,
                     self.inter_node_latency_s, self.collective_efficiency, self.gpus_per_node)

    def charger(self, dtype: str = "float32") -> OpCharger | None:
        """An :class:`OpCharger` for ``dtype`` ops under :attr:`kernels` (None: flat roofline)."""
        if self.kernels is None:
            return None
        return OpCharger(self.kernels, self.peak_flops_for(dtype), self.memory_bandwidth)


# Datasheet figures (dense, SXM parts; S1 in docs/device-model.md). fp32 uses TF32 tensor cores
# for matmuls on these GPUs. Collectives ("Collectives" in docs/device-model.md): NVLink per GPU, one
# direction (half the datasheet's bidirectional figure); the NIC per GPU of a DGX/HGX node
# (A100: ConnectX-6 HDR 200 Gb/s; H100/H200: ConnectX-7 NDR 400 Gb/s); efficiency and latencies
# are from S3 (NCCL all-reduce on 8 H100s) or assumed, each stated in docs/device-model.md. A node is
# a DGX / HGX board of 8 GPUs on one NVLink switch (S8); pipeline neighbours on two nodes talk
# through the sender's NIC (partitioner.collectives.pipeline_hops).
_COLLECTIVES = dict(intra_node_latency_s=25e-6, inter_node_latency_s=30e-6, collective_efficiency=0.8,
                    gpus_per_node=8)
_FLAT: dict[str, DeviceSpec] = {
    "a100": DeviceSpec("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
                       2.039e12, 80 * 2**30, 300e9, efficiency=0.7, overhead_s=5e-6,
                       notes="A100 SXM 80GB; NVLink3 600 GB/s bidirectional; HDR 200 Gb/s per GPU",
                       intra_node_bytes_per_s=300e9, inter_node_bytes_per_s=25e9, **_COLLECTIVES),
    "h100": DeviceSpec("h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
                       3.35e12, 80 * 2**30, 450e9, efficiency=0.7, overhead_s=5e-6,
                       notes="H100 SXM 80GB; NVLink4 900 GB/s bidirectional; NDR 400 Gb/s per GPU",
                       intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9, **_COLLECTIVES),
    "h200": DeviceSpec("h200", {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
                       4.8e12, 141 * 10**9, 450e9, efficiency=0.7, overhead_s=5e-6,
                       notes="H200 SXM 141GB; NVLink4 900 GB/s bidirectional; NDR 400 Gb/s per GPU",
                       intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9, **_COLLECTIVES),
}
# The plain names keep the flat roofline: on the held-out published steps (Zero Bubble's A100 table,
# torchtitan's Llama 3.1 8B step; scripts/device_check.py, docs/device-model.md) the per-op-class
# model predicts a faster step than the flat one, further from the measurement, although it is the
# closer one to the published per-stage kernel times; it stays opt-in ("-kernels") until the step
# time outside the profiled kernels is modelled.
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    **_FLAT,
    **{f"{name}-flat": replace(spec, name=f"{name}-flat") for name, spec in _FLAT.items()},
    **{f"{name}-kernels": replace(spec, name=f"{name}-kernels", kernels=KERNEL_PRESETS[name],
                                  notes=spec.notes + "; per-op-class kernel model")
       for name, spec in _FLAT.items()},
}

_CPU_CACHE: dict[str, DeviceSpec] = {}


def measure_cpu_spec(size: int = 384, copy_mb: int = 64, repeats: int = 5) -> DeviceSpec:
    """Measure this CPU once (cached): matmul FLOP/s (fp32) and copy bandwidth."""
    if "cpu" in _CPU_CACHE:
        return _CPU_CACHE["cpu"]
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    flops = 2 * size**3 / best
    n = copy_mb * 2**20 // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    dst.copy_(src)
    best_c = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best_c = min(best_c, time.perf_counter() - t0)
    bw = 2 * n * 4 / best_c  # read + write
    try:
        import os
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    spec = DeviceSpec("cpu", {"float32": flops, "bfloat16": flops / 2, "float16": flops / 4},
                      bw, mem, None, efficiency=1.0, overhead_s=2e-6,
                      notes=f"measured: {size}^3 fp32 matmul, {copy_mb} MiB copy, {torch.get_num_threads()} threads")
    _CPU_CACHE["cpu"] = spec
    return spec


def get_device_spec(spec: "str | DeviceSpec", *, fuse: bool | None = None, **overrides: object) -> DeviceSpec:
    """A preset by name (``a100``, ``h100``, ``h200``, their ``-flat`` and ``-kernels`` forms, ``cpu``) or a given
    spec, with field overrides. ``fuse``: cost pointwise chains as ``torch.compile`` fuses them
    (needs a kernel model: a GPU preset or a calibrated spec).

    >>> get_device_spec("h100-kernels", fuse=True).kernels.fuse_elementwise
    True
    """
    out = _lookup(spec)
    if overrides:
        out = replace(out, **overrides)
    if fuse is not None:
        if out.kernels is None and fuse:
            raise ValueError(f"fuse=True needs a kernel model; {out.name!r} has a flat roofline "
                             "(use a kernel preset such as 'h100-kernels', or calibrate: partitioner.calibrate=true)")
        if out.kernels is not None:
            out = replace(out, kernels=out.kernels.with_fusion(fuse))
    return out


def _lookup(spec: "str | DeviceSpec") -> DeviceSpec:
    if isinstance(spec, DeviceSpec):
        out = spec
    else:
        key = str(spec).lower()
        if key == "cpu":
            out = measure_cpu_spec()
        elif key in DEVICE_PRESETS:
            out = DEVICE_PRESETS[key]
        else:
            raise ValueError(f"unknown device spec {spec!r}; use one of {sorted(DEVICE_PRESETS) + ['cpu']} "
                             "or pass a DeviceSpec(...)")
    return out
