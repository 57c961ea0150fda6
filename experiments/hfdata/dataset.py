"""`data=hf`: the user's files, tokenized with the model's tokenizer, packed, sharded per replica.

`prepare(cfg)` runs before any worker starts: it resolves `data.files`, loads the tokenizer,
checks the data (missing files, no text, a missing text field, a vocabulary larger than the
model's embedding, shards too short for one block) and, without streaming, tokenizes the corpus
into `datasets`' cache; it returns the resolved `data` settings the workers use.

`HFTextData` is what a worker trains on (the `experiments.data.Dataset` protocol). Replica `r`
reads only its shards (`experiments.hfdata.layout`) and `train_batch(step, B)` returns the
step's global batch with this replica's rows filled (the engine reads only those rows; the
others are left uninitialised). Without streaming a batch is a pure function of the step; with
streaming the blocks are read and tokenized a few steps ahead in a background thread, and
`state()` / `restore()` carry the position through a checkpoint so a resumed run reads the
very batches the uninterrupted one would have.

Example::

    data_cfg = prepare(cfg)                       # launcher, once
    data = HFTextData(spec_of(cfg, data_cfg), replica=0)
    x, y = data.train_batch(step=0, batch_size=16)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from experiments.fields import choice_text
from experiments.hfdata.files import iter_texts, load_documents, resolve_files
from experiments.hfdata.layout import DataError, Holdout, ShardLayout
from experiments.hfdata.packed import PackedShard, TokenTable, blocks_in, split_corpus
from experiments.hfdata.stream import Prefetcher, ShardStream
from experiments.hfdata.tokens import (check_vocab, encode, eos_id, load_tokenizer, read_tokenized,
                                       tokenize_corpus, tokenizer_dir)

__all__ = ["HFDataSpec", "HFTextData", "spec_of", "prepare", "merge_states"]


@dataclass(frozen=True)
class HFDataSpec:
    """Resolved `data=hf` settings plus what they depend on elsewhere in the config."""

    files: tuple[str, ...]
    tokenizer: str
    text_field: str = "text"
    sample_by: str = "line"
    eval_fraction: float = 0.05
    streaming: bool = False
    shards: int = 1
    shuffle: bool = False
    prefetch: int = 2
    cache_dir: str | None = None
    tokenized: tuple[str, ...] = ()  # the tokenized cache's Arrow files, as `prepare` found them
    seq_len: int = 128
    batch_size: int = 16
    replicas: int = 1
    seed: int = 0

    def documents(self, streaming: bool) -> Any:
        """The files as a `datasets` dataset (iterable when `streaming`)."""
        return load_documents(list(self.files), text_field=self.text_field, sample_by=self.sample_by,
                              streaming=streaming, cache_dir=self.cache_dir)


def spec_of(cfg: Any, prepared: dict | None = None) -> HFDataSpec:
    """The spec of a whole experiment config (the typed `Config`, or what `as_config` takes);
    `prepared`: the `data` settings as `prepare` resolved them (they replace the config's)."""
    import dataclasses

    from experiments.config import as_config

    cfg = as_config(cfg)
    data, dp = cfg.data, int(cfg.pipeline.data_parallel)
    files = data.files
    spec = HFDataSpec(
        files=tuple([files] if isinstance(files, str) else list(files or ())),
        tokenizer=tokenizer_dir(data.tokenizer, _pretrained(cfg)),
        text_field=str(data.text_field), sample_by=choice_text(data.sample_by),
        eval_fraction=float(data.eval_fraction), streaming=bool(data.streaming),
        shards=int(data.shards) if data.shards is not None else dp, shuffle=bool(data.shuffle),
        prefetch=int(data.prefetch), cache_dir=data.cache_dir, seq_len=int(cfg.model.seq_len),
        batch_size=int(cfg.train.batch_size), replicas=dp, seed=int(cfg.train.seed))
    if not prepared:
        return spec
    known = {f.name for f in dataclasses.fields(HFDataSpec)}
    return dataclasses.replace(spec, **{k: tuple(v) if isinstance(v, list) else v
                                        for k, v in prepared.items() if k in known and v is not None})


def _pretrained(cfg: Any) -> str | None:
    """`model.pretrained` of a Hugging Face model (its tokenizer is data=hf's default)."""
    from experiments.config import HFModelConfig

    return cfg.model.pretrained if isinstance(cfg.model, HFModelConfig) else None


class HFTextData:
    """Training and held-out batches of one replica (see the module docstring)."""

    def __init__(self, spec: HFDataSpec, replica: int = 0) -> None:
        self.spec, self.replica = spec, int(replica)
        self.layout = ShardLayout(spec.shards, spec.batch_size, spec.replicas)
        self.holdout = Holdout(spec.eval_fraction)
        self.tok = load_tokenizer(spec.tokenizer)
        self.eos = eos_id(self.tok, spec.tokenizer)
        self._lock = threading.Lock()  # one fast tokenizer must not encode in two threads at once
        self.mine = list(self.layout.shards_of(self.replica))
        self._restored: tuple[int, dict] | None = None
        self._prefetch: Prefetcher | None = None
        self._states: dict[str, dict] = {}
        if spec.streaming:
            self._eval = _EvalBlocks(self._stream(lambda i: self.holdout.is_eval(i), "the held-out documents"))
        else:
            self._packed, self._eval_packed = self._pack()

    # ------------------------------------------------------------------ reading
    def _encode(self, texts: Any) -> list[list[int]]:
        with self._lock:
            return encode(self.tok, texts)

    def _pack(self) -> tuple[dict[int, PackedShard], PackedShard]:
        cached = read_tokenized(self.spec.tokenized)
        if cached is None:
            cached = tokenize_corpus(self.spec.documents(streaming=False), self.tok)[0].data
        table = TokenTable(cached)
        split = split_corpus(table, self.holdout, self.spec.shards, self.spec.seq_len)
        shards = {k: PackedShard(split.shard(table, k, self.eos), self.spec.seq_len,
                                 shuffle=self.spec.shuffle, seed=self.spec.seed, shard=k, what=f"data shard {k}")
                  for k in self.mine}
        held = PackedShard(split.held(table, self.eos), self.spec.seq_len, what="the held-out tokens")
        return shards, held

    def _stream(self, select: Callable[[int], bool], what: str, state: dict | None = None) -> ShardStream:
        spec = self.spec
        return ShardStream(lambda: iter_texts(spec.documents(streaming=True)), select=select,
                           encode=self._encode, eos=self.eos, seq_len=spec.seq_len, state=state, what=what)

    def _shard_stream(self, k: int, state: dict | None) -> ShardStream:
        h, n = self.holdout, self.spec.shards
        return self._stream(lambda i: not h.is_eval(i) and h.train_index(i) % n == k, f"data shard {k}", state)

    # ------------------------------------------------------------------ batches
    def _rows(self, step: int) -> np.ndarray:
        per = self.layout.rows_per_shard
        return np.stack([self._packed[k].block(step * per + u) for k in self.mine for u in range(per)])

    def _start_streams(self, step: int) -> None:
        states = self._restored[1] if self._restored and self._restored[0] == step else {}
        streams = {k: self._shard_stream(k, states.get(str(k))) for k in self.mine}
        for k, s in streams.items():  # no saved position for this step: read up to it
            if str(k) not in states:
                for _ in range(step * self.layout.rows_per_shard):
                    s.next_block()

        def produce(s: int) -> tuple[np.ndarray, dict]:
            rows = [streams[k].next_block() for k in self.mine for _ in range(self.layout.rows_per_shard)]
            return np.stack(rows), {str(k): streams[k].state() for k in self.mine}

        self._prefetch = Prefetcher(produce, step, self.spec.prefetch)

    def _global(self, rows: np.ndarray, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.spec.seq_len
        x = torch.empty((batch_size, t), dtype=torch.int64)
        y = torch.empty((batch_size, t), dtype=torch.int64)
        own = torch.from_numpy(rows.astype(np.int64))
        sl = self.layout.rows_of(self.replica)
        x[sl], y[sl] = own[:, :-1], own[:, 1:]
        return x, y

    def train_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's `[B, seq_len]` inputs and targets; only this replica's rows are filled."""
        if batch_size != self.spec.batch_size:
            raise ValueError(f"data=hf was prepared for train.batch_size={self.spec.batch_size}, not {batch_size}")
        if not self.spec.streaming:
            return self._global(self._rows(step), batch_size)
        if self._prefetch is None:
            self._start_streams(step)
        assert self._prefetch is not None
        (rows, self._states), _ = self._prefetch.get(step)
        return self._global(rows, batch_size)

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index`: blocks `index*B ...` of the held-out documents (all rows, cycled)."""
        get = self._eval.block if self.spec.streaming else self._eval_packed.block
        rows = torch.from_numpy(np.stack([get(index * batch_size + j) for j in range(batch_size)]).astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    # ------------------------------------------------------------------ position
    def state(self) -> dict:
        """JSON position after the last training batch: this replica's streams (streaming only)."""
        return {"shards": self.spec.shards, "streaming": self.spec.streaming,
                "streams": dict(self._states) if self.spec.streaming else {}}

    def restore(self, step: int, state: dict | None) -> None:
        """Continue at `step` from a checkpoint's merged `state()` (None: replay up to `step`)."""
        if state and int(state.get("shards", self.spec.shards)) != self.spec.shards:
            raise DataError(f"the checkpoint's data order has data.shards={state['shards']}, this run "
                            f"data.shards={self.spec.shards}; set data.shards={state['shards']}")
        self._restored = (int(step), dict((state or {}).get("streams") or {}))

    def close(self) -> None:
        """Stop reading ahead."""
        if self._prefetch is not None:
            self._prefetch.close()


class _EvalBlocks:
    """The held-out blocks read once, lazily, and cycled (the stream's first epoch)."""

    def __init__(self, stream: ShardStream) -> None:
        self._stream, self._blocks = stream, []  # type: list[np.ndarray]
        self._total: int | None = None

    def block(self, n: int) -> np.ndarray:
        while self._total is None and len(self._blocks) <= n:
            block = self._stream.next_block()
            if self._stream.epoch > 0:  # wrapped around: every held-out block is known
                self._total = len(self._blocks)
            else:
                self._blocks.append(block)
        return self._blocks[n % self._total] if self._total else self._blocks[n]


def merge_states(states: list[dict | None]) -> dict | None:
    """One checkpoint position from every rank's `state()` (None from ranks without data)."""
    given = [s for s in states if s]
    if not given:
        return None
    merged = {k: v for k, v in given[0].items() if k != "streams"}
    merged["streams"] = {k: v for s in given for k, v in (s.get("streams") or {}).items()}
    return merged


def _model_vocab(cfg: Any) -> tuple[int | None, str]:
    from experiments.config import MLPConfig, pretrained_facts

    facts = pretrained_facts(cfg.model)
    if facts is not None:
        return int(facts["vocab"]), ("use the model's own tokenizer (leave data.tokenizer unset) or "
                                     "one made for this model")
    vocab = None if isinstance(cfg.model, MLPConfig) else cfg.model.vocab
    return (int(vocab) if vocab is not None else None), "raise model.vocab or use a smaller tokenizer"


def prepare(cfg: Any, resumed: dict | None = None, *, echo: Callable[[str], None] = print) -> dict:
    """Check (and without streaming tokenize) the data before launch; the resolved `data` dict.

    `resumed`: the `data` entry of the checkpoint being resumed (its `shards` is kept when
    `data.shards` is unset)."""
    from experiments.config import as_config, to_plain_dict

    cfg = as_config(cfg)
    data, d = cfg.data, int(cfg.pipeline.data_parallel)
    saved = int(resumed["shards"]) if resumed and resumed.get("shards") else None
    shards = data.shards if data.shards is not None else (saved if saved and saved % d == 0 else d)
    plain = {**to_plain_dict(data), "files": resolve_files(data.files),
             "tokenizer": tokenizer_dir(data.tokenizer, _pretrained(cfg)), "shards": int(shards)}
    if saved and saved != int(shards):
        raise DataError(f"the checkpoint being resumed read its data in data.shards={saved} shards, "
                        f"this run in {shards}: the batches would differ; set data.shards="
                        f"{saved} (pipeline.data_parallel must divide it) to continue its data "
                        "order exactly, or checkpoint.resume=false to start over")
    spec = spec_of(cfg, plain)
    ShardLayout(spec.shards, spec.batch_size, spec.replicas)
    Holdout(spec.eval_fraction)
    tok = load_tokenizer(spec.tokenizer)
    eos_id(tok, spec.tokenizer)
    vocab, fix = _model_vocab(cfg)
    check_vocab(tok, vocab, spec.tokenizer, fix)
    if spec.streaming:
        summary = _check_streamed(spec, tok)
    else:
        summary, plain["tokenized"] = _check_packed(spec, tok)
    echo(f"data: {len(spec.files)} file(s), {summary}; tokenizer {spec.tokenizer} ({len(tok)} tokens)")
    return plain


def _no_text(spec: HFDataSpec) -> DataError:
    return DataError(f"data.files holds no text: the {len(spec.files)} file(s) ({', '.join(spec.files[:3])}) "
                     f"have no non-empty documents in data.text_field={spec.text_field!r}; check the files "
                     "and data.text_field")


def _check_packed(spec: HFDataSpec, tok: Any) -> tuple[str, list[str]]:
    """Tokenize (or find in the cache) and check every shard; a summary and the cache's files."""
    tokenized, cached = tokenize_corpus(spec.documents(streaming=False), tok)
    table = TokenTable(tokenized.data)
    if not len(table):
        raise _no_text(spec)
    split = split_corpus(table, Holdout(spec.eval_fraction), spec.shards, spec.seq_len)
    held = split.held_length(table)
    _check_counts(spec, len(table), [split.shard_length(table, k) for k in range(spec.shards)], held)
    tokens = table.stream_length(np.arange(len(table)))
    how = (f"held out by tokens: {held:,} (the last {spec.eval_fraction:g} of each shard's tokens; too few "
           f"documents to hold out whole ones)" if split.by_tokens
           else f"held out: {int(np.sum(split.owner == -1)):,} documents, {held:,} tokens")
    text = (f"{len(table):,} documents, {tokens:,} tokens, {how} "
            f"({'from the tokenized cache' if cached else 'tokenized now, cached for the next run'})")
    return text, [f["filename"] for f in tokenized.cache_files]


def _check_counts(spec: HFDataSpec, docs: int, shard_tokens: list[int], held_tokens: int) -> None:
    need = spec.seq_len + 1
    if held_tokens < need:  # split_corpus held out at least a block where the corpus has one to spare
        raise DataError(f"data.eval_fraction={spec.eval_fraction} holds out {held_tokens} of the {docs} documents' "
                        f"tokens, fewer than one block of model.seq_len + 1 = {need}; add text or lower "
                        "model.seq_len")
    short = [k for k, n in enumerate(shard_tokens) if blocks_in(n, spec.seq_len) == 0]
    if short:
        raise DataError(f"data shard {short[0]} of data.shards={spec.shards} has {shard_tokens[short[0]]} tokens, "
                        f"fewer than model.seq_len + 1 = {need}; add text, lower model.seq_len, or use fewer "
                        "data.shards (with text files, data.sample_by=line gives more documents)")


def _check_streamed(spec: HFDataSpec, tok: Any) -> str:
    """Streaming: read only the head, until every shard and the held-out set have a document."""
    holdout, found, held, docs = Holdout(spec.eval_fraction), set(), 0, 0
    for i, _ in enumerate(iter_texts(spec.documents(streaming=True))):
        docs += 1
        if holdout.is_eval(i):
            held += 1
        else:
            found.add(holdout.train_index(i) % spec.shards)
        if held and len(found) == spec.shards:
            return f"streamed (shards {spec.shards}, checked the first {docs} documents)"
    if not docs:
        raise _no_text(spec)
    if not held:
        raise DataError(f"data.eval_fraction={spec.eval_fraction} holds out none of the {docs} documents; "
                        "raise data.eval_fraction, add documents, or use data.streaming=false (a corpus "
                        "this small is then held out by tokens)")
    raise DataError(f"the {docs} documents do not give each of data.shards={spec.shards} shards a document; "
                    "use fewer data.shards or add documents")

