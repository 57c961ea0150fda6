"""`data=hf`: train on your own files with your model's tokenizer.

Plain text, JSON lines and parquet files are read with `datasets.load_dataset` (local builders,
offline), tokenized with `transformers.AutoTokenizer` (the model's own, or `data.tokenizer`),
packed into `model.seq_len` blocks with EOS between documents, cached, held out in part for the
evaluation loss, sharded per data-parallel replica, optionally streamed, and resumable exactly.

Modules: `files` (which files, read as documents), `tokens` (tokenizer, tokenized cache),
`layout` (held-out rule, shards, batch rows), `packed` (in-memory packing), `stream` (packing
while reading, prefetch), `dataset` (`prepare` before launch, `HFTextData` in the workers).
Importing this package does not import `datasets` or `transformers` (they load on first use).

Example::

    data_cfg = prepare(cfg)                                # before launch: checks, tokenizes
    data = HFTextData(spec_of(cfg, data_cfg), replica=0)   # in a worker
"""

from experiments.hfdata.dataset import HFDataSpec, HFTextData, merge_states, prepare, spec_of
from experiments.hfdata.layout import DataError, Holdout, ShardLayout

__all__ = ["HFDataSpec", "HFTextData", "DataError", "Holdout", "ShardLayout", "merge_states", "prepare",
           "spec_of"]
