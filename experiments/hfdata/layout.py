"""Which document goes where: the held-out rule, the shards and the rows of a step's batch.

Documents are numbered 0, 1, 2, ... in file order (empty ones are skipped and not counted).
Document `i` is held out for the evaluation loss when `floor((i + 1) f) > floor(i f)` for
`f = data.eval_fraction` (evenly spread, exactly `floor(n f)` of the first `n`); the others are
training documents, numbered `t = 0, 1, ...`, and training document `t` belongs to shard
`t % K` (`K = data.shards`). Every rule is a function of the index alone, so a streaming
reader decides it while reading, and both readers agree.

A step's global batch has `B = train.batch_size` rows: shard `k` fills rows
`k * B/K ... (k + 1) * B/K - 1` with its next `B/K` blocks. Replica `r` of `d` owns the shards
`r * K/d ... (r + 1) * K/d - 1`, which are exactly the rows the engine gives it, so a replica
reads only its own documents and the batch does not depend on the pipeline layout.

Example:
    >>> h = Holdout(0.25)
    >>> [i for i in range(8) if h.is_eval(i)]
    [3, 7]
    >>> ShardLayout(shards=4, batch_size=8, replicas=2).shards_of(1)
    range(2, 4)
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

__all__ = ["DataError", "Holdout", "ShardLayout"]


class DataError(ValueError):
    """Data (or `data.*` settings) that cannot be trained on; the message names the fix. The
    entry points report it like a `ConfigError` (`error: ...`, exit status 2, before launch)."""


@dataclass(frozen=True)
class Holdout:
    """The evenly spread held-out documents for `data.eval_fraction` (see the module docstring)."""

    fraction: float

    def __post_init__(self) -> None:
        if not 0.0 < float(self.fraction) < 1.0:
            raise DataError(f"data.eval_fraction={self.fraction}; choose a value in (0, 1), e.g. 0.05")
        frac = Fraction(float(self.fraction)).limit_denominator(10**6)
        object.__setattr__(self, "_num", frac.numerator)
        object.__setattr__(self, "_den", frac.denominator)

    def held_count(self, n: int | np.ndarray) -> int | np.ndarray:
        """Held-out documents among the first `n` (integer arithmetic: the same on every machine)."""
        return (n * self._num) // self._den  # type: ignore[attr-defined]

    def is_eval(self, i: int) -> bool:
        """Whether document `i` is held out."""
        return self.held_count(i + 1) > self.held_count(i)

    def train_index(self, i: int) -> int:
        """The training number `t` of (training) document `i`."""
        return i - int(self.held_count(i))

    def split(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """For documents `0..n-1`: the boolean held-out mask and the training number of each."""
        i = np.arange(n, dtype=np.int64)
        held = self.held_count(i + 1) > self.held_count(i)
        return held, i - self.held_count(i)


@dataclass(frozen=True)
class ShardLayout:
    """`K` shards feeding a global batch of `B` rows, owned by `d` replicas (module docstring)."""

    shards: int
    batch_size: int
    replicas: int = 1

    def __post_init__(self) -> None:
        k, b, d = self.shards, self.batch_size, self.replicas
        if k < 1:
            raise DataError(f"data.shards={k}; it must be at least 1 (null: pipeline.data_parallel)")
        if b % k:
            raise DataError(f"train.batch_size={b} does not split into data.shards={k} equal parts; "
                            f"choose data.shards dividing {b} (and a multiple of pipeline.data_parallel={d})")
        if k % d:
            raise DataError(f"data.shards={k} cannot be divided among pipeline.data_parallel={d} replicas; "
                            f"choose data.shards as a multiple of {d} (e.g. data.shards={d})")

    @property
    def rows_per_shard(self) -> int:
        """Blocks each shard gives per step (`B / K`)."""
        return self.batch_size // self.shards

    def shards_of(self, replica: int) -> range:
        """The shards replica `replica` reads."""
        per = self.shards // self.replicas
        return range(replica * per, (replica + 1) * per)

    def rows_of(self, replica: int) -> slice:
        """The rows of the global batch that replica `replica` trains on."""
        per = self.batch_size // self.replicas
        return slice(replica * per, (replica + 1) * per)
