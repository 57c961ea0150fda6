"""Hugging Face models through the multi-process pipeline (issue 13), against transformers.

- Llama (untied), Qwen2 and GPT-2 (tied across the first and last stage), loaded from
  save_pretrained directories, each rank loading its own layers: the pipelined forward equals
  the HF model's logits (fp32, 1e-5) and 3 SGD steps give the losses and parameters of the HF
  model trained in a plain loop; the tied copies stay equal.
- Greedy generation through 2 and 3 stages returns exactly `model.generate(do_sample=False)`'s
  tokens (prompts of different lengths); sampled tokens equal a one-stage run's.
- While loading, each rank's peak memory (torch's MemTracker) is its own share of the weights,
  not the whole model.
- Round trip: `experiments.train` fine-tunes a pretrained directory on 2 stages and checkpoints,
  `python -m experiments.export_hf` writes a sharded HF directory, and transformers' model from
  it has the pipeline's eval loss; `python -m experiments.generate` writes generations.jsonl
  equal to `model.generate` and the throughput report.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _hf_tiny import VOCAB, hf_generate, prompts, reference, save_tiny
from dist_helpers import run_workers

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("llama", "qwen2", "gpt2")
LR, STEPS, SEQ = 0.2, 3, 12
_CAPTURED: list[torch.Tensor] = []


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfpipe")
    return {arch: save_tiny(arch, root / arch, max_shard_size="60KB" if arch == "llama" else "5GB")
            for arch in ARCHS}


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (8, SEQ + 1), generator=gen) for _ in range(STEPS + 1)]


def _capture_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from experiments.models.gpt import lm_loss

    _CAPTURED.append(logits.detach().clone())
    return lm_loss(logits, target)


def _parity_worker(paths: dict) -> dict:
    import torch.distributed as dist

    from engine import OptimizerConfig, Pipeline
    from experiments.models import build_model

    torch.set_num_threads(1)
    out = {}
    for arch, path in paths.items():
        spec = build_model({"name": "hf", "pretrained": path, "seq_len": SEQ})
        n = len(spec.layers)
        pipe = Pipeline(spec.layers, [(0, 2), (2, n)], loss_fn=_capture_loss, schedule="1f1b", microbatches=2,
                        optimizer=OptimizerConfig(name="sgd", lr=LR), ties=spec.ties)
        first, *train = _batches()
        _CAPTURED.clear()
        eval_loss = pipe.eval_step(first[:, :-1], first[:, 1:])
        logits = torch.cat(_CAPTURED) if _CAPTURED else None
        losses = [pipe.train_step(b[:, :-1], b[:, 1:]).loss for b in train]
        params = {i: {k: v.detach().clone() for k, v in m.state_dict().items()} for i, m in
                  ((int(k), m) for k, m in pipe.layer_module.items())}
        out[arch] = {"rank": dist.get_rank(), "logits": logits, "eval": eval_loss, "losses": losses,
                     "params": params}
    return out


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A model whose layers are large enough to tell one rank's share from the whole model."""
    return save_tiny("llama", tmp_path_factory.mktemp("big") / "llama", layers=4, dim=256, heads=4, kv_heads=4,
                     intermediate=1024, tie=False, max_shard_size="2MB")


def _two_rank_worker(paths: dict, big_path: str) -> dict:
    memory = _memory_worker(big_path)   # first: nothing else allocated yet
    return {"memory": memory, "parity": _parity_worker(paths), "generate": _generate_worker(paths, 2, None)}


@pytest.fixture(scope="module")
def two_ranks(dirs, big):
    """One 2-rank job for the loading-memory, parity and 2-stage generation checks (spawning
    ranks costs more than the checks)."""
    return run_workers(_two_rank_worker, 2, dirs, big)


