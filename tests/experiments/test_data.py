"""Datasets: real stdlib text, deterministic (seed, step) batches, held-out split, synthetic streams."""

from __future__ import annotations

import sysconfig

import pytest
import torch

from experiments.data import SyntheticFeatures, SyntheticTokens, TextDataset, make_dataset, read_corpus

BUDGET = 300_000


@pytest.fixture(scope="module")
def text() -> TextDataset:
    return TextDataset(seq_len=32, seed=0, max_bytes=BUDGET)


def test_corpus_is_the_stdlib_source_in_a_fixed_order():
    corpus = read_corpus(max_bytes=BUDGET)
    assert len(corpus) == BUDGET
    assert corpus == read_corpus(max_bytes=BUDGET)
    assert b"def " in corpus and b"import " in corpus  # it is Python source
    assert sysconfig.get_paths()["stdlib"]


def test_text_batches_are_shifted_bytes(text):
    x, y = text.train_batch(step=3, batch_size=5)
    assert x.shape == y.shape == (5, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256 and int(x.min()) >= 0
    # each row is a contiguous window of the training text
    row = bytes(x[0].tolist()) + bytes([int(y[0, -1])])
    assert row in bytes(text.train_data.tolist())


def test_batches_are_a_pure_function_of_seed_and_step(text):
    again = TextDataset(seq_len=32, seed=0, max_bytes=BUDGET)
    for step in (0, 1, 17):
        assert torch.equal(text.train_batch(step, 4)[0], again.train_batch(step, 4)[0])
    # order of calls does not matter (a resumed run continues the same stream)
    later = again.train_batch(17, 4)[0]
    assert torch.equal(later, text.train_batch(17, 4)[0])
    assert not torch.equal(text.train_batch(0, 4)[0], text.train_batch(1, 4)[0])
    other_seed = TextDataset(seq_len=32, seed=1, max_bytes=BUDGET)
    assert not torch.equal(text.train_batch(0, 4)[0], other_seed.train_batch(0, 4)[0])


def test_held_out_split_is_disjoint_and_last(text):
    n_train, n_eval = len(text.train_data), len(text.eval_data)
    assert n_train + n_eval == BUDGET
    assert abs(n_eval / BUDGET - 0.05) < 0.001
    corpus = read_corpus(max_bytes=BUDGET)
    assert bytes(text.eval_data.tolist()) == corpus[n_train:]
    x, _ = text.eval_batch(0, 4)
    window = bytes(x[0].tolist())
    assert window in bytes(text.eval_data.tolist())
    assert torch.equal(x, text.eval_batch(0, 4)[0])


def test_custom_root_and_errors(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"b" * 100)
    (tmp_path / "a.txt").write_bytes(b"a" * 100)
    assert read_corpus(tmp_path, suffix=".txt") == b"a" * 100 + b"b" * 100
    with pytest.raises(ValueError, match="seq_len"):
        TextDataset(seq_len=64, root=str(tmp_path), suffix=".txt", holdout_fraction=0.05)
    with pytest.raises(FileNotFoundError, match="data.root"):
        read_corpus(tmp_path / "missing")


def test_synthetic_tokens_and_features():
    tokens = SyntheticTokens(seq_len=8, vocab=50, seed=0)
    x, y = tokens.train_batch(2, 3)
    assert x.shape == (3, 8) and int(x.max()) < 50 and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, SyntheticTokens(seq_len=8, vocab=50, seed=0).train_batch(2, 3)[0])
    assert not torch.equal(x, tokens.eval_batch(2, 3)[0])

    feats = SyntheticFeatures(in_dim=6, classes=4, seed=0)
    f, labels = feats.train_batch(0, 256)
    assert f.shape == (256, 6) and f.dtype == torch.float32 and labels.shape == (256,)
    assert len(labels.unique()) > 1
    # labels come from a fixed teacher, so they are a function of the features (learnable)
    assert torch.equal(labels, (f @ feats.teacher).argmax(1))
    f2, _ = feats.eval_batch(0, 256)
    assert not torch.equal(f, f2)


def test_make_dataset_from_composed_configs(compose_cfg):
    text_cfg = compose_cfg("data.max_bytes=100000", "model.seq_len=24")
    synth_cfg = compose_cfg("data=synthetic", "model.vocab=1000")
    mlp_cfg = compose_cfg("model=mlp", "data=synthetic")
    assert isinstance(make_dataset(text_cfg), TextDataset)
    assert make_dataset(text_cfg).train_batch(0, 2)[0].shape == (2, 24)
    assert isinstance(make_dataset(synth_cfg), SyntheticTokens)
    assert int(make_dataset(synth_cfg).train_batch(0, 64)[0].max()) >= 256  # uses the model's vocab
    x, y = make_dataset(mlp_cfg).train_batch(0, 2)
    assert x.shape == (2, mlp_cfg.model.in_dim) and y.shape == (2,)
