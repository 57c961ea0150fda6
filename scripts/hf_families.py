"""Regenerate docs/hf_families.md: every model type of transformers' causal-LM mapping, built
small with random weights, written with `save_pretrained`, loaded by pipeshard layer by layer
and compared with transformers (issue 41).

For each type, in this order:
1. a small config from generic sizes (hidden 64, 2 layers, 4 heads, vocab 128, 4 experts of
   which 2 per token, plus the family sizes in `OVERRIDES`; a composite config: its sub-config
   that the causal-LM class takes, `causal_lm_sub_config`); pipeshard's layout check on
   the meta device (refused: its message); the model built from the config, at most
   `MAX_PARAMS` parameters; failing: **not tried** (why);
2. pipeshard's launcher check (`pretrained_facts`: the layout, the family refusals, every
   layer's tensors and buffers on meta tensors): an error is **refused** with its message;
3. transformers' own loss with that config (`labels`, plus `output_router_logits` where the
   loss adds the router auxiliary loss); failing: **not tried** (why);
4. one process: pipeshard's loss equal to transformers' to 1e-5, else **differs** (a family to
   refuse in `experiments.models.hf.INCOMPATIBLE`);
5. 2 ranks (one job for all): one SGD step, 1f1b with 2 microbatches, whose loss must equal the
   mean of transformers' per-microbatch losses (1e-5), and greedy generation through the 2
   stages, whose tokens must equal `generate(do_sample=False)`'s. Both: **matches**.

Run from the repository root (a few minutes on 2 cores; nothing is downloaded):

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/hf_families.py --write   # docs/hf_families.md
    PYTHONPATH=$PWD python scripts/hf_families.py llama opt gemma2            # a few types, printed
    PYTHONPATH=$PWD python scripts/hf_families.py --update bamba jamba        # re-run a few, keep the other rows
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
VOCAB, SEQ, NEW = 128, 12, 6
MAX_PARAMS = 60_000_000   # larger after the generic sizes: the family keeps other sizes (not tried)
GENERIC = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
               # Mixture-of-Experts sizes, where the config has them
               num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=64, n_shared_experts=1)
OVERRIDES: dict[str, dict[str, Any]] = {
    # family sizes the generic ones miss (names the config class does not map)
    "falcon": dict(alibi=False, new_decoder_architecture=True, num_kv_heads=4),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=32, dropout=0.0),
    "gemma2": dict(head_dim=16, sliding_window=4, final_logit_softcapping=0.5, attn_logit_softcapping=0.5),
    "gemma3_text": dict(head_dim=16, sliding_window=4, final_logit_softcapping=0.5),
    "codegen": dict(rotary_dim=8), "gptj": dict(rotary_dim=8), "helium": dict(head_dim=16),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    # hybrids: with 2 layers every layer is a linear-attention one, which transformers' own mask fails on
    **{m: dict(num_hidden_layers=4) for m in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
                                                "recurrent_gemma")},
    # grouped routing: the generic 4 experts in one group
    "axk1": dict(n_group=1, topk_group=1),
    # head_dim=None in the config: derived nowhere (the rotary table needs it)
    **{m: dict(head_dim=16) for m in ("hunyuan_v1_dense", "hunyuan_v1_moe", "ministral")},
    # hybrids: one linear-attention (mamba / conv / KDA) layer and one attention layer
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=8),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], mamba_n_heads=4, mamba_d_head=32,
                             mamba_d_state=16, mamba_chunk_size=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False, mamba_dt_rank=8),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=16,
                        linear_head_dim=16, linear_num_heads=4, num_experts=4, num_experts_per_token=2),
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=16,
                           n_group=1, topk_group=1, num_mtp_layers=0),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mamba2": dict(num_heads=4, head_dim=32, n_groups=1, state_size=16, chunk_size=8),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], n_mamba_heads=4, mamba_d_state=16,
                   use_mamba_kernels=False, chunk_size=8),
    # DSA (indexed attention) off (NOTES); its sliding layers' attention sizes are per layer (swa_*)
    "dots3_note_text": dict(use_dsa=False, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                            head_dim=16, sliding_window=4, swa_num_attention_heads=4, swa_num_key_value_heads=4,
                            swa_q_lora_rank=16, swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8,
                            swa_v_head_dim=16),
    "zaya": dict(layer_types=["hybrid", "hybrid"], num_experts_per_tok=1, num_key_value_heads=2, head_dim=16),
    # MoE families whose first layers are dense by default: the second of 2 layers routed
    "flint": dict(mlp_only_layers=[0], head_dim=16, sliding_window=4),
    # sliding layers double the kv heads (and need heads >= 2 x kv heads)
    "mimo_v2_flash": dict(num_key_value_heads=2, head_dim=16, v_head_dim=16, sliding_window=4),
    # a rotary table per layer type
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                                                 for t in ("sliding_attention", "full_attention")}),
    "gemma3n_text": dict(num_kv_shared_layers=0, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                         vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=8,
                         intermediate_size=[128, 128], activation_sparsity_pattern=[0.0, 0.0]),
    # encoder-decoder families' decoders (their head counts are separate sizes)
    "plbart": dict(decoder_attention_heads=4, encoder_attention_heads=4, d_model=64, decoder_layers=2, encoder_layers=2),
    "whisper": dict(decoder_attention_heads=4, encoder_attention_heads=4, d_model=64, decoder_layers=2, encoder_layers=2),
    "reformer": dict(is_decoder=True, axial_pos_embds=False),
    "prophetnet": dict(num_hidden_layers=None, num_decoder_layers=2, num_encoder_layers=2),
    "xlnet": dict(max_position_embeddings=None, n_head=4, d_head=16, d_inner=128),   # its config refuses the setting (no length limit)
    "zamba": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2, attention_head_dim=16,
                  n_mamba_heads=2, use_mamba_kernels=False, mamba_dt_rank=8),
    "kolibri1_1": dict(layer_types=["indexed_attention", "sliding_attention"], index_layers=[0], kv_source_layers=[0, 1],
                       mlp_only_layers=[0], head_dim=16, sliding_window=4, index_num_heads=1, index_topk=4,
                       index_pool_size=8, index_compression=2, index_num_local_tokens=2, index_num_sink_tokens=1),
    # transformers 5.25's DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no longer declares
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=64, attn_config={"kv_n_heads": 4, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
    "gemma4_assistant": dict(backbone_hidden_size=64, num_centroids=8, centroid_intermediate_top_k=2,
                             text_config=dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                              intermediate_size=128, vocab_size=VOCAB, hidden_size_per_layer_input=0,
                                              vocab_size_per_layer_input=0, enable_moe_block=False,
                                              use_double_wide_mlp=False, num_kv_shared_layers=2,
                                              layer_types=["sliding_attention", "full_attention"], sliding_window=4)),
}
_DSA = ("built with use_dsa=false (full-attention and sliding layers); with DSA, the released checkpoints' "
        "default, its 'indexed_attention' layers are refused before launch (a sparse-attention indexer run on the "
        "explicit mask its forward builds; pipeshard's layers failed)")
NOTES = {"dots3_note_text": _DSA, "dots3_note": _DSA}
"""What a row's sizes leave out, said after its result."""
SUB_CONFIGS = ("text_config", "decoder")
"""Sub-configs a causal-LM class is built on when the family's config is composite: transformers'
`AutoModelForCausalLM.from_config` builds e.g. `Qwen3_5ForCausalLM` on a qwen3_5 config's
`text_config` (and musicgen's `MusicgenForCausalLM` takes its `decoder` config)."""
HEADER = """# Hugging Face causal-LM families through pipeshard (issue 41)

Every model type in transformers {version}'s `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` ({count}), built
small with random weights (hidden 64, 2 layers, 4 heads, vocab 128, at most 64 positions; the
same generic sizes for every family, plus the family sizes in `OVERRIDES`: head sizes, MLA ranks,
expert groups, one linear-attention and one attention layer for hybrids...), written with
`save_pretrained`, and loaded by pipeshard layer by layer from that directory. A composite
config (a multimodal family whose causal-LM class takes its `text_config`) is built as
`AutoModelForCausalLM.from_config` builds it: the causal-LM class on the small sub-config. A
composite checkpoint itself (vision tower and language model) is refused before launch, naming
the fix: `AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)` writes the language
model alone, which pipeshard loads (test_hf_families.py checks it on qwen3_5).
Generated by `scripts/hf_families.py --write` (its docstring gives the steps; `--update TYPES`
re-runs some types and keeps the other rows).

- **matches**: the training loss (cross-entropy, plus the router auxiliary loss for MoE families
  whose transformers loss has it: `output_router_logits=True`) through pipeshard's layers in one
  process equals `model(x, labels=y, shift_labels=y).loss` to 1e-5; one SGD step through 2
  stages (1f1b, 2 microbatches) equals the mean of transformers' per-microbatch losses to 1e-5;
  and greedy generation ({new} new tokens, 3 prompts of different lengths, left-padded) through
  the 2 stages returns exactly the tokens of transformers' `generate(do_sample=False)`.
  "matches the loss" without "and generate()" says what generation did instead.
- **refused**: the launcher stops before any process starts (exit status 2) with the message
  shown (`experiments.models.hf_load.pretrained_facts`: the layout, `hf.INCOMPATIBLE`, the
  family checks, every layer's tensors and buffers).
- **not tried**: transformers itself could not build or run the family small on CPU (the detail
  says why: a missing library, a sub-config type no causal-LM class loads), so nothing was
  compared. Where a row's sizes leave out what released checkpoints use, its detail says so
  (`NOTES`: dots3_note without DSA).

Per-family adapters (tests against transformers in tests/experiments/test_hf_families.py,
test_hf_moe.py, test_hf_models.py): gemma2 / gemma3_text (final logit soft-capping, sliding and
global layers, a rotary table per layer type), OPT (`model.decoder`, position offset,
`project_in` / `project_out`, post-norm), falcon with rotary positions (ALiBi refused), the
factors of `hf.SCALED` (granite, cohere, minicpm3), converted MoE checkpoints. Families whose
layers keep no KV cache (mamba, hybrids) train but `experiments.generate` refuses them.

Summary: {summary}.

| family | result | detail |
|---|---|---|
"""


