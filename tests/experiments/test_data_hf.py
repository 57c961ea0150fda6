"""data=hf on its own (in process, offline): local files read with `datasets`, a BPE tokenizer built
here with `tokenizers`, packing with EOS between documents, the tokenized cache, held-out
documents, shards per replica, streaming == in memory, exact resume, and bad data refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.config import compose_config, validate_config
from experiments.hfdata import DataError, HFDataSpec, HFTextData, Holdout, prepare
from experiments.hfdata import tokens as tokens_mod
from experiments.hfdata.layout import ShardLayout

from hf_data import save_tokenizer, sentences, write_corpus

SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hfdata")
    return {"tok": save_tokenizer(root / "tok"), "files": write_corpus(root / "corpus"), "cache": str(root / "cache"),
            "root": root}


def spec(corpus: dict, **kw) -> HFDataSpec:
    base = dict(files=tuple(corpus["files"]), tokenizer=corpus["tok"], text_field="body", eval_fraction=0.1,
                seq_len=SEQ, batch_size=8, replicas=1, shards=1, cache_dir=corpus["cache"])
    return HFDataSpec(**{**base, **kw})


def documents_by_hand(files: list[str]) -> list[str]:
    """The non-empty documents in file order, read without `datasets`."""
    import pyarrow.parquet as pq

    docs: list[str] = []
    for f in files:
        if f.endswith(".jsonl"):
            docs += [json.loads(line)["body"] for line in Path(f).read_text().splitlines()]
        elif f.endswith(".txt"):
            docs += Path(f).read_text().split("\n")
        else:
            docs += pq.read_table(f).column("body").to_pylist()
    return [d for d in docs if d.strip()]


def rows_of(data: HFTextData, step: int) -> torch.Tensor:
    """This replica's rows of the step, as full blocks (inputs + last target)."""
    x, y = data.train_batch(step, data.spec.batch_size)
    sl = data.layout.rows_of(data.replica)
    return torch.cat([x[sl], y[sl, -1:]], dim=1)


