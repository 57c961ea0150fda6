"""Datasets whose batches are pure functions of (seed, step): a resumed run continues the same stream.

`data=text`: byte-level language modelling on real text found on every machine without a
download, the Python standard library's own source files (sorted, read up to a byte budget).
The last `holdout_fraction` of the bytes is held out for the evaluation loss. A batch is
`(inputs [B, T] int64, targets [B, T] int64)` with targets shifted by one byte.

`data=hf` (`experiments.hfdata`): your own files, tokenized with the model's tokenizer.

`data=synthetic`: random tokens for language models (benchmarks: the loss does not fall), or
standard-normal features labelled by a fixed random teacher for `model=mlp` (learnable).

Example:
    >>> ds = TextDataset(seq_len=32, max_bytes=100_000, seed=0)
    >>> x, y = ds.train_batch(step=7, batch_size=4)
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([4, 32]), True)
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch


__all__ = ["Dataset", "TextDataset", "SyntheticTokens", "SyntheticFeatures", "make_dataset", "read_corpus"]

_TRAIN, _EVAL = 0, 1  # stream ids mixed into the seed
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class Dataset(Protocol):
    """What the training loop needs: deterministic train and held-out batches."""

    def train_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The training batch of `step`; a pure function of the dataset's seed and `step`."""
        ...

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch number `index` (the same for every call)."""
        ...


def _rng(seed: int, stream: int, step: int) -> np.random.Generator:
    # SeedSequence mixes the three integers, so nearby steps/seeds give unrelated streams.
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, stream, int(step)])


def read_corpus(root: str | os.PathLike | None = None, suffix: str = ".py", max_bytes: int = 8_000_000) -> bytes:
    """Concatenate files under `root` (default: the stdlib) in sorted path order, up to `max_bytes`.

    >>> len(read_corpus(max_bytes=1000))
    1000
    """
    base = Path(root) if root else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"data.root={str(base)!r} is not a directory; point data.root at a folder of text files")
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(suffix):
                continue
            try:
                data = (Path(dirpath) / name).read_bytes()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes]
    if not chunks:
        raise FileNotFoundError(f"no '*{suffix}' files under {str(base)!r}; set data.root or data.suffix")
    return b"".join(chunks)


class TextDataset:
    """Byte-level LM batches from a corpus: random windows, deterministic in (seed, step)."""

    vocab = 256

    def __init__(
        self,
        seq_len: int,
        *,
        seed: int = 0,
        root: str | None = None,
        suffix: str = ".py",
        max_bytes: int = 8_000_000,
        holdout_fraction: float = 0.05,
        corpus: bytes | None = None,
    ) -> None:
        raw = corpus if corpus is not None else read_corpus(root, suffix, max_bytes)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if not 0.0 < holdout_fraction < 1.0:
            raise ValueError(f"data.holdout_fraction={holdout_fraction}; choose a value in (0, 1), e.g. 0.05")
        split = int(len(data) * (1.0 - holdout_fraction))
        self.train_data, self.eval_data = data[:split], data[split:]
        for part, label in ((self.train_data, "training"), (self.eval_data, "held-out")):
            if len(part) < seq_len + 2:
                raise ValueError(
                    f"the {label} text has {len(part)} bytes, fewer than model.seq_len + 2 = {seq_len + 2}; "
                    "raise data.max_bytes (or data.holdout_fraction) or lower model.seq_len"
                )
        self.seq_len = seq_len
        self.seed = seed

    def _windows(self, data: torch.Tensor, rng: np.random.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.from_numpy(rng.integers(0, len(data) - self.seq_len - 1, size=batch_size))
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = data[idx].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def train_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets `[batch_size, seq_len]` for training step `step`."""
        return self._windows(self.train_data, _rng(self.seed, _TRAIN, step), batch_size)

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index` (from the last part of the corpus, never trained on)."""
        return self._windows(self.eval_data, _rng(self.seed, _EVAL, index), batch_size)


class SyntheticTokens:
    """Uniformly random token sequences (for throughput: there is nothing to learn)."""

    def __init__(self, seq_len: int, vocab: int, *, seed: int = 0, holdout_seed_offset: int = 1_000_003) -> None:
        self.seq_len, self.vocab, self.seed, self.offset = seq_len, vocab, seed, holdout_seed_offset

    def _batch(self, seed: int, stream: int, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = _rng(seed, stream, step)
        tokens = torch.from_numpy(rng.integers(0, self.vocab, size=(batch_size, self.seq_len + 1)))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def train_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random tokens `[batch_size, seq_len]` and their shift by one."""
        return self._batch(self.seed, _TRAIN, step, batch_size)

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out random tokens (a stream disjoint from training)."""
        return self._batch(self.seed + self.offset, _EVAL, index, batch_size)


class SyntheticFeatures:
    """Standard-normal features `[B, in_dim]` labelled by a fixed random linear teacher (learnable)."""

    def __init__(self, in_dim: int, classes: int, *, seed: int = 0, holdout_seed_offset: int = 1_000_003) -> None:
        self.in_dim, self.classes, self.seed, self.offset = in_dim, classes, seed, holdout_seed_offset
        teacher_rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 2])
        self.teacher = torch.from_numpy(teacher_rng.standard_normal((in_dim, classes))).float()

    def _batch(self, seed: int, stream: int, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(_rng(seed, stream, step).standard_normal((batch_size, self.in_dim))).float()
        return x, (x @ self.teacher).argmax(dim=1)

    def train_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features `[batch_size, in_dim]` float32 and class labels `[batch_size]` int64."""
        return self._batch(self.seed, _TRAIN, step, batch_size)

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out features and labels (a stream disjoint from training, same teacher)."""
        return self._batch(self.seed + self.offset, _EVAL, index, batch_size)


def make_dataset(cfg: Any, *, replica: int = 0, prepared: dict | None = None) -> Dataset:
    """The dataset for a whole experiment config (`data`, `model` and `train.seed` are used;
    the typed `Config`, or what `experiments.config.as_config` takes).

    `replica`: the data-parallel replica this process trains (data=hf reads only its shards;
    the other datasets are pure functions of the step and ignore it). `prepared`: data=hf's
    settings as `experiments.hfdata.prepare` resolved them (the job's `data`).

    >>> ds = make_dataset({"data": {"name": "synthetic"}, "model": {"name": "gpt", "seq_len": 8, "vocab": 50},
    ...                    "train": {"seed": 0}})
    >>> ds.train_batch(0, 2)[0].shape
    torch.Size([2, 8])
    """
    from experiments.config import HFDataConfig, MLPConfig, SyntheticDataConfig, TextDataConfig, as_config

    cfg = as_config(cfg)
    data, model, seed = cfg.data, cfg.model, int(cfg.train.seed)
    if isinstance(data, TextDataConfig):
        if isinstance(model, MLPConfig):
            raise ValueError("data=text needs a language model; use data=synthetic with model=mlp")
        return TextDataset(int(model.seq_len), seed=seed, root=data.root, suffix=str(data.suffix),
                           max_bytes=int(data.max_bytes), holdout_fraction=float(data.holdout_fraction))
    if isinstance(data, SyntheticDataConfig):
        offset = int(data.holdout_seed_offset)
        if isinstance(model, MLPConfig):
            return SyntheticFeatures(int(model.in_dim), int(model.classes), seed=seed, holdout_seed_offset=offset)
        return SyntheticTokens(int(model.seq_len), int(model.vocab), seed=seed, holdout_seed_offset=offset)
    if isinstance(data, HFDataConfig):
        from experiments.hfdata import HFTextData, spec_of

        return HFTextData(spec_of(cfg, prepared), replica=replica)
    raise ValueError(f"unknown data={data.name!r}; choose data=text, data=synthetic or data=hf")