def _quiet() -> None:
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetics only
        pass


def _why(exc: BaseException) -> str:
    cause = getattr(exc, "__cause__", None)
    if type(exc).__name__ == "StrictDataclassClassValidationError" and cause is not None:
        return f"{type(exc).__name__}: {_why(cause)}"   # the validator's own message
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def small_config(mtype: str) -> Any:
    """The generic small config of a model type (attributes the class has, set after init)."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.for_model(mtype)
    except Exception:  # noqa: BLE001 - a default config its own validation refuses (gemma4_assistant)
        cfg = AutoConfig.for_model(mtype, **{k: v for k, v in OVERRIDES.get(mtype, {}).items() if v is not None})
    sub = causal_lm_sub_config(cfg)
    if sub is not None:   # the sub-config the causal-LM class is built on, small
        return _shrink(sub, GENERIC, {**OVERRIDES.get(sub.model_type, {}), **OVERRIDES.get(mtype, {})})
    return _shrink(cfg, GENERIC, OVERRIDES.get(mtype, {}))


def causal_lm_sub_config(cfg: Any) -> Any:
    """The sub-config (`SUB_CONFIGS`) whose class the causal-LM class of a composite config
    takes, else None."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(cfg), None)
    want = getattr(cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return None
    return next((getattr(cfg, n) for n in SUB_CONFIGS if isinstance(getattr(cfg, n, None), want)), None)


def _has(cfg: Any, name: str) -> bool:
    """Whether a config class takes `name` (a field, an alias, or an attribute; a per-layer
    attribute, whose global read raises, counts)."""
    if name in getattr(type(cfg), "__dataclass_fields__", {}) or name in getattr(cfg, "attribute_map", {}):
        return True
    try:
        return hasattr(cfg, name)
    except Exception:  # noqa: BLE001 - dots3_note: "a per-layer attribute"
        return True


def _shrink(cfg: Any, generic: dict[str, Any], family: dict[str, Any]) -> Any:
    """`cfg`'s type with the generic sizes it takes and the family's own (`OVERRIDES`, passed as
    given: init arguments included; None: left at the class default)."""
    accepted = {k: v for k, v in generic.items() if _has(cfg, k)}
    accepted.update((k, v) for k, v in family.items() if v is not None)
    accepted = {k: v for k, v in accepted.items() if k not in family or family[k] is not None}
    cfg = type(cfg)(**accepted)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(cfg, name, min(VOCAB - 1, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name]))
    for name in ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(cfg, name, None), float):
            setattr(cfg, name, 0.0)
    return cfg


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, VOCAB, (4, SEQ), generator=gen) for _ in range(2))


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 3)]


