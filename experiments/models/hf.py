"""Hugging Face transformers causal LMs (GPT-2, Llama) as pipeshard layers.

Models are built from their config class with random weights; nothing is downloaded. The layer
list is: the embedding (tokens -> hidden states), one layer per decoder block (hidden states in
and out, causal attention through SDPA), and the final norm with the LM head (-> logits). Tied
input/output embeddings are reported in `ModelSpec.ties`.

Two ways in:
    * `build_hf(cfg)`: layer factories; each builds only its own HF modules and initialises them
      with the model class's own `_init_weights` (so a pipeline rank never builds the whole model).
    * `layers_from_hf(model)`: wrap the submodules of an existing `GPT2LMHeadModel` /
      `LlamaForCausalLM` instance (same weights, shared, not copied).

Example:
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=16))
    >>> layers = layers_from_hf(model)          # embedding, 2 blocks, head
    >>> len(layers)
    4
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any

import torch
from torch import nn

from experiments.fields import get_field as _field
from experiments.models.gpt import lm_spec
from experiments.models.spec import ModelSpec

__all__ = [
    "HFTokenEmbedding",
    "HFBlock",
    "HFHead",
    "build_hf",
    "hf_config",
    "layers_from_hf",
    "build_hf_layer",
]

ARCHS = ("gpt2", "llama")


class HFTokenEmbedding(nn.Module):
    """Token embedding (+ learned positions for GPT-2): `[b, t]` int64 -> `[b, t, d]`."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding | None = None, drop: nn.Module | None = None) -> None:
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop if drop is not None else nn.Identity()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(input_ids)
        if self.wpe is not None:
            h = h + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        return self.drop(h)


