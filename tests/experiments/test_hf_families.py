"""The per-family adapters of issue 41 part 3, against transformers' own model: gemma2 and
gemma3 (final and attention logit soft-capping, sliding and global layers, gemma3's rotary table
per layer type, the embedding scale, pre/post feed-forward norms inside transformers' decoder
layers), OPT (`model.decoder`, learned positions read at `position + 2`, `project_in` /
`project_out` between the embedding width and the hidden size, a post-norm variant without a
final norm) and falcon with rotary positions (the old and the new decoder architecture).

Each tiny random model is written with `save_pretrained` and loaded by pipeshard layer by layer:
- one process: the logits and the loss equal transformers' (fp32, 1e-5; soft-capping and the
  window are set so small that they change the result);
- 2 ranks: 2 SGD steps (1f1b, 2 microbatches) give transformers' per-microbatch mean loss and
  parameters, and greedy generation returns exactly `model.generate(do_sample=False)`'s tokens;
- what is still not reproduced (falcon's ALiBi, gemma3's bidirectional mask, the chunked loss
  with soft-capping) is refused before launch: exit status 2 and the reason.
Also from the family survey (scripts/hf_families.py): DBRX's router, which returns its logits
alone, gives transformers' auxiliary loss; families that do work between their layers (zamba,
zamba2, kolibri1_1, zaya) and llama4's causal LM are refused with the reason.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _hf_tiny import hf_generate, prompts
from dist_helpers import run_workers

from experiments.models import build_model, compose

torch.set_num_threads(1)
TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB, SEQ, LR = 256, 12, 0.5   # 256: the shared prompts (_hf_tiny) draw below it
ROOT = Path(__file__).resolve().parents[2]
_GEMMA = dict(intermediate_size=64, num_key_value_heads=2, head_dim=12, sliding_window=4,
              final_logit_softcapping=0.1, query_pre_attn_scalar=12)
FAMILIES = {
    "gemma2": ("gemma2", dict(_GEMMA, attn_logit_softcapping=0.05)),
    "gemma3": ("gemma3_text", dict(_GEMMA, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "opt": ("opt", dict(ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0)),
    "opt_postnorm": ("opt", dict(ffn_dim=64, do_layer_norm_before=False, max_position_embeddings=64, dropout=0.0)),
    "falcon": ("falcon", dict(alibi=False, new_decoder_architecture=False, multi_query=True)),
    "falcon_new": ("falcon", dict(alibi=False, new_decoder_architecture=True, num_kv_heads=2)),
}


def save_family(name: str, path: Path, *, seed: int = 0, **extra) -> str:
    """A random tiny model of `FAMILIES[name]` written by save_pretrained."""
    from transformers import AutoConfig

    from experiments.models.hf import model_class

    mtype, kw = FAMILIES[name]
    cfg = AutoConfig.for_model(mtype, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, vocab_size=VOCAB,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**kw, **extra})
    torch.manual_seed(seed)
    model_class(cfg)(cfg).save_pretrained(path)
    return str(path)


def reference(path: str):
    """transformers' model from the directory (fp32; SDPA where the family has it, else eager)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from experiments.models.hf import attention_implementation

    impl = attention_implementation(AutoConfig.from_pretrained(path))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    logging.getLogger("experiments.models.hf").setLevel(logging.ERROR)
    root = tmp_path_factory.mktemp("families")
    return {name: save_family(name, root / name) for name in FAMILIES}


def _spec(path: str, **kw):
    return build_model({"name": "hf", "pretrained": path, "seq_len": SEQ, **kw})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_process_logits_and_loss_equal_transformers(dirs, name):
    model = reference(dirs[name]).eval()
    spec = _spec(dirs[name])
    layers = compose(spec.layers).eval()
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(2))
    with torch.no_grad():
        torch.testing.assert_close(layers(x), model(x).logits, **TOL)
        torch.testing.assert_close(spec.loss_fn(layers(x), y), model(x, labels=y, shift_labels=y).loss, **TOL)
    assert spec.num_params == sum(p.numel() for p in model.parameters())


def test_the_family_features_change_the_result(dirs):
    """The soft-capping, the window and OPT's position offset matter here (so the tests above
    would see an adapter that dropped them)."""
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    layers = compose(_spec(dirs["gemma2"]).layers).eval()
    with torch.no_grad():
        capped = layers(x)
        layers[-1].softcap = None
        assert (capped - layers(x)).abs().amax() > 1e-2
        assert capped.abs().amax() < 0.1      # tanh(z / 0.1) * 0.1
        layers[-1].softcap = 0.1
        layers[1].block.self_attn.attn_logit_softcapping = None   # inside transformers' attention
        assert (capped - layers(x)).abs().amax() > 1e-4
        model = reference(dirs["gemma3"]).eval()
        full = model(x).logits
        model.config.sliding_window = SEQ     # the same weights without the window cut
        assert (full - model(x).logits).abs().amax() > 1e-3
        opt = compose(_spec(dirs["opt"]).layers).eval()
        ref = opt(x)
        wpe = opt[0].wpe
        wpe.offset = 0
        assert (ref - opt(x)).abs().amax() > 1e-3
        wpe.offset = 2
    assert opt[0].proj is not None and opt[-1].proj is not None and isinstance(compose(
        _spec(dirs["opt_postnorm"]).layers)[-1].norm, torch.nn.Identity)


