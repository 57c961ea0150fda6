"""Tiny Hugging Face models written with `save_pretrained` into a directory (nothing downloaded),
shared by the HF adapter, pipeline and generation tests.

Example::

    path = save_tiny("qwen2", tmp_path / "qwen2", tie=True)
    model = reference(path)          # transformers' own model from that directory
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "gpt_neox")
TIED = {"qwen2", "gpt2"}   # tie input and output embeddings in these (the others untied)
VOCAB = 256


def tiny_config(arch: str, *, layers: int = 3, dim: int = 48, heads: int = 4, kv_heads: int = 2,
                intermediate: int | None = 96, tie: bool | None = None, seq_len: int = 64, **extra: Any) -> Any:
    from experiments.config import HFModelConfig, model_config
    from experiments.models.hf import hf_config

    cfg = hf_config(model_config({"arch": arch, "layers": layers, "dim": dim, "heads": heads, "kv_heads": kv_heads,
                                  "intermediate": intermediate, "vocab": VOCAB, "seq_len": seq_len,
                                  "tie_embeddings": arch in TIED if tie is None else tie}, HFModelConfig))
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def save_tiny(arch: str, path: Path, *, seed: int = 0, max_shard_size: str | int = "5GB", **kw: Any) -> str:
    """A random tiny model of `arch` saved into `path` (safetensors; sharded below max_shard_size)."""
    from experiments.models.hf import model_class

    cfg = tiny_config(arch, **kw)
    torch.manual_seed(seed)
    model = model_class(cfg)(cfg)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return str(path)


def reference(path: str) -> Any:
    """transformers' model loaded from the directory (fp32, SDPA, eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def prompts(seed: int = 1, lengths: tuple[int, ...] = (5, 9, 3, 7, 9, 6)) -> list[list[int]]:
    """Prompts of different lengths (left padding needed)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_generate(model: Any, batch: list[list[int]], new: int, pad: int = 0, **kw: Any) -> list[list[int]]:
    """Greedy `model.generate` on left-padded prompts; the new tokens per prompt (no eos stop)."""
    from engine.generate import left_pad

    ids, mask = left_pad(batch, pad)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=True,
                             eos_token_id=None, pad_token_id=pad, **kw)
    return out[:, ids.shape[1]:].tolist()
