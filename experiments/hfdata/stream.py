"""Packing while reading (`data.streaming=true`), with a position that a checkpoint can store.

`ShardStream` reads the documents in file order from an iterable dataset, keeps the ones its
`select(i)` accepts (a shard's training documents, or the held-out ones), tokenizes them a
batch at a time and emits the same blocks as `PackedShard` (EOS after each document, windows
of `T + 1` tokens at stride `T`, the tail of an epoch dropped, then the next epoch from the
first file again). Its `state()` after a block is `{"epoch", "doc", "offset"}`: the document
where the unread tokens begin and how many of its tokens (EOS included) were already used.
A stream built with that state continues with exactly the next block: it re-reads from that
document (the documents before it are parsed and skipped, not tokenized).

`Prefetcher` runs a producer in a background thread a few steps ahead, so tokenizing does not
stall the pipeline; `get(step)` returns the step's item and the seconds spent waiting for it.

Example::

    stream = ShardStream(lambda: iter_texts(load_documents(files, streaming=True)),
                         select=lambda i: i % 2 == 0, encode=lambda t: encode(tok, t), eos=0, seq_len=128)
    block = stream.next_block()          # int32 [129]
    saved = stream.state()               # resume: ShardStream(..., state=saved)
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from experiments.hfdata.layout import DataError

__all__ = ["ShardStream", "Prefetcher"]


class ShardStream:
    """One shard's endless sequence of blocks, read from files as needed (module docstring)."""

    def __init__(self, open_texts: Callable[[], Iterable[str]], *, select: Callable[[int], bool],
                 encode: Callable[[Sequence[str]], list[list[int]]], eos: int, seq_len: int,
                 state: dict | None = None, what: str = "shard 0", batch_docs: int = 64) -> None:
        self._open, self._select, self._encode = open_texts, select, encode
        self.eos, self.seq_len, self.what, self.batch_docs = int(eos), int(seq_len), what, batch_docs
        resumed = state is not None
        state = state or {"epoch": 0, "doc": 0, "offset": 0}
        self.epoch = int(state["epoch"])
        self._emitted = resumed  # a saved state always follows a block of its epoch
        self._start(int(state["doc"]), int(state["offset"]))

    def _start(self, doc: int, offset: int) -> None:
        self._buffer: deque[tuple[int, np.ndarray]] = deque()  # (document index, ids + EOS)
        self._first = doc  # the document the unread tokens begin in, until it is buffered
        self._pos = offset  # tokens of the first buffered document already used
        self._available = -offset
        self._docs = self._read(doc)

    def _read(self, first: int) -> Iterator[tuple[int, np.ndarray]]:
        """(index, ids + EOS) of the selected documents from document `first` on."""
        pending: list[tuple[int, str]] = []
        for i, text in enumerate(self._open()):
            if i < first or not self._select(i):
                continue
            pending.append((i, text))
            if len(pending) >= self.batch_docs:
                yield from self._tokenized(pending)
                pending = []
        yield from self._tokenized(pending)

    def _tokenized(self, pending: list[tuple[int, str]]) -> Iterator[tuple[int, np.ndarray]]:
        for (i, _), ids in zip(pending, self._encode([t for _, t in pending])):
            yield i, np.asarray(list(ids) + [self.eos], dtype=np.int32)

    def _fill(self) -> None:
        need = self.seq_len + 1
        while self._available < need:
            nxt = next(self._docs, None)
            if nxt is None:  # end of the files: the next epoch starts over
                if not self._emitted:
                    raise DataError(f"{self.what} has fewer than model.seq_len + 1 = {need} tokens; "
                                    "add text, lower model.seq_len, or use fewer data.shards")
                self.epoch += 1
                self._emitted = False
                self._start(0, 0)
                continue
            self._buffer.append(nxt)
            self._available += len(nxt[1])

    def next_block(self) -> np.ndarray:
        """The next `seq_len + 1` tokens (int32)."""
        self._fill()
        out, remaining, pos = [], self.seq_len + 1, self._pos
        for _, ids in self._buffer:
            piece = ids[pos:pos + remaining]
            out.append(piece)
            remaining -= len(piece)
            pos = 0
            if not remaining:
                break
        self._emitted = True
        self._advance(self.seq_len)
        return np.concatenate(out)

    def _advance(self, n: int) -> None:
        self._pos += n
        self._available -= n
        while self._buffer and self._pos >= len(self._buffer[0][1]):
            self._pos -= len(self._buffer.popleft()[1])

    def state(self) -> dict:
        """Where the next block starts: `{"epoch", "doc", "offset"}` (JSON-able)."""
        doc = self._buffer[0][0] if self._buffer else self._first
        return {"epoch": self.epoch, "doc": int(doc), "offset": int(self._pos)}


class Prefetcher:
    """`produce(step)` for step, step + 1, ... in a daemon thread, at most `depth` steps ahead."""

    def __init__(self, produce: Callable[[int], Any], start: int, depth: int = 2) -> None:
        self._produce, self._next = produce, int(start)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeshard-data", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step = self._next
        while not self._stop.is_set():
            try:
                item: Any = (step, self._produce(step), None)
            except BaseException as exc:  # handed to the training loop, which raises it
                item = (step, None, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1

    def get(self, step: int) -> tuple[Any, float]:
        """The item of `step` (the next one in order) and the seconds waited for it."""
        if step != self._next:
            raise ValueError(f"the prefetcher serves step {self._next} next, not {step}")
        t0 = time.perf_counter()
        got, item, exc = self._queue.get()
        waited = time.perf_counter() - t0
        if exc is not None:
            raise exc
        assert got == step, (got, step)
        self._next += 1
        return item, waited

    def close(self) -> None:
        """Stop the producer (it finishes the item in hand) and wait for it briefly."""
        self._stop.set()
        self._thread.join(timeout=5)
