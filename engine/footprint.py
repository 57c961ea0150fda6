"""What a rank's optimizer backend holds in memory, per parameter (pure Python, no torch).

The one place that states the engine's memory layout (``engine.optim``'s torch backend and
``engine.zero``'s DeepSpeed backend); the partitioner's memory model reads it.

Example::

    >>> zero_bucket_elements(10_000_000, 4)
    2500000
"""
from __future__ import annotations

__all__ = ["zero_bucket_elements", "BUCKET_ELEMENTS"]

# DeepSpeed's default reduce / all-gather bucket, in elements.
BUCKET_ELEMENTS = 500_000_000


def zero_bucket_elements(numel: int, data_parallel: int) -> int:
    """DeepSpeed's reduce and all-gather bucket for a rank holding ``numel`` parameters: one
    replica's partition (``numel / data_parallel``), at most DeepSpeed's default, even.

    >>> zero_bucket_elements(1001, 2), zero_bucket_elements(10**12, 8)
    (502, 500000000)
    """
    part = -(-int(numel) // max(1, int(data_parallel)))
    return max(2, min(BUCKET_ELEMENTS, part + part % 2))