def _worker(paths: dict) -> dict:
    import torch.distributed as dist

    from engine import OptimizerConfig, Pipeline
    from engine.generate import Generator

    torch.set_num_threads(1)
    out = {}
    for name, path in paths.items():
        spec = _spec(path)
        n = len(spec.layers)
        gen = Generator(spec.layers, [(0, 2), (2, n)], chunk=spec.cached_chunk, ties=spec.ties)
        tokens = gen.generate(prompts(), 8, microbatches=2).tokens
        pipe = Pipeline(spec.layers, [(0, 2), (2, n)], loss_fn=spec.loss_fn, schedule="1f1b", microbatches=2,
                        optimizer=OptimizerConfig(name="sgd", lr=LR), ties=spec.ties)
        losses = [pipe.train_step(x, y).loss for x, y in _batches()]
        params = {int(k): {p: t.detach().clone() for p, t in m.state_dict().items()}
                  for k, m in pipe.layer_module.items()}
        out[name] = {"rank": dist.get_rank(), "tokens": tokens, "losses": losses, "params": params}
    return out


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [tuple(torch.randint(0, VOCAB, (4, SEQ), generator=gen) for _ in range(2)) for _ in range(2)]


def _reference_run(path: str) -> tuple[list[float], dict]:
    model = reference(path).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = torch.stack([model(xm, labels=ym, shift_labels=ym).loss
                            for xm, ym in zip(x.chunk(2), y.chunk(2))]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_two_stages_train_and_generate_like_transformers(dirs):
    from experiments.models.hf import discover_layout, layer_prefixes

    results = run_workers(_worker, 2, dirs, timeout_s=300)
    for name, path in dirs.items():
        model = reference(path).eval()
        want = hf_generate(model, prompts(), 8)
        losses, params = _reference_run(path)
        lay = discover_layout(model)
        for r in results:
            assert r[name]["tokens"] == want, name
            assert r[name]["losses"] == pytest.approx(losses, rel=1e-5), name
            for i, layer in r[name]["params"].items():
                for key, t in layer.items():
                    head, _, rest = key.partition(".")
                    full = f"{layer_prefixes(lay, i)[head]}.{rest}"
                    torch.testing.assert_close(t, params[full], rtol=1e-5, atol=1e-6, msg=f"{name} {full}")
        print(name, "losses", losses)


def _launch(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)


def test_what_is_not_reproduced_is_refused_before_launch(dirs, tmp_path):
    from experiments.config import ConfigError, compose_config, validate_config
    from experiments.models.hf_load import pretrained_facts

    alibi = save_family("falcon", tmp_path / "falcon_alibi", alibi=True)
    proc = _launch("experiments.generate", "model=hf", f"model.pretrained={alibi}", "pipeline.stages=2",
                   "generate.prompts=[[1,2,3]]", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config.alibi=true: ALiBi" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "generations.jsonl").exists()
    bidirectional = save_family("gemma3", tmp_path / "gemma3_bi", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention=true"):
        pretrained_facts(bidirectional)
    cfg = compose_config("model=hf", f"model.pretrained={dirs['gemma2']}", "model.loss=chunked", "model.seq_len=12")
    with pytest.raises(ConfigError, match="cannot soft-cap the logits.*set model.loss=full"):
        validate_config(cfg)
    with pytest.raises(ValueError, match="cannot soft-cap"):
        compose(_spec(dirs["gemma2"], loss="chunked").layers)(torch.zeros(1, 4, dtype=torch.long))


def test_a_family_whose_layers_keep_no_kv_cache_is_refused_by_generate(tmp_path):
    from transformers import AutoConfig

    from experiments.config import ConfigError, compose_config
    from experiments.generate import run
    from experiments.models.hf import model_class
    from experiments.models.hf_load import pretrained_facts

    cfg = AutoConfig.for_model("mamba", hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, state_size=4)
    model_class(cfg)(cfg).save_pretrained(tmp_path / "mamba")
    path = str(tmp_path / "mamba")
    assert "linear_attention" in pretrained_facts(path)["generation"]
    assert pretrained_facts(save_family("opt", tmp_path / "opt"))["generation"] is None
    with pytest.raises(ConfigError, match="'mamba' cannot generate through pipeshard.*experiments.train"):
        run(compose_config("model=hf", f"model.pretrained={path}", "pipeline.stages=2",
                           "generate.prompts=[[1,2,3]]"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["opt", "gemma3"])
def test_export_writes_the_family_back(dirs, tmp_path, name):
    """A checkpoint of changed weights exports to a directory transformers loads with the
    pipeline's logits: OPT's projections and offset positions map back to `model.decoder`,
    gemma's embedding scale (computed, not stored) is rebuilt."""
    from engine.checkpoint import save_checkpoint
    from experiments.export_hf import export

    cfg = {"name": "hf", "pretrained": dirs[name], "seq_len": SEQ}
    spec = build_model(cfg)
    layers = compose(spec.layers)
    with torch.no_grad():
        for p in layers.parameters():
            p.add_(0.01)
    if spec.ties:
        layers[-1].lm_head.weight = layers[0].wte.weight
    save_checkpoint(tmp_path / "ck", 1, layers={i: m.state_dict() for i, m in enumerate(layers)},
                    num_layers=len(layers), meta={"step": 1, "model": cfg})
    model = reference(str(export(tmp_path / "ck", tmp_path / "hf"))).eval()
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, layers.eval()(x), **TOL)
        assert (model(x).logits - reference(dirs[name])(x).logits).abs().amax() > 1e-3   # the changed weights


def test_a_router_returning_one_tensor_gives_transformers_aux_loss(tmp_path):
    """DBRX's router returns its logits alone (not a tuple): pipeshard records them as
    transformers' output recorder does, so the loss with the router auxiliary loss is transformers'."""
    from transformers import AutoConfig

    from experiments.models.hf import model_class

    cfg = AutoConfig.for_model("dbrx", d_model=48, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=VOCAB,
                               attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                               ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2,
                                           "moe_loss_weight": 0.1})
    torch.manual_seed(0)
    model_class(cfg)(cfg).save_pretrained(tmp_path / "dbrx")
    path = str(tmp_path / "dbrx")
    spec = _spec(path)
    gen = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(2))
    want = reference(path)(x, labels=y, shift_labels=y, output_router_logits=True)
    assert want.aux_loss is not None and want.aux_loss.item() > 0
    torch.testing.assert_close(spec.loss_fn(compose(spec.layers)(x), y), want.loss, **TOL)
    assert spec.loss_fn.pop() == pytest.approx(want.aux_loss.item(), rel=1e-6)


@pytest.mark.parametrize("mtype,message", [
    ("zamba", "'zamba' is not supported: .*embedding output.*shared by all of them"),
    ("zamba2", "'zamba2' is not supported: .*embedding output"),
    ("kolibri1_1", "'kolibri1_1' is not supported: .*shared_kv_states"),
    ("zaya", "'zaya' is not supported: .*shifts and scales its embeddings"),
    ("llama4_text", "base_model_prefix 'language_model' names none of its modules.*not supported"),
    ("dots3_note_text", "'dots3_note_text' with 'indexed_attention' layers: a sparse-attention indexer.*not supported"),
])
def test_families_found_with_family_sizes_are_refused_with_the_reason(mtype, message):
    """Families whose forward does work between its layers, or that pipeshard cannot split
    (scripts/hf_families.py's survey with family sizes): refused by the launcher's layout check,
    with the reason. dots3_note's default config has DSA layers (`indexed_attention`)."""
    from transformers import AutoConfig

    from experiments.models.hf import discover_layout, model_class

    cfg = AutoConfig.for_model(mtype)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    with pytest.raises(ValueError, match=message):
        discover_layout(model)


def test_a_composite_checkpoint_is_refused_with_the_fix_that_works(tmp_path):
    """A multimodal checkpoint (qwen3_5: vision tower + language model, `model.language_model.*`)
    is refused before launch, naming the fix: transformers' AutoModelForCausalLM saves its
    language model alone, which pipeshard loads, with the multimodal model's text loss."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    from experiments.models.hf_load import pretrained_facts

    text = dict(hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                intermediate_size=64, vocab_size=VOCAB, linear_num_key_heads=2, linear_num_value_heads=2,
                linear_key_head_dim=8, linear_value_head_dim=8)
    cfg = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=48))
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(cfg).save_pretrained(tmp_path / "vlm")
    with pytest.raises(ValueError, match="'qwen3_5' is a composite .*text_config.*AutoModelForCausalLM.from_pretrained"):
        pretrained_facts(str(tmp_path / "vlm"))
    AutoModelForCausalLM.from_pretrained(tmp_path / "vlm", dtype=torch.float32).save_pretrained(tmp_path / "lm")
    spec = _spec(str(tmp_path / "lm"))
    x, y = (torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5)) for _ in range(2))
    vlm = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "vlm", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(spec.loss_fn(compose(spec.layers).eval()(x), y),
                                   vlm(x, labels=y, shift_labels=y).loss, **TOL)
