"""Keep freed CPU memory in the process, as a caching allocator does on a GPU.

PyTorch's CPU tensors come from glibc ``malloc``. By default glibc serves a large block
(above a threshold that adapts between 128 KiB and 32 MiB) with a fresh ``mmap`` and returns it
to the kernel on ``free``, and it trims the top of the heap once more than twice that threshold
is free there. A training step allocates and frees the same large activations and gradients
every microbatch, so on CPU each of them is a new set of zero-filled pages: tens of thousands of
page faults per step, measured at 5-10% of a step on the benchmark GPTs (docs/performance.md).
:func:`tune_cpu_allocator` fixes the thresholds so that freed blocks stay in the heap and are
reused. Memory the process has used stays mapped (its RSS does not shrink), as with CUDA's
caching allocator.

It changes the whole process, so the runtime applies it once per worker process that trains on
the CPU, unless ``PIPESHARD_CPU_ALLOCATOR=default`` is set. Only glibc is tuned; elsewhere it is a
no-op.

Example::

    from engine.allocator import tune_cpu_allocator
    tune_cpu_allocator()        # True when glibc took the settings
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["tune_cpu_allocator", "ENV"]

ENV = "PIPESHARD_CPU_ALLOCATOR"
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD = 32 * 2**20     # glibc's largest accepted value on 64-bit
_TRIM_THRESHOLD = 2**30          # keep up to 1 GiB free at the top of the heap
_TOP_PAD = 64 * 2**20            # grow the heap in steps of 64 MiB

_tuned: bool | None = None


def tune_cpu_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once); returns whether they are
    set. A no-op returning False off glibc or with ``PIPESHARD_CPU_ALLOCATOR=default``."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get(ENV, "tuned").lower() == "default":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
        (_M_TOP_PAD, _TOP_PAD)))
    _tuned = ok
    return ok