def test_the_tokenizer_is_a_local_bpe_loaded_by_autotokenizer(corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(corpus["tok"], local_files_only=True)
    assert len(tok) <= 120 and tok.eos_token == "<eos>"
    assert (Path(corpus["tok"]) / "tokenizer.json").is_file()
    ids = tok("the pipeline stage", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "the pipeline stage"


def test_blocks_are_the_training_documents_packed_with_eos_in_file_order(corpus):
    data = HFTextData(spec(corpus))
    docs = documents_by_hand(corpus["files"])
    assert len(docs) == 30 + 30 + 24 + 24 + 20  # blank lines are not documents
    tok, hold = data.tok, Holdout(0.1)
    train = [d for i, d in enumerate(docs) if not hold.is_eval(i)]
    held = [d for i, d in enumerate(docs) if hold.is_eval(i)]
    assert len(held) == len(docs) // 10
    want = np.concatenate([tok(d, add_special_tokens=False)["input_ids"] + [data.eos] for d in train])
    shard = data._packed[0]
    assert np.array_equal(shard.tokens, want)
    n = shard.num_blocks
    assert n == (len(want) - 1) // SEQ
    # consecutive batches walk the stream block by block (8 rows a step), then wrap to the start
    blocks = torch.cat([rows_of(data, s) for s in range(n // 8 + 2)])
    for j in range(n):
        assert np.array_equal(blocks[j].numpy(), want[j * SEQ: j * SEQ + SEQ + 1])
    assert torch.equal(blocks[n], blocks[0])
    x, y = data.train_batch(0, 8)
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < len(tok)
    # the held-out batches come from the held-out documents only
    held_stream = np.concatenate([tok(d, add_special_tokens=False)["input_ids"] + [data.eos] for d in held])
    ex, ey = data.eval_batch(0, 8)
    assert np.array_equal(ex[0].numpy(), held_stream[:SEQ]) and torch.equal(ex[:, 1:], ey[:, :-1])


def test_a_second_run_reads_the_tokenized_cache(corpus, monkeypatch, tmp_path):
    cfg = compose_config("data=hf", f"data.files={json.dumps(corpus['files'])}", f"data.tokenizer={corpus['tok']}",
                         "data.text_field=body", f"data.cache_dir={tmp_path / 'cache'}", "data.eval_fraction=0.1",
                         f"model.seq_len={SEQ}", "train.batch_size=8")
    calls = []
    real = tokens_mod.encode
    monkeypatch.setattr(tokens_mod, "encode", lambda tok, texts: calls.append(len(texts)) or real(tok, texts))
    lines: list[str] = []
    first = prepare(cfg, echo=lines.append)
    assert sum(calls) == 130 and "tokenized now" in lines[-1]  # every row (2 blank lines)
    calls.clear()
    second = prepare(cfg, echo=lines.append)
    assert calls == [] and "from the tokenized cache" in lines[-1]
    assert first["tokenized"] == second["tokenized"] and Path(first["tokenized"][0]).is_file()
    # a worker reads the cached ids without tokenizing either
    data = HFTextData(HFDataSpec(**{**spec(corpus).__dict__, "tokenized": tuple(second["tokenized"]),
                                    "cache_dir": str(tmp_path / "cache")}))
    assert calls == [] and torch.equal(rows_of(data, 3), rows_of(HFTextData(spec(corpus)), 3))
    # an edited file is tokenized again
    with open(corpus["files"][0], "a") as fh:
        fh.write(json.dumps({"body": "a new document", "id": 99}) + "\n")
    try:
        prepare(cfg, echo=lines.append)
        assert sum(calls) == 131 and "tokenized now" in lines[-1]
    finally:
        text = Path(corpus["files"][0]).read_text().splitlines()
        Path(corpus["files"][0]).write_text("\n".join(text[:-1]) + "\n")


@pytest.mark.parametrize("shards,replicas", [(1, 1), (2, 2), (4, 2)])
def test_streaming_gives_the_same_batches_as_in_memory(corpus, shards, replicas):
    steps = 50  # more than two epochs of every shard at this size
    for r in range(replicas):
        packed = HFTextData(spec(corpus, shards=shards, replicas=replicas), replica=r)
        streamed = HFTextData(spec(corpus, shards=shards, replicas=replicas, streaming=True), replica=r)
        try:
            assert min(s.num_blocks for s in packed._packed.values()) * 2 < steps * 8 // shards
            for step in range(steps):
                assert torch.equal(rows_of(packed, step), rows_of(streamed, step)), (r, step)
            for i in range(3):
                assert torch.equal(packed.eval_batch(i, 8)[0], streamed.eval_batch(i, 8)[0])
        finally:
            streamed.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["in-memory", "streaming"])
def test_a_resumed_reader_continues_with_bit_identical_batches(corpus, streaming):
    kw = dict(shards=2, replicas=2, streaming=streaming)
    for r in range(2):
        whole = HFTextData(spec(corpus, **kw), replica=r)
        before = [rows_of(whole, s) for s in range(7)]
        state = json.loads(json.dumps(whole.state()))  # what a checkpoint stores
        after = [rows_of(whole, s) for s in range(7, 25)]
        for saved in (state, None):  # from the saved position, and by reading up to step 7
            resumed = HFTextData(spec(corpus, **kw), replica=r)
            resumed.restore(7, saved)
            try:
                assert all(torch.equal(rows_of(resumed, 7 + i), a) for i, a in enumerate(after))
            finally:
                resumed.close()
        whole.close()
        assert not torch.equal(before[0], after[0])
    if streaming:  # the stored position is what the reader continues from (not a re-read)
        assert set(state["streams"]) == {"1"} and set(state["streams"]["1"]) == {"epoch", "doc", "offset"}
        state["streams"]["1"]["offset"] += 1
        shifted = HFTextData(spec(corpus, **kw), replica=1)
        shifted.restore(7, state)
        try:
            got = rows_of(shifted, 7)
            assert torch.equal(got[0, :-1], after[0][0, 1:]) and not torch.equal(got, after[0])
        finally:
            shifted.close()


def test_two_replicas_never_see_the_same_sample_in_a_step(corpus):
    reps = [HFTextData(spec(corpus, shards=2, replicas=2), replica=r) for r in range(2)]
    single = HFTextData(spec(corpus, shards=2, replicas=1))
    held = set(np.flatnonzero(reps[0]._eval_packed.tokens == reps[0].eos))
    for step in range(40):
        a, b = (rows_of(d, step) for d in reps)
        assert not {tuple(row.tolist()) for row in a} & {tuple(row.tolist()) for row in b}, step
        # the replicas' rows are exactly the single-replica batch (the layout does not change the data)
        assert torch.equal(torch.cat([a, b]), rows_of(single, step))
    # their documents are disjoint: no training document of one shard appears in the other's stream
    s0, s1 = reps[0]._packed[0].tokens, reps[1]._packed[1].tokens
    docs0 = {tuple(d) for d in np.split(s0, np.flatnonzero(s0 == reps[0].eos) + 1) if len(d)}
    docs1 = {tuple(d) for d in np.split(s1, np.flatnonzero(s1 == reps[1].eos) + 1) if len(d)}
    assert docs0 and docs1 and not docs0 & docs1 and held


def test_shuffle_permutes_each_epoch_and_keeps_every_block(corpus):
    plain = HFTextData(spec(corpus))
    mixed = HFTextData(spec(corpus, shuffle=True, seed=3))
    n = plain._packed[0].num_blocks
    order = [mixed._packed[0].block(j) for j in range(2 * n)]
    keyed = {tuple(b.tolist()) for b in order[:n]}
    assert keyed == {tuple(plain._packed[0].block(j).tolist()) for j in range(n)}
    assert [tuple(b) for b in order[:n]] != [tuple(plain._packed[0].block(j)) for j in range(n)]
    assert [tuple(b) for b in order[:n]] != [tuple(b) for b in order[n:]]  # a new order each epoch
    again = HFTextData(spec(corpus, shuffle=True, seed=3))
    assert torch.equal(rows_of(again, 5), rows_of(mixed, 5))


def test_layout_rules():
    h = Holdout(0.05)
    held = [i for i in range(100) if h.is_eval(i)]
    assert held == [19, 39, 59, 79, 99] and h.train_index(20) == 19
    mask, train = h.split(100)
    assert list(np.flatnonzero(mask)) == held and train[20] == 19
    lay = ShardLayout(shards=4, batch_size=8, replicas=2)
    assert lay.rows_per_shard == 2 and list(lay.shards_of(1)) == [2, 3] and lay.rows_of(1) == slice(4, 8)
    with pytest.raises(DataError, match="multiple of 2"):
        ShardLayout(shards=3, batch_size=6, replicas=2)
    with pytest.raises(DataError, match="dividing 6"):
        ShardLayout(shards=4, batch_size=6, replicas=2)


# ---------------------------------------------------------------------------------- bad data
def _cfg(corpus: dict, *over: str):
    return compose_config("data=hf", f"data.files={json.dumps(corpus['files'])}", f"data.tokenizer={corpus['tok']}",
                          "data.text_field=body", f"data.cache_dir={corpus['cache']}", "data.eval_fraction=0.1",
                          f"model.seq_len={SEQ}", "train.batch_size=8", *over)


def _refused(cfg, *fragments: str) -> str:
    validate_config(cfg)
    with pytest.raises(DataError) as err:
        prepare(cfg, echo=lambda _: None)
    for f in fragments:
        assert f in str(err.value), str(err.value)
    return str(err.value)


def test_bad_data_is_refused_before_launch_with_the_fix(corpus, tmp_path):
    _refused(_cfg(corpus, f"data.files={tmp_path / 'missing.jsonl'}"), "does not exist", "data.files=")
    _refused(_cfg(corpus, f"data.files={tmp_path / 'nothing*.jsonl'}"), "no file matches")
    (tmp_path / "table.csv").write_text("a,b\n")
    _refused(_cfg(corpus, f"data.files={tmp_path / 'table.csv'}"), "not a supported format", ".jsonl")
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    _refused(_cfg(corpus, f"data.files={tmp_path / 'blank.txt'}"), "holds no text")
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    _refused(_cfg(corpus, f"data.files={tmp_path / 'blank.txt'}", "data.streaming=true"), "holds no text")
    for streaming in ("false", "true"):
        _refused(_cfg(corpus, "data.text_field=content", f"data.streaming={streaming}"),
                 "data.text_field='content' is not a field", "'body'")
    _refused(_cfg(corpus, "model.seq_len=4000"), "fewer than one block", "model.seq_len")
    _refused(_cfg(corpus, "model.vocab=100"), "has 1", "100 rows", "model.vocab")
    big = save_tokenizer(tmp_path / "big", vocab=300, corpus=sentences(5, 400) + ["".join(chr(c) for c in range(65, 400))])
    _refused(_cfg(corpus, f"data.tokenizer={big}", "model.vocab=256"), "256 rows")
    _refused(_cfg(corpus, f"data.tokenizer={tmp_path}"), "cannot load a tokenizer")


def test_bad_settings_are_refused_by_validate_config(corpus):
    from experiments.config import ConfigError

    cases = {("data.files=null",): "needs data.files",
             ("data.tokenizer=null",): "needs a tokenizer",
             ("data.eval_fraction=0",): "data.eval_fraction=0",
             ("data.shards=3",): "data.shards=3",
             ("data.streaming=true", "data.shuffle=true"): "data.shuffle=true cannot"}
    for over, fragment in cases.items():
        with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
            validate_config(_cfg(corpus, *over))


def test_a_resume_keeps_the_checkpoints_shards_or_is_refused(corpus):
    quiet = {"echo": lambda _: None}
    two = _cfg(corpus, "pipeline.data_parallel=2")
    assert prepare(two, None, **quiet)["shards"] == 2  # unset: one shard per replica
    assert prepare(two, {"shards": 4}, **quiet)["shards"] == 4  # unset: the checkpoint's, 2 replicas divide it
    assert prepare(_cfg(corpus), {"shards": 2}, **quiet)["shards"] == 2
    with pytest.raises(DataError, match="data.shards=1 shards, this run in 2"):
        prepare(two, {"shards": 1}, **quiet)  # 2 replicas cannot split 1 shard
    with pytest.raises(DataError, match="set data.shards=4"):
        prepare(_cfg(corpus, "pipeline.data_parallel=2", "data.shards=2"), {"shards": 4}, **quiet)


def test_the_engine_and_partitioner_stay_light():
    code = ("import sys, partitioner, engine, experiments.hfdata, experiments.data; "
            "print(sorted(m for m in ('datasets', 'transformers', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


def test_a_few_long_documents_are_held_out_by_tokens(corpus, tmp_path):
    """15 documents of about 7 KB each (about 100 KB): the default data.eval_fraction=0.05 would
    hold out no whole document, so each shard's last 5% of tokens is held out instead; no
    held-out token trains, and everything else does."""
    docs = [" ".join(sentences(100 + d, 55)) for d in range(15)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    assert 90_000 < path.stat().st_size < 130_000
    cfg = compose_config("data=hf", f"data.files={path}", f"data.tokenizer={corpus['tok']}", "data.text_field=body",
                         f"data.cache_dir={corpus['cache']}", f"model.seq_len={SEQ}", "train.batch_size=8",
                         "pipeline.data_parallel=2")
    assert cfg.data.eval_fraction == 0.05  # the default
    said: list[str] = []
    prepared = prepare(cfg, echo=said.append)
    assert "held out by tokens" in said[0]
    tok = tokens_mod.load_tokenizer(corpus["tok"])
    eos = tok.eos_token_id
    ids = tokens_mod.encode(tok, docs)
    streams = [np.concatenate([np.append(ids[i], eos) for i in range(k, 15, 2)]) for k in range(2)]
    tails = [int(np.ceil(0.05 * len(s))) for s in streams]
    from experiments.hfdata.dataset import spec_of

    readers = [HFTextData(spec_of(cfg, prepared), replica=r) for r in range(2)]
    for r, data in enumerate(readers):
        shard = data._packed[r].tokens
        assert np.array_equal(shard, streams[r][:len(streams[r]) - tails[r]])
    held = np.concatenate([s[len(s) - t:] for s, t in zip(streams, tails)])
    assert np.array_equal(readers[0]._eval_packed.tokens, held)
    x, y = readers[0].eval_batch(0, 4)
    assert torch.equal(x[0], torch.from_numpy(held[:SEQ].astype(np.int64)))
