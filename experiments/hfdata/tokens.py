"""The tokenizer (`data.tokenizer`, else the model's own `model.pretrained` directory) and the
tokenized corpus, cached by `datasets` so a second run does not tokenize again.

Every document is encoded with `add_special_tokens=False`; the packers append the tokenizer's
EOS after each one. `tokenize_corpus` maps the documents to a column `input_ids` (and `keep`:
whether the document is non-empty) with `Dataset.map`, whose result `datasets` writes next to
its Arrow copy of the files under a fingerprint of (the files' contents as `datasets` sees
them, the tokenizer, the text field); the next run with the same inputs loads that file
instead of tokenizing.

Example::

    tok = load_tokenizer("path/to/tokenizer")
    ids, cached = tokenize_corpus(load_documents(files), tok)
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

from experiments.hfdata.layout import DataError

__all__ = ["tokenizer_dir", "load_tokenizer", "eos_id", "tokenizer_fingerprint", "encode",
           "tokenize_corpus", "read_tokenized", "check_vocab", "TOKENIZE_BATCH"]

TOKENIZE_BATCH = 256
"""Documents per tokenizer call (fast tokenizers encode a batch in parallel, in Rust)."""


def tokenizer_dir(tokenizer: str | None, pretrained: str | None) -> str:
    """`data.tokenizer`, else the model's `model.pretrained` directory; a DataError if neither."""
    path = tokenizer or pretrained
    if not path:
        raise DataError("data=hf needs a tokenizer: set data.tokenizer=<directory written by "
                        "tokenizer.save_pretrained>, or use model=hf model.pretrained=<model directory> "
                        "whose tokenizer files are used")
    return str(path)


def load_tokenizer(path: str) -> Any:
    """`AutoTokenizer.from_pretrained(path)` from local files only."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers explains what is missing
        raise DataError(f"cannot load a tokenizer from {path!r} ({type(exc).__name__}: {exc}); point "
                        "data.tokenizer at a directory written by tokenizer.save_pretrained "
                        "(tokenizer.json / tokenizer_config.json)") from None


def eos_id(tok: Any, where: str) -> int:
    """The id put between documents: the tokenizer's EOS token."""
    eos = tok.eos_token_id
    if eos is None:
        raise DataError(f"the tokenizer in {where} has no EOS token to put between documents; set one "
                        "(tokenizer.eos_token = '...' then save_pretrained) or use another tokenizer")
    return int(eos)


def tokenizer_fingerprint(tok: Any) -> str:
    """A hash of everything that decides the token ids (vocabulary, merges, normalisation, EOS)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:  # a slow (Python) tokenizer: datasets' hasher pickles it
        from datasets.fingerprint import Hasher

        text = Hasher.hash(tok)
    extra = f"{type(tok).__name__}|{tok.eos_token_id}|{len(tok)}"
    return hashlib.sha256((text + extra).encode()).hexdigest()[:16]


def encode(tok: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (no length limit, no warning)."""
    if not texts:
        return []
    return tok(list(texts), add_special_tokens=False, verbose=False)["input_ids"]


def _tokenize_rows(batch: dict, tok: Any) -> dict:
    texts = [t if t else "" for t in batch["text"]]
    keep = [bool(t.strip()) for t in texts]
    ids = encode(tok, [t if k else "" for t, k in zip(texts, keep)])
    return {"input_ids": ids, "keep": keep}


def tokenize_corpus(docs: Any, tok: Any) -> tuple[Any, bool]:
    """The documents' token ids (`input_ids`, `keep`), and whether they came from the cache."""
    key = hashlib.sha256(f"pipeshard-tokens/1|{docs._fingerprint}|{tokenizer_fingerprint(tok)}".encode())
    fingerprint = key.hexdigest()[:16]
    cached = False
    if docs.cache_files:
        path = docs._get_cache_file_path(fingerprint)
        cached = bool(path) and os.path.exists(path)
    out = docs.map(_tokenize_rows, fn_kwargs={"tok": tok}, batched=True, batch_size=TOKENIZE_BATCH,
                   remove_columns=docs.column_names, new_fingerprint=fingerprint,
                   desc="tokenizing (cached for the next run)")
    return out, cached


def read_tokenized(paths: Sequence[str]) -> Any:
    """The Arrow table of `tokenize_corpus`'s cache files, memory-mapped with pyarrow alone (a
    worker need not import `datasets`); None when a file is missing (then tokenize again)."""
    import pyarrow as pa

    if not paths or not all(os.path.isfile(p) for p in paths):
        return None
    tables = [pa.ipc.open_stream(pa.memory_map(str(p))).read_all() for p in paths]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def check_vocab(tok: Any, model_vocab: int | None, where: str, fix: str) -> None:
    """Refuse a tokenizer whose ids do not fit the model's embedding."""
    if model_vocab is not None and len(tok) > int(model_vocab):
        raise DataError(f"the tokenizer in {where} has {len(tok)} tokens but the model's embedding has "
                        f"{model_vocab} rows (token ids >= {model_vocab} would index past it); {fix}")
