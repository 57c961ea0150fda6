"""Generation on real Hugging Face models through 2 pipeline ranks, against transformers'
`generate()`: several lanes of left-padded prompts of different lengths, a lane refilled as its
prompts finish, an eos that stops some prompts early; and `python -m experiments.generate` with
text prompts through the model's tokenizer (a text file, one prompt per line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dist_helpers import run_workers

from _hf_tiny import prompts, reference, save_tiny
from hf_data import save_tokenizer
from test_resume import ROOT, _env

LENGTHS = (5, 9, 3, 7, 9, 6, 2, 11, 4, 8)
NEW = 12


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("genlanes")
    return {arch: save_tiny(arch, root / arch) for arch in ("llama", "qwen2")}


def hf_tokens(model, batch: list, new: int, eos: int | None, pad: int = 0) -> list[list[int]]:
    """transformers' greedy `generate()` on the left-padded batch, each row cut after its eos."""
    from engine.generate import left_pad, trim_at_eos

    ids, mask = left_pad(batch, pad)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=True,
                             eos_token_id=eos, pad_token_id=pad)
    return [trim_at_eos(t, eos) for t in out[:, ids.shape[1]:].tolist()]


def _worker(paths: dict, eos: dict) -> dict:
    from engine.generate import Generator
    from experiments.models import build_model
    from partitioner.solve import uniform_split

    torch.set_num_threads(1)
    batch, out = prompts(lengths=LENGTHS), {}
    for arch, path in paths.items():
        spec = build_model({"name": "hf", "pretrained": path, "seq_len": 64})
        gen = Generator(spec.layers, uniform_split(len(spec.layers), 2), chunk=spec.cached_chunk, ties=spec.ties)
        lanes = gen.generate(batch, NEW, microbatches=3)
        refill = gen.generate(batch, NEW, microbatches=2, microbatch_size=3, eos_token_id=eos[arch])
        out[arch] = {"lanes": lanes.tokens, "m": lanes.microbatches, "refill": refill.tokens,
                     "new": refill.new_tokens, "steps": refill.stats["lane_steps"]}
    return out


def test_lanes_refill_and_eos_equal_hf_generate(dirs):
    batch = prompts(lengths=LENGTHS)
    models = {arch: reference(path) for arch, path in dirs.items()}
    plain = {arch: hf_tokens(m, batch, NEW, None) for arch, m in models.items()}
    eos = {arch: toks[0][3] for arch, toks in plain.items()}  # prompt 0 stops at its 4th token
    results = run_workers(_worker, 2, dirs, eos)
    for arch, model in models.items():
        assert results[0][arch] == results[1][arch]  # every rank gets the result
        got = results[0][arch]
        assert got["m"] == 3 and got["lanes"] == plain[arch], arch
        want = hf_tokens(model, batch, NEW, eos[arch])
        assert any(len(t) < NEW for t in want) and got["refill"] == want, arch
        assert got["new"] == sum(map(len, want))
        # 10 prompts in lanes of 3: 4 prefills, the rest decode steps of prompts still running
        assert got["steps"] < len(batch) * NEW


def _module(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_generate_cli_with_text_prompts(tmp_path):
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    save_tiny("llama", model_dir, layers=4)
    save_tokenizer(model_dir)
    texts = ["the cat sat on", "a dog", "seven small birds flew over the long river", "why", "one two three"]
    (tmp_path / "prompts.txt").write_text("\n".join(texts) + "\n\n")
    run_dir = tmp_path / "gen"
    _module("experiments.generate", "model=hf", f"model.pretrained={model_dir}", "pipeline.stages=2",
            f"generate.prompts={tmp_path / 'prompts.txt'}", "generate.max_new_tokens=6", "generate.microbatches=2",
            "generate.microbatch_size=2", f"hydra.run.dir={run_dir}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(texts)["input_ids"]
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert [r["prompt_text"] for r in rows] == texts and [r["prompt"] for r in rows] == ids
    model = reference(str(model_dir))
    eos = model.generation_config.eos_token_id
    assert [r["tokens"] for r in rows] == hf_tokens(model, ids, 6, eos, pad=eos)
    assert [r["text"] for r in rows] == [tok.decode(r["tokens"], skip_special_tokens=True) for r in rows]
    report = json.loads((run_dir / "generation.json").read_text())
    assert report["tokens_match"] is True and report["microbatches"] == 2


def test_text_prompts_need_a_tokenizer(tmp_path):
    from experiments.config import ConfigError, compose_config, as_config
    from experiments.generate import encode_prompts, read_prompts

    (tmp_path / "p.txt").write_text("hello there\n\nworld\n")
    assert read_prompts(str(tmp_path / "p.txt")) == ["hello there", "world"]
    assert read_prompts(["a b", "c"]) == ["a b", "c"]
    with pytest.raises(ConfigError, match="empty string"):
        read_prompts(["a", " "])
    cfg = as_config(compose_config("model=hf"))
    with pytest.raises(ConfigError, match="model.pretrained"):
        encode_prompts(cfg, ["hello"])
    model_dir = save_tiny("llama", tmp_path / "m", layers=1)
    cfg = as_config(compose_config("model=hf", f"model.pretrained={model_dir}"))
    with pytest.raises(ConfigError, match="tokenizer"):
        encode_prompts(cfg, ["hello"])
