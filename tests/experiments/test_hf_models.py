"""Hugging Face models in and out, single process (issue 13): every family's pipeline layers,
loaded from a local save_pretrained directory, against transformers' own model.

For Llama, Mistral, Qwen2, Qwen3, Phi-3, GPT-2 and GPT-NeoX: the layer-by-layer forward equals
the model's logits (fp32, 1e-5); the cached chunk (prefill with left padding, then decode steps)
equals the full forward at every unpadded position; greedy generation through the engine's
Generator (one stage) returns exactly `model.generate(do_sample=False)`'s tokens for prompts of
different lengths. Also: Mistral's sliding window, sampling filters equal transformers' warpers,
sampling does not depend on the microbatching, a layer reads only its own tensors (sharded
checkpoints), nothing is read under the meta device, and the directory's facts feed the config
checks (unreadable directories: tests/test_bad_input.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from _hf_tiny import ARCHS, VOCAB, hf_generate, prompts, reference, save_tiny

from engine.generate import Generator, SamplingConfig, filter_logits, left_pad
from experiments.models import build_model, compose
from experiments.models.hf_cache import HFCachedChunk, position_ids

torch.set_num_threads(1)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {arch: save_tiny(arch, root / arch) for arch in ARCHS}
    out["llama_sharded"] = save_tiny("llama", root / "llama_sharded", max_shard_size="40KB", seed=3)
    return out


def _spec(path: str, seq_len: int = 16):
    return build_model({"name": "hf", "pretrained": path, "seq_len": seq_len})


@pytest.mark.parametrize("arch", [*ARCHS, "llama_sharded"])
def test_layers_from_a_directory_equal_the_hf_forward(dirs, arch):
    spec = _spec(dirs[arch])
    model = reference(dirs[arch])
    layers = compose(spec.layers).eval()
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(layers(x), model(x).logits, **TOL)
    tied = bool(model.config.tie_word_embeddings)
    assert spec.ties == ([("0.wte.weight", f"{len(spec.layers) - 1}.lm_head.weight")] if tied else [])
    assert spec.num_params == sum(p.numel() for p in model.parameters())  # tied weights counted once
    if arch == "llama_sharded":
        assert len(list(Path(dirs[arch]).glob("*.safetensors"))) > 3


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_chunk_prefill_and_decode_equal_the_full_forward(dirs, arch):
    model = reference(dirs[arch])
    layers = list(compose(_spec(dirs[arch]).layers).eval())
    body, head = HFCachedChunk(layers[:-1]), layers[-1]   # every position's hidden state
    whole = HFCachedChunk(layers)                          # with the head: the next-token logits
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 10), generator=gen)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[2, :1] = 0
    caches = body.new_cache(3), whole.new_cache(3)
    with torch.no_grad():
        hidden = [head(body(ids, caches[0], mask))]
    nexts = [whole(ids, caches[1], mask)]
    seq = ids
    for _ in range(2):
        nxt = torch.randint(0, VOCAB, (3, 1), generator=gen)
        seq, mask = torch.cat([seq, nxt], 1), torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        with torch.no_grad():
            hidden.append(head(body(nxt, caches[0], mask)))
        nexts.append(whole(nxt, caches[1], mask))
    with torch.no_grad():
        full = model(seq, attention_mask=mask, position_ids=position_ids(mask, seq.shape[1])).logits
    real = mask.bool()
    torch.testing.assert_close(torch.cat(hidden, 1)[real], full[real], **TOL)
    torch.testing.assert_close(torch.cat(nexts, 1), full[:, 9:], **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_stage_greedy_generation_equals_hf_generate(dirs, arch):
    spec = _spec(dirs[arch])
    batch = prompts()
    gen = Generator(spec.layers, [(0, len(spec.layers))], chunk=spec.cached_chunk, ties=spec.ties)
    out = gen.generate(batch, 12, microbatches=3)
    assert out.tokens == hf_generate(reference(dirs[arch]), batch, 12)
    assert out.new_tokens == 6 * 12 and out.microbatches == 3


def test_sliding_window_mistral_equals_hf(tmp_path):
    path = save_tiny("mistral", tmp_path / "m", sliding_window=4)
    spec, model = _spec(path, seq_len=12), reference(path)
    assert model.config.sliding_window == 4
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = compose(spec.layers).eval()(x)
        torch.testing.assert_close(got, model(x).logits, **TOL)
        model.config.sliding_window = None  # the same weights without the window
        full = model(x).logits
        model.config.sliding_window = 4
    torch.testing.assert_close(got[:, :4], full[:, :4], **TOL)  # inside the window: no difference
    assert (got[:, 5:] - full[:, 5:]).abs().amax() > 1e-3      # beyond it the window matters
    gen = Generator(spec.layers, [(0, len(spec.layers))], chunk=spec.cached_chunk)
    batch = prompts(lengths=(7, 3))
    assert gen.generate(batch, 8).tokens == hf_generate(model, batch, 8)


def test_sampling_filters_equal_transformers_warpers():
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, k, p in ((0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (1.3, 10, 0.6)):
        ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        got = filter_logits(logits, temperature, k, p)
        assert torch.equal(torch.isinf(got), torch.isinf(ref))
        torch.testing.assert_close(got[~torch.isinf(got)], ref[~torch.isinf(ref)])


def test_sampling_is_seeded_per_prompt_and_top_k_one_is_greedy(dirs):
    spec = _spec(dirs["qwen2"])
    gen = Generator(spec.layers, [(0, len(spec.layers))], chunk=spec.cached_chunk, ties=spec.ties)
    batch = prompts()
    s = SamplingConfig(do_sample=True, temperature=1.5, top_k=20, top_p=0.9, seed=4)
    a = gen.generate(batch, 10, sampling=s, microbatches=1).tokens
    assert gen.generate(batch, 10, sampling=s, microbatches=3).tokens == a  # split-independent
    assert gen.generate(batch, 10, sampling=SamplingConfig(**{**s.__dict__, "seed": 5})).tokens != a
    greedy = gen.generate(batch, 10).tokens
    assert gen.generate(batch, 10, sampling=SamplingConfig(do_sample=True, top_k=1, seed=9)).tokens == greedy
    assert a != greedy


def test_eos_cuts_the_output_like_hf(dirs):
    spec, model = _spec(dirs["llama"]), reference(dirs["llama"])
    batch = prompts()
    greedy = hf_generate(model, batch, 10)
    eos = greedy[0][3]  # a token the first prompt produces: it stops there
    gen = Generator(spec.layers, [(0, len(spec.layers))], chunk=spec.cached_chunk)
    out = gen.generate(batch, 10, eos_token_id=eos).tokens
    ids, mask = left_pad(batch, 0)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)[:, ids.shape[1]:].tolist()
    for got, want in zip(out, ref):
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert got == want[:cut]
    assert out[0] == greedy[0][:greedy[0].index(eos) + 1]


def test_a_layer_reads_only_its_own_tensors(dirs, monkeypatch):
    import safetensors

    from experiments.models import hf_load

    read: list[str] = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

        def keys(self):
            return self.f.keys()

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    hf_load.load_hf_layer(dirs["llama_sharded"], 2)
    assert read and all(k.startswith("model.layers.1.") for k in read)
    read.clear()
    hf_load.load_hf_layer(dirs["qwen2"], 4)  # tied head: reads the embedding, the file has no head
    assert sorted(read) == ["model.embed_tokens.weight", "model.norm.weight"]
    read.clear()
    with torch.device("meta"):
        layer = hf_load.load_hf_layer(dirs["llama"], 1)
    assert not read and all(p.is_meta for p in layer.parameters())


def test_random_families_build_each_layer_alone():
    from experiments.config import model_config
    from experiments.models.hf import hf_config, model_class

    for arch in ARCHS:
        cfg = {"name": "hf", "arch": arch, "layers": 2, "dim": 32, "heads": 4, "kv_heads": 2, "vocab": 128,
               "seq_len": 8, "tie_embeddings": False}
        spec = build_model(cfg)
        model = compose(spec.layers, seed=1)
        again = compose(spec.layers, seed=1)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
        loss = spec.loss_fn(model(spec.example_input(2)), spec.example_target(2))
        assert abs(loss.item() - math.log(128)) < 0.5, arch
        hf = hf_config(model_config(cfg))
        with torch.device("meta"):
            ref = model_class(hf)(hf)
        assert spec.num_params == sum(p.numel() for p in ref.parameters()), arch
        assert spec.extra["arch"] == arch and len(spec.layers) == 4


def test_pretrained_facts_feed_the_config_checks(dirs):
    from experiments.config import ConfigError, compose_config, count_pipeline_layers, validate_config

    small = compose_config("model=hf", f"model.pretrained={dirs['gpt2']}", "model.seq_len=65", "data=synthetic")
    with pytest.raises(ConfigError, match="seq_len=65 exceeds the 64 positions"):
        validate_config(small)
    cfg = compose_config("model=hf", f"model.pretrained={dirs['llama']}", "model.seq_len=32", "pipeline.stages=5")
    assert count_pipeline_layers(cfg.model) == 5
    validate_config(cfg)
    with pytest.raises(ConfigError, match="at least one layer"):
        validate_config(compose_config("model=hf", f"model.pretrained={dirs['llama']}", "pipeline.stages=6"))


def test_incompatible_families_are_refused():
    from transformers import AutoConfig

    from experiments.models.hf import discover_layout, model_class

    cfg = AutoConfig.for_model("bloom", hidden_size=32, n_layer=1, n_head=4, vocab_size=64)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    with pytest.raises(ValueError, match="bloom.*not supported.*ALiBi"):
        discover_layout(model)


def test_prompts_inline_and_from_files(tmp_path):
    from omegaconf import OmegaConf

    from experiments.config import ConfigError
    from experiments.generate import read_prompts

    assert read_prompts(OmegaConf.create({"p": [[1, 2], [3]]}).p) == [[1, 2], [3]]
    (tmp_path / "p.json").write_text("[[4, 5], [6]]")
    assert read_prompts(str(tmp_path / "p.json")) == [[4, 5], [6]]
    (tmp_path / "p.jsonl").write_text('{"prompt": [7]}\n[8, 9]\n')
    assert read_prompts(str(tmp_path / "p.jsonl")) == [[7], [8, 9]]
    assert read_prompts("[[1]]") == [[1]]
    for bad, msg in ((None, "not set"), ("[[]]", "non-empty"), ("nothing here", "neither a file"), ("[[-1]]", "outside")):
        with pytest.raises(ConfigError, match=msg):
            read_prompts(bad)


def test_export_of_a_random_tied_model_from_a_checkpoint(tmp_path):
    from engine.checkpoint import save_checkpoint
    from experiments.export_hf import export
    from experiments.config import ConfigError

    cfg = {"name": "hf", "pretrained": None, "arch": "gpt_neox", "layers": 2, "dim": 32, "heads": 4, "vocab": 128,
           "seq_len": 16, "dropout": 0.0, "tie_embeddings": True, "kv_heads": None, "intermediate": None}
    spec = build_model(cfg)
    layers = compose(spec.layers, seed=3)
    layers[-1].lm_head.weight = layers[0].wte.weight  # tied, as the pipeline keeps them
    save_checkpoint(tmp_path / "ck", 7, layers={i: m.state_dict() for i, m in enumerate(layers)},
                    num_layers=len(layers), meta={"step": 7, "model": cfg})
    out = export(tmp_path / "ck", tmp_path / "hf")
    model = reference(str(out))
    assert model.config.tie_word_embeddings and json.loads((out / "pipeshard_export.json").read_text())["step"] == 7
    x = spec.example_input(2)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, layers.eval()(x), **TOL)
    from safetensors.torch import load_file

    stored = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.float32}
    half = load_file(str(export(tmp_path / "ck", tmp_path / "hf16", dtype="bf16") / "model.safetensors"))
    assert {t.dtype for t in half.values() if t.is_floating_point()} == {torch.bfloat16}   # 16 bits, as asked
    assert sorted(half) == sorted(stored)
    for k, t in stored.items():
        if t.is_floating_point():
            assert torch.equal(half[k], t.to(torch.bfloat16)), k
    with pytest.raises(ConfigError, match="choose one of"):
        export(tmp_path / "ck", tmp_path / "bad", dtype="int8")
