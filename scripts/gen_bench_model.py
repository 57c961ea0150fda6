"""Build the generation must-show workload (issue 41.4): a Llama-style model with random weights
(8 layers, d=512), saved with ``save_pretrained``, and 32 token-id prompts beside it.

    python scripts/gen_bench_model.py .scratch/llama8x512
    python -m experiments.generate model=hf model.pretrained=.scratch/llama8x512 pipeline.stages=2 \\
        generate.prompts=.scratch/llama8x512/prompts.json generate.max_new_tokens=32

Example:
    >>> prompt_lengths(3, seed=0)
    [28, 29, 17]
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

__all__ = ["prompt_lengths", "build"]


def prompt_lengths(n: int, seed: int = 0, low: int = 16, high: int = 32) -> list[int]:
    """``n`` prompt lengths drawn uniformly from ``low..high`` (inclusive) with ``seed``."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def build(out: str | Path, prompts: int = 32, seed: int = 0, *, layers: int = 8, hidden: int = 512,
          intermediate: int = 1376, heads: int = 8, vocab: int = 32000) -> Path:
    """Save the model (fp32, seeded random weights) and ``prompts.json`` into ``out`` (the
    defaults are the must-show's sizes; tests pass smaller ones)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).eval().save_pretrained(out)
    rng = random.Random(seed + 1)
    ids = [[rng.randrange(3, config.vocab_size) for _ in range(n)] for n in prompt_lengths(prompts, seed)]
    (out / "prompts.json").write_text(json.dumps(ids))
    return out


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else ".scratch/llama8x512"))
