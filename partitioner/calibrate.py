"""Calibrate the per-op-class device model on the device at hand, and cache it per device name.

``calibrate()`` times a small fixed kernel set (:data:`KERNEL_SET`: GEMMs of several shapes, an
SDPA forward and backward at two sequence lengths, copies of several sizes, a one-element add for
the launch cost), fits the constants of :class:`partitioner.kernels.KernelModel` to them
(:func:`fit_kernel_model`, a pure function of the timings) and caches the result as JSON under
``$PIPESHARD_CACHE`` (default ``~/.cache/pipeshard``)``/devices/<device name>.json``. CUDA
timings use CUDA events after a ``torch.cuda.synchronize``; the CPU uses ``perf_counter``.

Peaks: a GPU whose name matches a preset (A100, H100, H200) keeps its datasheet peaks and the fit
gives the fractions of them; any other device (the CPU) takes the fitted asymptotic GEMM rate and
copy bandwidth as its peaks (fractions 1).

Example::

    python -m partitioner.calibrate            # this CPU (or --device cuda), prints and caches
    python -m partitioner.calibrate --quick    # the reduced set (seconds)

    >>> from partitioner.calibrate import fit_kernel_model, synthetic_timings
    >>> from partitioner.kernels import KERNEL_PRESETS
    >>> true = KERNEL_PRESETS["a100"]
    >>> fit = fit_kernel_model(synthetic_timings(true, 312e12, 2.039e12), 312e12, 2.039e12, units=108)
    >>> round(fit.gemm_efficiency, 3), round(fit.gemm_k0), round(fit.bandwidth, 3)
    (0.858, 160, 0.834)
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .devices import DEVICE_PRESETS, DeviceSpec, get_device_spec
from .kernels import KernelModel, attention_time, gemm_time, memory_time

__all__ = ["KERNEL_SET", "QUICK_SET", "calibrate", "fit_kernel_model", "time_kernels", "synthetic_timings",
           "cache_path", "load_calibrated", "save_calibrated", "device_name", "calibrated_spec", "main"]

# (batch, M, N, K) GEMMs from one partial wave to full-size; SDPA (batch, heads, seq, head_dim,
# causal); copy sizes in bytes.
KERNEL_SET: dict[str, list] = {
    "gemm": [(1, 64, 64, 64), (1, 256, 256, 256), (1, 512, 512, 128), (1, 1024, 1024, 1024),
             (1, 2048, 2048, 512), (1, 2048, 2048, 2048), (1, 4096, 4096, 4096), (8, 512, 512, 512)],
    "attention": [(1, 8, 256, 64, True), (1, 8, 1024, 64, True), (1, 8, 2048, 128, True)],
    "copy": [2**16, 2**20, 2**24, 2**27],
}
QUICK_SET: dict[str, list] = {
    "gemm": [(1, 64, 64, 64), (1, 128, 128, 128), (1, 256, 256, 64), (1, 256, 256, 256)],
    "attention": [(1, 2, 64, 32, True), (1, 2, 256, 32, True)],
    "copy": [2**14, 2**18, 2**21],
}
_K0_GRID = tuple(range(0, 1025, 16))
_S0_GRID = tuple(range(0, 4097, 32))


def device_name(device: Any = None) -> str:
    """The name calibrations are cached under: ``torch.cuda.get_device_name`` or the CPU model
    with its thread count."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    model = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x{torch.get_num_threads()}"


def cache_path(name: str) -> Path:
    """``$PIPESHARD_CACHE/devices/<slug of name>.json`` (default root ``~/.cache/pipeshard``)."""
    root = Path(os.environ.get("PIPESHARD_CACHE", Path.home() / ".cache" / "pipeshard"))
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_").lower() or "device"
    return root / "devices" / f"{slug}.json"


def save_calibrated(spec: DeviceSpec, name: str) -> Path:
    """Write ``spec`` (with its kernel model) to :func:`cache_path` of ``name``."""
    path = cache_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    d = {"name": spec.name, "peak_flops": spec.peak_flops, "memory_bandwidth": spec.memory_bandwidth,
         "memory_bytes": spec.memory_bytes, "link_bytes_per_s": spec.link_bytes_per_s, "notes": spec.notes,
         "attention": spec.attention, "kernels": spec.kernels.to_dict() if spec.kernels else None}
    path.write_text(json.dumps(d, indent=1))
    return path