def hf_loss(model: Any, x: torch.Tensor, y: torch.Tensor, router: bool) -> torch.Tensor:
    """transformers' training loss of inputs x and next-token targets y."""
    extra = {"output_router_logits": True} if router else {}
    return model(x, labels=y, shift_labels=y, **extra).loss


def survey_one(mtype: str, root: Path) -> dict[str, Any]:
    """Steps 1-4 for one model type: a row, and the directory when step 5 is to run."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        cfg = small_config(mtype)
    except Exception as exc:  # noqa: BLE001 - reported
        return {"result": "not tried", "detail": f"no small config from generic sizes ({_why(exc)})"}
    if cfg.model_type == mtype:
        row = _survey_config(mtype, cfg, root)
    elif AutoModelForCausalLM._model_mapping.get(type(cfg), None) is not None:
        # a composite config: the causal-LM class takes a sub-config, and is saved as that type
        row = _survey_config(mtype, cfg, root)
        row["detail"] = (f"{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mtype]} takes the config's sub-config (model_type "
                         f"{cfg.model_type!r}), as AutoModelForCausalLM builds it; {row['detail']}")
    else:   # a sub-config type nothing loads: the class on the composite config, as pipeshard's launcher builds it
        row = _survey_config(mtype, _shrink(AutoConfig.for_model(mtype), GENERIC, OVERRIDES.get(mtype, {})), root)
        if row["result"] == "not tried":
            row["detail"] = (f"{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mtype]} takes the config's sub-config (model_type "
                             f"{cfg.model_type!r}), which has no causal-LM class in transformers' mapping: neither "
                             "AutoModelForCausalLM.from_pretrained nor pipeshard can load a checkpoint of it; and "
                             f"on the composite config itself: {row['detail']}")
    if mtype in NOTES:
        row["detail"] = f"{row['detail']}; {NOTES[mtype]}"
    return row


def _survey_config(mtype: str, cfg: Any, root: Path) -> dict[str, Any]:
    """Steps 1-4 with the small config `cfg` of model type `mtype`."""
    from experiments.models import build_model, compose
    from experiments.models.hf import model_class
    from experiments.models.hf_load import check_loadable, pretrained_facts
    from experiments.models.hf_moe import router_spec

    try:
        with torch.device("meta"):
            meta = model_class(cfg)(cfg)
        size = sum(p.numel() for p in meta.parameters())
    except Exception as exc:  # noqa: BLE001
        return {"result": "not tried", "detail": f"transformers cannot build it small ({_why(exc)})"}
    try:   # the launcher's first check (the layout and the family refusals), on the meta device
        from experiments.models.hf import discover_layout

        discover_layout(meta)
    except ValueError as exc:
        return {"result": "refused", "detail": str(exc).replace("|", "/").replace("\n", " ")[:400]}
    if size > MAX_PARAMS:
        return {"result": "not tried", "detail": f"the generic sizes still give {size / 1e6:.0f}M parameters "
                                                 "(sizes of sub-models or tables it does not take from them)"}
    try:
        torch.manual_seed(0)
        model = model_class(cfg)(cfg).eval()
        path = root / mtype
        model.save_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        return {"result": "not tried", "detail": f"transformers cannot build it small on CPU ({_why(exc)})"}
    try:
        facts = pretrained_facts(str(path))
        check_loadable(str(path))
    except Exception as exc:  # noqa: BLE001 - the launcher's message
        return {"result": "refused", "detail": str(exc).replace("|", "/").replace("\n", " ")[:400]}
    router = router_spec(model) is not None
    x, y = _batch(0)
    try:
        from transformers import AutoModelForCausalLM

        from experiments.models.hf import attention_implementation

        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                   attn_implementation=attention_implementation(cfg)).eval()
        with torch.no_grad():
            want = float(hf_loss(ref, x, y, router))
    except Exception as exc:  # noqa: BLE001
        return {"result": "not tried", "detail": f"transformers' own loss fails with the generic small config ({_why(exc)})"}
    try:
        spec = build_model({"name": "hf", "pretrained": str(path), "seq_len": SEQ})
        with torch.no_grad():
            got = float(spec.loss_fn(compose(spec.layers).eval()(x), y))
    except Exception as exc:  # noqa: BLE001
        return {"result": "differs", "detail": f"pipeshard's layers fail: {_why(exc)}"}
    one = f"1 process: loss {got:.6f} vs {want:.6f} (/d/={abs(got - want):.1e})"
    if abs(got - want) > 1e-5 * max(1.0, abs(want)):
        return {"result": "differs", "detail": one}
    return {"result": "one", "detail": one, "path": str(path), "router": router, "no_generation": facts["generation"]}


def _two_stage_worker(paths: dict[str, tuple[str, bool]]) -> dict[str, Any]:
    """On each of 2 ranks: per family, one SGD step (1f1b, m=2) and greedy generation."""
    _quiet()
    from engine import OptimizerConfig, Pipeline
    from engine.generate import Generator
    from experiments.models import build_model

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for mtype, (path, generate) in paths.items():
        row: dict[str, Any] = {}
        try:
            spec = build_model({"name": "hf", "pretrained": path, "seq_len": SEQ})
            n = len(spec.layers)
            pipe = Pipeline(spec.layers, [(0, 2), (2, n)], loss_fn=spec.loss_fn, schedule="1f1b", microbatches=2,
                            optimizer=OptimizerConfig(name="sgd", lr=0.1), ties=spec.ties)
            x, y = _batch(1)
            row["loss"] = pipe.train_step(x, y).loss
            del pipe
        except Exception as exc:  # noqa: BLE001 - reported
            row["loss_error"] = _why(exc)
            traceback.print_exc()
        if not generate:
            out[mtype] = row
            continue
        try:
            gen = Generator(spec.layers, [(0, 2), (2, len(spec.layers))], chunk=spec.cached_chunk, ties=spec.ties)
            row["tokens"] = gen.generate(_prompts(), NEW, microbatches=2).tokens
        except Exception as exc:  # noqa: BLE001
            row["generate_error"] = _why(exc)
        out[mtype] = row
    return out


def _reference_two_stage(path: str, router: bool, generate: bool) -> tuple[float, list[list[int]] | None]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.generate import left_pad
    from experiments.models.hf import attention_implementation

    impl = attention_implementation(AutoConfig.from_pretrained(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl).train()
    x, y = _batch(1)
    with torch.no_grad():
        loss = float(torch.stack([hf_loss(model, a, b, router) for a, b in zip(x.chunk(2), y.chunk(2))]).mean())
    if not generate:
        return loss, None
    model.eval()
    ids, mask = left_pad(_prompts(), 0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, use_cache=True,
                             eos_token_id=None, pad_token_id=0)
    return loss, out[:, ids.shape[1]:].tolist()


def two_stage(rows: dict[str, dict[str, Any]]) -> None:
    """Step 5 for every row still at one process, in one 2-rank job."""
    from dist_helpers import run_workers

    todo = {m: (r["path"], not r["no_generation"]) for m, r in rows.items() if r["result"] == "one"}
    if not todo:
        return
    results = run_workers(_two_stage_worker, 2, todo, timeout_s=3000)
    for mtype in todo:
        row = rows[mtype]
        got = results[-1][mtype]
        try:
            want_loss, want_tokens = _reference_two_stage(row["path"], row["router"], not row["no_generation"])
        except Exception as exc:  # noqa: BLE001
            row.update(result="matches (1 process)", detail=f"{row['detail']}; transformers' 2-microbatch "
                       f"reference fails ({_why(exc)})")
            continue
        if "loss_error" in got:
            row.update(result="differs", detail=f"{row['detail']}; 2 stages fail: {got['loss_error']}")
            continue
        two = f"2 stages 1f1b m=2: {got['loss']:.6f} vs {want_loss:.6f}"
        if abs(got["loss"] - want_loss) > 1e-5 * max(1.0, abs(want_loss)):
            row.update(result="differs", detail=f"{row['detail']}; {two}")
            continue
        if row["no_generation"]:
            gen = f"generation refused before launch ({row['no_generation']})"
        elif "generate_error" in got:
            gen = f"generation through 2 stages fails ({got['generate_error']})"
        elif got["tokens"] != want_tokens:
            gen = "generation through 2 stages gives other tokens than generate()"
        else:
            gen = None
        result = "matches generate() and the loss through 2 stages" if gen is None else "matches the loss through 2 stages"
        row.update(result=result, detail="; ".join(p for p in (row["detail"], two, gen) if p))


def _read_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The rows of an existing table (family -> result, detail)."""
    rows = {}
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 5 and parts[1] not in ("family", "---"):
            rows[parts[1]] = {"result": parts[2], "detail": parts[3]}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--write", action="store_true", help="write docs/hf_families.md")
    parser.add_argument("--update", action="store_true", help="re-run the given types and replace their rows "
                        "in docs/hf_families.md (the others kept)")
    args = parser.parse_args()
    _quiet()
    torch.set_num_threads(1)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mtype in types:
            rows[mtype] = survey_one(mtype, Path(tmp))
            print(f"{mtype}: {rows[mtype]['result']}", file=sys.stderr, flush=True)
        two_stage(rows)
    lines = [f"| {m} | {r['result']} | {r['detail']} |" for m, r in rows.items()]
    if args.update:
        rows = {**_read_rows(ROOT / "docs" / "hf_families.md"), **rows}
        rows = dict(sorted(rows.items()))
        lines = [f"| {m} | {r['result']} | {r['detail']} |" for m, r in rows.items()]
    if not (args.write or args.update):
        print("\n".join(lines))
        return
    counts: dict[str, int] = {}
    for r in rows.values():
        key = r["result"].split(" (")[0] if not r["result"].startswith("matches") else (
            "match generate() and the loss" if "generate()" in r["result"] else "match the loss only")
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    text = HEADER.format(version=transformers.__version__, count=len(rows), new=NEW, summary=summary)
    (ROOT / "docs" / "hf_families.md").write_text(text + "\n".join(lines) + "\n")
    print(f"wrote docs/hf_families.md: {summary}")


if __name__ == "__main__":
    main()