class HFBlock(nn.Module):
    """One HF decoder block taking and returning hidden states `[b, t, d]` (causal, no cache).

    For Llama the block needs rotary position embeddings, which the model normally computes once
    for all blocks; here each block owns a (parameter-free) rotary module and computes them.
    """

    def __init__(self, block: nn.Module, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {"attention_mask": None}  # None + SDPA = causal attention
        if self.rotary is not None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            kwargs["position_ids"] = position_ids
            kwargs["position_embeddings"] = self.rotary(hidden, position_ids)
        out = self.block(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class HFHead(nn.Module):
    """Final norm + LM head: `[b, t, d]` -> logits `[b, t, vocab]`."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _arch_of(model_or_config: Any) -> str:
    model_type = getattr(model_or_config, "model_type", None) or model_or_config.config.model_type
    if model_type not in ARCHS:
        raise ValueError(f"unsupported Hugging Face model type {model_type!r}; supported: {ARCHS}")
    return model_type


def hf_config(cfg: Any) -> Any:
    """The transformers config object for a pipeshard model config (`experiments.config.HFModelConfig`).

    >>> hf_config({"arch": "gpt2", "layers": 2, "dim": 32, "heads": 2, "vocab": 300, "seq_len": 16}).n_layer
    2
    """
    arch = str(_field(cfg, "arch", "gpt2"))
    layers = int(_field(cfg, "layers", 2))
    dim = int(_field(cfg, "dim", 128))
    heads = int(_field(cfg, "heads", 4))
    vocab = int(_field(cfg, "vocab", 50257))
    seq_len = int(_field(cfg, "seq_len", 128))
    dropout = float(_field(cfg, "dropout", 0.0))
    tie = bool(_field(cfg, "tie_embeddings", True))
    if arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab, n_positions=seq_len, n_embd=dim, n_layer=layers, n_head=heads,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
            tie_word_embeddings=tie, use_cache=False, attn_implementation="sdpa",
            bos_token_id=vocab - 1, eos_token_id=vocab - 1,
        )
    if arch == "llama":
        from transformers import LlamaConfig

        kv_heads = _field(cfg, "kv_heads", None)
        intermediate = _field(cfg, "intermediate", None)
        return LlamaConfig(
            vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=int(kv_heads) if kv_heads else heads,
            intermediate_size=int(intermediate) if intermediate else 4 * dim,
            max_position_embeddings=seq_len, attention_dropout=dropout,
            tie_word_embeddings=tie, use_cache=False, attn_implementation="sdpa",
            bos_token_id=min(1, vocab - 1), eos_token_id=min(2, vocab - 1),
        )
    raise ValueError(f"model.arch={arch!r}; choose one of {ARCHS}")


def layers_from_hf(model: nn.Module) -> list[nn.Module]:
    """Wrap an existing HF causal LM's own submodules as pipeshard layers (weights shared)."""
    arch = _arch_of(model)
    if arch == "gpt2":
        body = model.transformer
        first = HFTokenEmbedding(body.wte, body.wpe, body.drop)
        blocks = [HFBlock(b) for b in body.h]
        last = HFHead(body.ln_f, model.lm_head)
    else:
        body = model.model
        first = HFTokenEmbedding(body.embed_tokens)
        blocks = [HFBlock(b, body.rotary_emb) for b in body.layers]
        last = HFHead(body.norm, model.lm_head)
    return [first, *blocks, last]


def _model_class(arch: str) -> type:
    if arch == "gpt2":
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM


@functools.lru_cache(maxsize=8)
def _meta_reference(arch: str, config_json: str) -> nn.Module:
    """The full model on the meta device (no memory): used only for its `_init_weights` method."""
    config = _config_from_json(arch, config_json)
    with torch.device("meta"):
        return _model_class(arch)(config)


def _config_from_json(arch: str, config_json: str) -> Any:
    import json

    if arch == "gpt2":
        from transformers import GPT2Config as C
    else:
        from transformers import LlamaConfig as C
    config = C.from_dict(json.loads(config_json))
    config._attn_implementation = "sdpa"
    return config


def build_hf_layer(arch: str, config_json: str, index: int) -> nn.Module:
    """Build pipeline layer `index` alone (0 = embedding, last = head), initialised as HF would."""
    config = _config_from_json(arch, config_json)
    n = config.num_hidden_layers
    if arch == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        if index == 0:
            layer: nn.Module = HFTokenEmbedding(
                nn.Embedding(config.vocab_size, config.n_embd),
                nn.Embedding(config.n_positions, config.n_embd),
                nn.Dropout(config.embd_pdrop),
            )
        elif index <= n:
            layer = HFBlock(GPT2Block(config, layer_idx=index - 1))
        else:
            layer = HFHead(
                nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
                nn.Linear(config.n_embd, config.vocab_size, bias=False),
            )
    else:
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        if index == 0:
            layer = HFTokenEmbedding(nn.Embedding(config.vocab_size, config.hidden_size))
        elif index <= n:
            layer = HFBlock(LlamaDecoderLayer(config, layer_idx=index - 1), LlamaRotaryEmbedding(config=config))
        else:
            layer = HFHead(
                LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps),
                nn.Linear(config.hidden_size, config.vocab_size, bias=False),
            )
    reference = _meta_reference(arch, config_json)
    for module in layer.modules():
        reference._init_weights(module)
    return layer


def build_hf(cfg: Any) -> ModelSpec:
    """Layer factories for a Hugging Face GPT-2 / Llama built from its config class (random weights).

    Fields: arch (gpt2 | llama), layers, dim, heads, vocab, seq_len, dropout, tie_embeddings,
    kv_heads and intermediate (Llama only).
    """
    config = hf_config(cfg)
    arch = config.model_type
    config_json = config.to_json_string(use_diff=False)
    n = config.num_hidden_layers
    factories = [partial(build_hf_layer, arch, config_json, i) for i in range(n + 2)]
    embed_name = "wte.weight"
    ties = [(f"0.{embed_name}", f"{n + 1}.lm_head.weight")] if config.tie_word_embeddings else []
    seq_len = int(_field(cfg, "seq_len", 128))
    return lm_spec(factories, ties, seq_len=seq_len, vocab=config.vocab_size,
                   name=f"hf-{arch}-L{n}-d{_field(cfg, 'dim', 128)}", arch=arch)
