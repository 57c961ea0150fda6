"""Packing in memory (`data.streaming=false`): a shard's documents, EOS after each, cut into blocks.

A shard's token stream is its documents' ids in order, each followed by EOS; block `n` is the
window `stream[n T : n T + T + 1]` (inputs are its first `T` tokens, targets its last `T`), so
consecutive blocks share one token and the shard has `(len - 1) // T` of them per epoch (the
tail that does not fill a block is dropped). Epoch `e` reads the same blocks again, in order,
or in a seeded permutation of `(seed, shard, e)` with `data.shuffle=true`. The streaming
reader (`experiments.hfdata.stream`) produces the same blocks in the same order when not
shuffled.

The held-out set (:func:`split_corpus`) is the evenly spread held-out documents
(`experiments.hfdata.layout.Holdout`) when they fill at least one block. A corpus too small for
that (a handful of long documents) is held out by tokens instead: every document trains, and
the last `ceil(f * len)` tokens of each shard's stream (together at least one block) are held
out, so the fraction asked for is kept, counted in tokens. (Streaming keeps the document rule.)

Example:
    >>> shard = PackedShard(np.arange(10, dtype=np.int32), seq_len=4)
    >>> shard.num_blocks, shard.block(0).tolist(), shard.block(1).tolist(), shard.block(2).tolist()
    (2, [0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [0, 1, 2, 3, 4])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.hfdata.layout import DataError, Holdout

__all__ = ["TokenTable", "PackedShard", "CorpusSplit", "assign_documents", "split_corpus", "blocks_in"]


def blocks_in(num_tokens: int, seq_len: int) -> int:
    """Blocks of `seq_len + 1` tokens at stride `seq_len` in a stream of `num_tokens`."""
    return max(0, (int(num_tokens) - 1) // seq_len)


def assign_documents(n: int, holdout: Holdout, shards: int) -> np.ndarray:
    """For documents `0..n-1`: their shard, or -1 for a held-out document.

    >>> assign_documents(8, Holdout(0.25), 2).tolist()
    [0, 1, 0, -1, 1, 0, 1, -1]
    """
    held, train_index = holdout.split(n)
    return np.where(held, -1, train_index % shards)


class TokenTable:
    """Every non-empty document's token ids, in order, from the tokenized table (a pyarrow
    Table or a `datasets` Dataset's `.data`; memory-mapped, only what a shard gathers is copied)."""

    def __init__(self, tokenized: Any) -> None:
        self._values: list[np.ndarray] = []
        chunk_of, starts, lengths = [], [], []
        for c, chunk in enumerate(tokenized.column("input_ids").chunks):
            lens = chunk.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
            self._values.append(chunk.flatten().to_numpy(zero_copy_only=False))
            chunk_of.append(np.full(len(lens), c, dtype=np.int64))
            starts.append(np.cumsum(lens) - lens)
            lengths.append(lens)
        keep = tokenized.column("keep").to_numpy(zero_copy_only=False).astype(bool)
        cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64))
        self.chunk, self.start, self.length = cat(chunk_of)[keep], cat(starts)[keep], cat(lengths)[keep]

    def __len__(self) -> int:
        return len(self.length)

    def stream_length(self, docs: np.ndarray) -> int:
        """Tokens in the stream of these documents (their ids plus one EOS each)."""
        return int(self.length[docs].sum() + len(docs))

    def stream(self, docs: np.ndarray, eos: int) -> np.ndarray:
        """The ids of `docs` (ascending indices) concatenated, EOS after each; int32."""
        pieces = []
        for c in np.unique(self.chunk[docs]):
            mine = docs[self.chunk[docs] == c]
            lens = self.length[mine] + 1
            ends = np.cumsum(lens)
            idx = np.repeat(self.start[mine] - (ends - lens), lens) + np.arange(int(ends[-1]))
            values = self._values[c]
            piece = values[np.minimum(idx, max(len(values) - 1, 0))] if len(values) else np.zeros(len(idx))
            piece = piece.astype(np.int32)
            piece[ends - 1] = eos
            pieces.append(piece)
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)


class PackedShard:
    """One shard's blocks, epoch after epoch (see the module docstring)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, *, shuffle: bool = False, seed: int = 0,
                 shard: int = 0, what: str = "shard 0") -> None:
        self.tokens, self.seq_len = tokens, int(seq_len)
        self.num_blocks = blocks_in(len(tokens), self.seq_len)
        if self.num_blocks == 0:
            raise DataError(f"{what} has {len(tokens)} tokens, fewer than model.seq_len + 1 = {self.seq_len + 1}; "
                            "add text, lower model.seq_len, or use fewer data.shards")
        self.shuffle, self.seed, self.shard = shuffle, int(seed), int(shard)
        self._perm: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.shard, epoch])
            self._perm = (epoch, rng.permutation(self.num_blocks))
        return self._perm[1]

    def block(self, n: int) -> np.ndarray:
        """Block number `n` of the shard's endless sequence (epoch `n // num_blocks`)."""
        epoch, j = divmod(int(n), self.num_blocks)
        if self.shuffle:
            j = int(self._order(epoch)[j])
        start = j * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]


@dataclass(frozen=True)
class CorpusSplit:
    """Which tokens train where and which are held out (:func:`split_corpus`)."""

    owner: np.ndarray         # per document: its shard, or -1 for a held-out document
    tails: tuple[int, ...]    # per shard: tokens at the end of its stream held out (0: by documents)

    @property
    def by_tokens(self) -> bool:
        return any(self.tails)

    def shard_length(self, table: TokenTable, k: int) -> int:
        """Training tokens of shard `k`."""
        return table.stream_length(np.flatnonzero(self.owner == k)) - self.tails[k]

    def shard(self, table: TokenTable, k: int, eos: int) -> np.ndarray:
        """Shard `k`'s training token stream."""
        tokens = table.stream(np.flatnonzero(self.owner == k), eos)
        return tokens[:len(tokens) - self.tails[k]]

    def held_length(self, table: TokenTable) -> int:
        return table.stream_length(np.flatnonzero(self.owner == -1)) + sum(self.tails)

    def held(self, table: TokenTable, eos: int) -> np.ndarray:
        """The held-out token stream: the held-out documents, then each shard's held-out tail."""
        parts = [table.stream(np.flatnonzero(self.owner == -1), eos)]
        for k, tail in enumerate(self.tails):
            if tail:
                parts.append(table.stream(np.flatnonzero(self.owner == k), eos)[-tail:])
        return np.concatenate(parts)


def split_corpus(table: TokenTable, holdout: Holdout, shards: int, seq_len: int) -> CorpusSplit:
    """The held-out documents of `holdout` if they fill one block of `seq_len + 1` tokens, else
    a split by tokens (module docstring).

    >>> class Docs(TokenTable):
    ...     def __init__(self, lengths): self.length = np.array(lengths)
    >>> split = split_corpus(Docs([40, 50, 60]), Holdout(0.1), 1, 8)
    >>> split.by_tokens, split.tails, split.shard_length(Docs([40, 50, 60]), 0)
    (True, (16,), 137)
    """
    need = int(seq_len) + 1
    owner = assign_documents(len(table), holdout, shards)
    if table.stream_length(np.flatnonzero(owner == -1)) >= need:
        return CorpusSplit(owner, (0,) * shards)
    owner = np.arange(len(table)) % shards
    per = -(-need // shards)
    lengths = [table.stream_length(np.flatnonzero(owner == k)) for k in range(shards)]
    tails = tuple(min(n, max(per, math.ceil(n * float(holdout.fraction)))) for n in lengths)
    return CorpusSplit(owner, tails)