def load_calibrated(name: str) -> DeviceSpec | None:
    """The cached calibration of ``name``, None when there is none."""
    path = cache_path(name)
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    kernels = KernelModel.from_dict(d.pop("kernels")) if d.get("kernels") else None
    return DeviceSpec(d["name"], d["peak_flops"], d["memory_bandwidth"], d["memory_bytes"],
                      d["link_bytes_per_s"], efficiency=1.0, overhead_s=kernels.launch_s if kernels else 0.0,
                      notes=d["notes"], attention=d["attention"], kernels=kernels)


def _timer(dev):
    """A function timing ``fn`` (min of ``reps`` after a warm-up), CUDA events on CUDA."""
    import torch

    def run(fn, reps: int) -> float:
        fn()
        best = math.inf
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize(dev)
                best = min(best, a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
        return best

    return run


def _sdpa_flops(b: int, h: int, s: int, d: int, causal: bool) -> tuple[float, float]:
    """FLOPs torch's flop counter books for a flash SDPA forward and backward (meta device)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    q = torch.empty(b, h, s, d, device="meta", requires_grad=True)
    with FlopCounterMode(display=False) as f:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, causal)[0]
    with FlopCounterMode(display=False) as g:
        out.backward(torch.empty_like(out))
    return float(f.get_total_flops()), float(g.get_total_flops())


def time_kernels(device: Any = None, dtype: Any = None, kernel_set: dict | None = None,
                 reps: int = 5) -> dict[str, list]:
    """Time :data:`KERNEL_SET` (or ``kernel_set``) on ``device``; the timings
    :func:`fit_kernel_model` takes."""
    import torch
    import torch.nn.functional as F

    dev = torch.device(device) if device is not None else torch.device("cpu")
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    ks, run = kernel_set or KERNEL_SET, _timer(dev)
    elem = torch.empty((), dtype=dt).element_size()
    one = torch.ones(1, device=dev, dtype=dt)
    out: dict[str, list] = {"launch": [run(lambda: one.add_(1), reps) for _ in range(3)], "gemm": [],
                            "attention": [], "copy": []}
    for b, m, n, k in ks["gemm"]:
        x, y = torch.randn(b, m, k, device=dev, dtype=dt), torch.randn(b, k, n, device=dev, dtype=dt)
        fn = (lambda x=x, y=y: torch.mm(x[0], y[0])) if b == 1 else (lambda x=x, y=y: torch.bmm(x, y))
        out["gemm"].append((b, m, n, k, elem, run(fn, reps)))
    for b, h, s, d, causal in ks["attention"]:
        q = torch.randn(b, h, s, d, device=dev, dtype=dt, requires_grad=True)
        fl_f, fl_b = _sdpa_flops(b, h, s, d, causal)
        o = F.scaled_dot_product_attention(q, q, q, is_causal=causal)
        g = torch.ones_like(o)
        out["attention"].append((fl_f, s, d, causal, False,
                                 run(lambda q=q: F.scaled_dot_product_attention(q, q, q, is_causal=causal), reps)))
        out["attention"].append((fl_b, s, d, causal, True, run(
            lambda q=q, g=g: F.scaled_dot_product_attention(q, q, q, is_causal=causal).backward(g), reps)
            - out["attention"][-1][-1]))
    for nbytes in ks["copy"]:
        src = torch.ones(nbytes // (2 * elem), device=dev, dtype=dt)
        dst = torch.empty_like(src)
        out["copy"].append((nbytes, run(lambda s=src, d=dst: d.copy_(s), reps)))
    return out


def _log_scale(pred: list[float], meas: list[float]) -> tuple[float, float]:
    """The factor c minimising sum (log meas - log(c * pred))^2, and the residual."""
    logs = [math.log(max(m, 1e-12)) - math.log(max(p, 1e-12)) for p, m in zip(pred, meas)]
    mu = statistics.fmean(logs)
    return math.exp(mu), sum((v - mu) ** 2 for v in logs)


def _fit_gemm(timings, base: KernelModel, peak: float, bandwidth: float, launch: float):
    best = (math.inf, 1.0, 0.0)
    rows = timings["gemm"]
    meas = [max(t - launch, 1e-9) for *_, t in rows]
    for k0 in _K0_GRID:
        k = replace(base, gemm_efficiency=1.0, gemm_k0=float(k0), launch_s=0.0)
        pred = [gemm_time(k, peak, math.inf, e, m, n, kk, b) for b, m, n, kk, e, _ in rows]
        scale, res = _log_scale(pred, meas)
        if res < best[0] - 1e-12:
            best = (res, 1.0 / scale, float(k0))
    return best[1], best[2]


def _fit_attention(timings, base: KernelModel, peak: float, launch: float):
    rows = timings["attention"]
    best = (math.inf, 1.0, 1.0, 0.0)
    for s0 in _S0_GRID:
        k = replace(base, attn_fwd=1.0, attn_bwd=1.0, attn_s0=float(s0), launch_s=0.0)
        res, fr = 0.0, []
        for bwd in (False, True):
            sel = [r for r in rows if r[4] == bwd]
            if not sel:
                fr.append(1.0)
                continue
            pred = [attention_time(k, peak, fl, s, d, c, bwd) for fl, s, d, c, _, _ in sel]
            scale, r = _log_scale(pred, [max(t - launch, 1e-9) for *_, t in sel])
            res += r
            fr.append(1.0 / scale)
        if res < best[0] - 1e-12:
            best = (res, fr[0], fr[1], float(s0))
    return best[1], best[2], best[3]


def fit_kernel_model(timings: dict[str, list], peak: float, bandwidth: float, *, units: int,
                     tiles: bool = True, source: str = "calibrated") -> KernelModel:
    """Fit :class:`KernelModel` constants to timings (:func:`time_kernels`' layout): launch cost
    = median of the launch probes; achieved bandwidth by least squares of the copies; GEMM
    efficiency and ``k0``, attention fractions and ``s0`` by a grid over the shape constant and a
    log-space least-squares scale. ``peak`` / ``bandwidth``: the peaks the fractions are of.
    A fraction is clamped to (0, 1]: a peak below what was measured is the caller's to fix."""
    launch = statistics.median(timings["launch"])
    xs = [b / bandwidth for b, _ in timings["copy"]]
    ys = [max(t - launch, 1e-12) for _, t in timings["copy"]]
    bw_frac = sum(x * x for x in xs) / sum(x * y for x, y in zip(xs, ys))
    base = KernelModel(units=units, gemm_efficiency=1.0, tiles=tiles, launch_s=launch, source=source)
    eff, k0 = _fit_gemm(timings, base, peak, bandwidth, launch)
    fwd, bwd, s0 = _fit_attention(timings, base, peak, launch) if timings.get("attention") else (0.5, 0.4, 256.0)
    clamp = lambda v: min(max(v, 1e-6), 1.0)  # noqa: E731
    return replace(base, gemm_efficiency=clamp(eff), gemm_k0=k0, attn_fwd=clamp(fwd), attn_bwd=clamp(bwd),
                   attn_s0=s0, bandwidth=clamp(bw_frac))


def synthetic_timings(k: KernelModel, peak: float, bandwidth: float, kernel_set: dict | None = None,
                      elem: int = 2) -> dict[str, list]:
    """Timings :class:`KernelModel` ``k`` predicts for the kernel set (to test the fit)."""
    ks = kernel_set or KERNEL_SET
    out: dict[str, list] = {"launch": [k.launch_s] * 3, "gemm": [], "attention": [], "copy": []}
    for b, m, n, kk in ks["gemm"]:
        out["gemm"].append((b, m, n, kk, elem, gemm_time(k, peak, math.inf, elem, m, n, kk, b)))
    for b, h, s, d, causal in ks["attention"]:
        fl = 4.0 * b * h * s * s * d
        for bwd, f in ((False, fl), (True, 2.5 * fl)):
            out["attention"].append((f, s, d, causal, bwd, attention_time(k, peak, f, s, d, causal, bwd)))
    out["copy"] = [(nb, memory_time(k, bandwidth, nb)) for nb in ks["copy"]]
    return out


def _preset_for(name: str) -> str | None:
    low = name.lower()
    return next((p for p in ("a100", "h100", "h200") if p in low), None)


def calibrate(device: Any = None, *, quick: bool = False, cache: bool = True, reps: int = 5) -> DeviceSpec:
    """Time the kernel set on ``device`` (default: this CPU), fit, cache under its name, and
    return the calibrated :class:`DeviceSpec`."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    name = device_name(dev)
    ks = QUICK_SET if quick else KERNEL_SET
    timings = time_kernels(dev, kernel_set=ks, reps=reps)
    preset = _preset_for(name) if dev.type == "cuda" else None
    if preset is not None:
        base = DEVICE_PRESETS[f"{preset}-flat"]
        dt = "bfloat16"
        k = fit_kernel_model(timings, base.peak_flops[dt], base.memory_bandwidth,
                             units=torch.cuda.get_device_properties(dev).multi_processor_count, source=f"calibrated: {name}")
        spec = replace(base, name=preset, kernels=k, efficiency=1.0, overhead_s=k.launch_s,
                       notes=f"{base.notes}; calibrated on {name}")
    else:
        spec = _self_peaked(timings, dev, name)
    if cache:
        save_calibrated(spec, name)
        if preset is not None:
            save_calibrated(spec, preset)
    return spec


def _self_peaked(timings: dict[str, list], dev, name: str) -> DeviceSpec:
    """A device without datasheet peaks: fit against unit peaks, then take the fitted rates as
    the peaks (fractions 1)."""
    import torch

    units = torch.get_num_threads() if dev.type == "cpu" else torch.cuda.get_device_properties(dev).multi_processor_count
    k = fit_kernel_model(timings, 1e12, 1e12, units=units, tiles=dev.type == "cuda", source=f"calibrated: {name}")
    # fractions may sit at the clamp: refit against the fitted peaks
    peak, bw = 1e12 * k.gemm_efficiency, 1e12 * k.bandwidth
    k = fit_kernel_model(timings, peak, bw, units=units, tiles=dev.type == "cuda", source=f"calibrated: {name}")
    dt = "float32" if dev.type == "cpu" else "bfloat16"
    cpu = get_device_spec("cpu") if dev.type == "cpu" else None
    return DeviceSpec("cpu" if dev.type == "cpu" else name, {dt: peak}, bw,
                      cpu.memory_bytes if cpu else torch.cuda.get_device_properties(dev).total_memory,
                      None, efficiency=1.0, overhead_s=k.launch_s, notes=f"calibrated: {name}", kernels=k)


def calibrated_spec(device_spec: str | None = None, *, quick: bool = False) -> DeviceSpec:
    """The calibrated spec for an analytic profile: the cached calibration of ``device_spec``
    (a preset name, calibrated on such a GPU) or of this machine's CPU (``None`` / ``"cpu"``),
    calibrating now when this machine has that device and nothing is cached."""
    import torch

    key = (device_spec or "cpu").lower()
    if key == "cpu":
        return load_calibrated(device_name("cpu")) or calibrate("cpu", quick=quick)
    cached = load_calibrated(key)
    if cached is not None:
        return cached
    here = device_name("cuda") if torch.cuda.is_available() else ""
    if torch.cuda.is_available() and _preset_for(here) == _preset_for(key):
        return calibrate("cuda", quick=quick)
    raise ValueError(f"partitioner.calibrate=true with device_spec={device_spec!r}: no calibration of it is cached "
                     f"({cache_path(key)}) and this machine has no such GPU. Run `python -m partitioner.calibrate "
                     "--device cuda` on one and copy the file there, or set partitioner.calibrate=false.")


def main(argv: list[str] | None = None) -> None:
    """``python -m partitioner.calibrate [--device cuda] [--quick]``: calibrate, cache, print."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="the reduced kernel set (seconds)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    spec = calibrate(args.device, quick=args.quick)
    print(f"{device_name(args.device)}: calibrated in {time.perf_counter() - t0:.1f} s -> {cache_path(device_name(args.device))}")
    print(f"peak {spec.peak_flops}, bandwidth {spec.memory_bandwidth:.3e} B/s")
    for key, value in spec.kernels.to_dict().items():
        print(f"  {key} = {value}")


if __name__ == "__main__":
    main()