def test_pipelined_forward_and_training_equal_the_hf_model(dirs, two_ranks):
    from experiments.models.hf import discover_layout, layer_prefixes

    results = [r["parity"] for r in two_ranks]
    for arch in ARCHS:
        model = reference(dirs[arch]).train()
        first, *train = _batches()
        with torch.no_grad():
            ref_logits = model(first[:, :-1]).logits
        torch.testing.assert_close(results[1][arch]["logits"], ref_logits, rtol=1e-5, atol=1e-5)
        assert results[0][arch]["eval"] == pytest.approx(results[1][arch]["eval"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        ref_losses = []
        for b in train:
            opt.zero_grad()
            loss = model(b, labels=b).loss   # transformers shifts the labels itself
            loss.backward()
            opt.step()
            ref_losses.append(loss.item())
        for r in results:
            assert r[arch]["losses"] == pytest.approx(ref_losses, rel=1e-5), arch
        lay = discover_layout(model)
        ref_params = model.state_dict()
        for r in results:
            for i, params in r[arch]["params"].items():
                for k, v in params.items():
                    name = f"{layer_prefixes(lay, i)[k.partition('.')[0]]}.{k.partition('.')[2]}"
                    torch.testing.assert_close(v, ref_params[name], rtol=1e-5, atol=1e-6, msg=f"{arch} {name}")
        if model.config.tie_word_embeddings:  # the head (last rank) trained into the embedding's value
            last = max(results[1][arch]["params"])
            torch.testing.assert_close(results[1][arch]["params"][last]["lm_head.weight"],
                                       results[0][arch]["params"][0]["wte.weight"], rtol=0, atol=0)


def _generate_worker(paths: dict, stages: int, microbatches: int) -> dict:
    from engine.generate import Generator, SamplingConfig
    from experiments.models import build_model
    from partitioner.solve import uniform_split

    torch.set_num_threads(1)
    out = {}
    for arch, path in paths.items():
        spec = build_model({"name": "hf", "pretrained": path, "seq_len": SEQ})
        gen = Generator(spec.layers, uniform_split(len(spec.layers), stages), chunk=spec.cached_chunk,
                        ties=spec.ties)
        greedy = gen.generate(prompts(), 10, microbatches=microbatches)
        sampled = gen.generate(prompts(), 6, microbatches=microbatches,
                               sampling=SamplingConfig(do_sample=True, temperature=0.9, top_k=30, top_p=0.9, seed=2))
        out[arch] = {"greedy": greedy.tokens, "sampled": sampled.tokens, "m": greedy.microbatches}
    return out


@pytest.mark.parametrize("stages,microbatches", [(2, None), (3, 4)])
def test_pipelined_greedy_generation_equals_hf_generate(dirs, two_ranks, stages, microbatches):
    from engine.generate import Generator, SamplingConfig
    from experiments.models import build_model

    if stages == 2:
        results = [r["generate"] for r in two_ranks]
    else:
        results = run_workers(_generate_worker, stages, dirs, stages, microbatches)
    for arch in ARCHS:
        assert all(r[arch] == results[0][arch] for r in results)  # every rank gets the result
        got = results[0][arch]
        assert got["m"] == (microbatches or stages)
        assert got["greedy"] == hf_generate(reference(dirs[arch]), prompts(), 10), arch
        spec = build_model({"name": "hf", "pretrained": dirs[arch], "seq_len": SEQ})
        one = Generator(spec.layers, [(0, len(spec.layers))], chunk=spec.cached_chunk, ties=spec.ties)
        s = SamplingConfig(do_sample=True, temperature=0.9, top_k=30, top_p=0.9, seed=2)
        assert got["sampled"] == one.generate(prompts(), 6, sampling=s).tokens


def _memory_worker(path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from experiments.models import build_model

    torch.set_num_threads(1)
    spec = build_model({"name": "hf", "pretrained": path, "seq_len": SEQ})  # reads config.json only
    n = len(spec.layers)
    start, stop = [(0, 3), (3, n)][dist.get_rank()]
    tracker = MemTracker()
    with tracker:
        layers = [spec.layers[i]() for i in range(start, stop)]
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    own = sum(t.numel() * t.element_size() for m in layers for t in [*m.parameters(), *m.buffers()])
    del layers
    control = MemTracker()  # the same tracker sees a whole-model load as such
    with control:
        everything = [f() for f in spec.layers]
    del everything
    return {"peak": peak, "own": own, "control": control.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]}


def test_each_rank_holds_only_its_share_while_loading(big, two_ranks):
    assert len(list(Path(big).glob("*.safetensors"))) > 4
    whole = sum(p.numel() * 4 for p in reference(big).parameters())
    results = [r["memory"] for r in two_ranks]
    assert sum(r["own"] for r in results) == pytest.approx(whole, rel=0.01)   # + rotary buffers
    for r in results:
        assert r["own"] < 0.55 * whole                   # each rank: about half the model
        assert r["own"] <= r["peak"] <= 1.1 * r["own"]   # its peak while loading: its own share
        assert r["control"] >= 0.99 * whole              # loading every layer would show as the whole


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _module(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_fine_tune_export_round_trip(dirs, tmp_path):
    from experiments.config import compose_config, to_plain_dict
    from experiments.data import make_dataset
    from experiments.models import build_model, compose
    from experiments.models.gpt import lm_loss
    from experiments.train import run

    run_dir = tmp_path / "run"
    cfg = compose_config("model=hf", f"model.pretrained={dirs['qwen2']}", "experiment=smoke",
                         "model.seq_len=16", "partitioner.method=uniform", "optimizer=sgd", "optimizer.lr=0.5",
                         "train.steps=3", "checkpoint.every_steps=3", "train.eval_batches=2", "logger.progress=false",
                         "logger.timeline=false")
    run(cfg, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    eval_loss = records[-1]["eval_loss"]
    out = tmp_path / "exported"
    _module("experiments.export_hf", f"checkpoint={run_dir}", f"out={out}", "max_shard_size=60KB")
    assert (out / "model.safetensors.index.json").is_file() and (out / "pipeshard_export.json").is_file()
    model = reference(str(out))
    assert model.config.tie_word_embeddings
    ds = make_dataset(to_plain_dict(cfg))
    with torch.no_grad():
        losses = [lm_loss(model(x).logits, y).item() for x, y in (ds.eval_batch(i, 4) for i in range(2))]
    assert sum(losses) / 2 == pytest.approx(eval_loss, rel=1e-5)
    assert abs(eval_loss - records[0]["loss"]) > 1e-3   # the weights did change
    back = compose(build_model({"name": "hf", "pretrained": str(out), "seq_len": 16}).layers).eval()
    x = ds.eval_batch(0, 4)[0]
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x).logits, rtol=1e-5, atol=1e-5)


def test_generate_cli_writes_generations_and_throughput(dirs, tmp_path):
    batch = prompts()
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in batch))
    run_dir = tmp_path / "gen"
    stdout = _module("experiments.generate", "model=hf", f"model.pretrained={dirs['gpt2']}", "pipeline.stages=2",
                     f"generate.prompts={tmp_path / 'prompts.jsonl'}", "generate.max_new_tokens=8",
                     "generate.eos_token_id=-1", f"hydra.run.dir={run_dir}")
    assert "tokens/s" in stdout and "ratio" in stdout
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == batch
    assert [r["tokens"] for r in rows] == hf_generate(reference(dirs["gpt2"]), batch, 8)
    report = json.loads((run_dir / "generation.json").read_text())
    assert report["tokens_match"] is True and report["stages"] == 2 and report["microbatches"] == 2
    assert report["ratio"] == pytest.approx(report["pipelined_tokens_per_s"] / report["single_tokens_per_s"])
    assert report["pipelined_new_tokens"] == report["single_new_tokens"] == len(batch) * 8
