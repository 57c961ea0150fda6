"""Local corpora and a tiny BPE tokenizer for the data=hf tests (nothing downloaded).

Example::

    tok_dir = save_tokenizer(tmp_path / "tok")
    files = write_corpus(tmp_path / "corpus")     # JSON lines, plain text and parquet files
"""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the a pipeline stage splits layers across ranks while every replica reads its own shard of "
         "documents and the tokenizer packs them into blocks with an end token between texts").split()


def sentences(seed: int, n: int, lo: int = 3, hi: int = 40) -> list[str]:
    """`n` random sentences of `lo..hi` words (deterministic in `seed`)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def save_tokenizer(path: Path, vocab: int = 120, corpus: list[str] | None = None) -> str:
    """A byte-pair-encoding tokenizer trained on local text, saved with `save_pretrained`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>", "<unk>"])
    tok.train_from_iterator(corpus or sentences(99, 400), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(path)
    return str(path)


def write_corpus(root: Path, *, parquet: bool = True) -> list[str]:
    """Two JSON-lines files (field `body`), two text files (one document per line, some blank)
    and a parquet file (field `body`), in that order."""
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for f in range(2):
        path = root / f"part{f}.jsonl"
        path.write_text("".join(json.dumps({"body": s, "id": i}) + "\n" for i, s in enumerate(sentences(f, 30))))
        files.append(path)
    for f in range(2):
        path = root / f"notes{f}.txt"
        lines = sentences(10 + f, 25)
        lines[3] = ""  # blank lines are not documents
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = root / "extra.parquet"
        pq.write_table(pa.table({"body": sentences(20, 20), "id": list(range(20))}), path)
        files.append(path)
    return [str(p) for p in files]
