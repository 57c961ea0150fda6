"""Layer times with cold caches: an instrument to bound what the CPU's caches cost a step.

A profile times each layer on its own, over and over, so its weights, activations and gradients
stay in the caches between runs ("hot"). A training step does not repeat a layer: between a
layer's forward and its backward, and between two microbatches, the rank's other layers (and on
a CPU host the other ranks) pass through the same last-level cache. ``"cold"`` times each layer
after reading other data through the caches (:class:`CacheEvictor`, twice the last-level cache,
:func:`last_level_cache_bytes`) before each timed forward, backward and backward half, so every
line the layer reads comes from memory.

The two bracket a step on this project's 2-core CPU host (32 MiB last-level cache), and neither
predicts it (docs/performance.md, issue 39's MLP check): a single process running the model's
layers in turn measured within 1.3% of the hot profile's sum (the hardware prefetches a
sequential pass), while cold layers of 256 -> 1024 -> 256 took 0.9-1.0 ms more each at 32
samples (+50-85%) and 0.4-1.1 ms more at 64 (+13-45%). A 3-rank pipeline on the 2 cores lay
between the two: planned from hot times its 8-microbatch layouts measured 8-27% above the plan,
from cold times 29-31% below it. So plans use hot times (the default) and
``partitioner.caches=cold`` is there to measure the bound.

Example::

    >>> check_caches("cold")
    'cold'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CACHE_MODES", "CacheEvictor", "check_caches", "last_level_cache_bytes"]

CACHE_MODES = ("hot", "cold")
"""``partitioner.profile``'s ``caches`` choices (module docstring)."""

_MAX_EVICT_BYTES = 512 << 20   # the evicting buffer: twice the cache, at most this
_UNKNOWN_CACHE_BYTES = 64 << 20   # evicted when sysfs does not say


def check_caches(mode: str) -> str:
    """``mode`` if it is one of :data:`CACHE_MODES`, else a ``ValueError`` naming them."""
    if mode not in CACHE_MODES:
        raise ValueError(f"caches must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
    return mode


def _size_bytes(text: str) -> int:
    """sysfs cache sizes: ``"32768K"``, ``"2M"``, or bytes.

    >>> _size_bytes("32768K"), _size_bytes("2M"), _size_bytes("512")
    (33554432, 2097152, 512)
    """
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def last_level_cache_bytes(root: str | Path = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of this CPU's highest-level cache (Linux sysfs), or None where it cannot be read."""
    best: tuple[int, int] | None = None
    try:
        for index in Path(root).glob("index*"):
            kind = (index / "type").read_text().strip()
            if kind not in ("Unified", "Data"):
                continue
            level, size = int((index / "level").read_text()), _size_bytes((index / "size").read_text())
            best = max(best or (level, size), (level, size))
    except (OSError, ValueError):
        return None
    return best[1] if best else None


class CacheEvictor:
    """Calling it reads a buffer twice ``cache_bytes`` (default: the last-level cache, else 64 MiB;
    at most 512 MiB), written once when made: every line a layer then reads comes from memory.

    >>> CacheEvictor(1 << 16)()   # a 64 KiB cache: a 128 KiB buffer read
    """

    def __init__(self, cache_bytes: int | None = None) -> None:
        import torch

        size = cache_bytes or last_level_cache_bytes() or _UNKNOWN_CACHE_BYTES
        self.buffer: Any = torch.ones(min(2 * size, _MAX_EVICT_BYTES) // 4)   # written: real pages

    def __call__(self) -> None:
        self.buffer.sum()
