"""`python -m experiments.train data=hf` end to end, offline: a local Hugging Face model whose
directory holds a BPE tokenizer built here, trained on JSON-lines, text and parquet files over
2 stages x 2 replicas. An interrupted streaming run, resumed, matches the uninterrupted
in-memory run's losses exactly, and its checkpoint's data position rebuilds the same batches."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.hfdata import HFTextData, spec_of
from experiments.tracking import read_metrics

from hf_data import save_tokenizer, write_corpus
from _hf_tiny import save_tiny
from test_resume import ROOT, _env

QUIET = ["logger.mode=disabled", "logger.progress=false", "logger.timeline=false", "partitioner.method=uniform",
         "checkpoint.every_steps=2"]


def train(run_dir: Path, *overrides: str, timeout: float = 180) -> str:
    proc = subprocess.run([sys.executable, "-m", "experiments.train", *QUIET, *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("train_hf")
    model = root / "model"
    save_tiny("llama", model, layers=2, dim=32, heads=2, kv_heads=1, intermediate=64)
    save_tokenizer(model)  # the model's own tokenizer, found through model.pretrained
    files = write_corpus(root / "corpus")
    overrides = ["model=hf", f"model.pretrained={model}", "model.seq_len=16", "data=hf",
                 f"data.files={json.dumps(files)}", "data.text_field=body", "data.eval_fraction=0.1",
                 f"data.cache_dir={root / 'cache'}", "pipeline.stages=2", "pipeline.data_parallel=2",
                 "pipeline.microbatches=2", "train.batch_size=8", "train.eval_every=0", "train.eval_batches=1",
                 "train.log_every=1", "partitioner.repeats=1", "partitioner.sweeps=1", "partitioner.warmup=1", "optimizer.decay_steps=null"]
    return {"root": root, "overrides": overrides}


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def meta(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json").read_text())["meta"]


@pytest.mark.slow
def test_train_resume_and_streaming_with_hf_data(setup):
    root, over = setup["root"], setup["overrides"]
    memory, streamed = root / "memory", root / "streamed"
    out = train(memory, *over, "train.steps=4")
    assert "data: 5 file(s), 128 documents" in out and "tokenized now" in out
    rows = read_metrics(memory)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["data_time_s"] >= 0 for r in rows)
    assert math.isfinite(rows[-1]["eval_loss"])
    assert meta(memory, 4)["data"] == {"shards": 2, "streaming": False, "streams": {}}

    out = train(streamed, *over, "data.streaming=true", "train.steps=2")  # interrupted after 2 steps
    assert "streamed" in out
    out = train(streamed, *over, "data.streaming=true", "train.steps=4")
    assert "resuming from" in out and "step_000002" in out
    # streaming reads the same batches as in memory, and the resumed run continues them exactly
    want, got = losses(memory), losses(streamed)
    assert [got[s] for s in range(1, 5)] == [want[s] for s in range(1, 5)]
    saved = meta(streamed, 4)["data"]
    assert saved["streaming"] and sorted(saved["streams"]) == ["0", "1"]  # both replicas' shards

    # the position in the step-2 checkpoint rebuilds the uninterrupted reader's batches bit for bit
    from experiments.config import compose_config
    from experiments.hfdata import prepare

    cfg = compose_config(*over, "data.streaming=true")
    data_cfg = prepare(cfg, echo=lambda _: None)
    for r in range(2):
        whole = HFTextData(spec_of(cfg, data_cfg), replica=r)
        again = HFTextData(spec_of(cfg, data_cfg), replica=r)
        again.restore(2, meta(streamed, 2)["data"])
        try:
            for step in range(2):
                whole.train_batch(step, 8)
            rows_r = whole.layout.rows_of(r)
            for step in (2, 3):
                a, b = whole.train_batch(step, 8), again.train_batch(step, 8)
                assert torch.equal(a[0][rows_r], b[0][rows_r]) and torch.equal(a[1][rows_r], b[1][rows_r])
        finally:
            whole.close()
            again.close()
