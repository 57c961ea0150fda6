"""How a chunk of Hugging Face pipeline layers runs with a KV cache (the model side of
`engine.generate`; implements its `CachedChunk` protocol).

The engine hands a chunk its input (token ids on the first chunk, hidden states after), the
chunk's cache, and the 2D attention mask `[b, past + q]` (0 = left padding) covering the cache
and the new positions. From the mask the chunk derives what transformers' `generate` does:
position ids `cumsum(mask) - 1` (0 on padding), the causal (and sliding-window) 4D mask, and the
rotary embeddings (computed once per call, shared by the chunk's blocks). The cache is a
transformers `DynamicCache`; each decoder layer writes its own slot (its global layer index).

Example:
    >>> chunk = HFCachedChunk(layers)                    # doctest: +SKIP
    >>> cache = chunk.new_cache(batch_size=2)            # doctest: +SKIP
    >>> logits = chunk(ids, cache, mask)                 # doctest: +SKIP
    >>> logits = chunk(next_ids, cache, mask_plus_one)   # doctest: +SKIP

(prefill: ids ``[2, L]``, mask ``[2, L]``; decode: ids ``[2, 1]``, mask ``[2, L + 1]``)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from experiments.models.hf import HFBlock, HFHead, HFTokenEmbedding, attention_mask

__all__ = ["HFCachedChunk", "position_ids"]


def position_ids(mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """Positions of the last `q_len` columns of a left-padded mask, as transformers' generate
    computes them: `cumsum - 1`, 0 on padding.

    >>> position_ids(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), 2).tolist()
    [[0, 1], [2, 3]]
    """
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 0)[:, mask.shape[1] - q_len:]


class HFCachedChunk:
    """Runs a list of HF pipeline layers (`HFTokenEmbedding`, `HFBlock`s, `HFHead`) with a cache."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        kinds = (HFTokenEmbedding, HFBlock, HFHead)
        bad = [type(m).__name__ for m in self.layers if not isinstance(m, kinds)]
        if bad:
            raise TypeError(f"HFCachedChunk runs HF pipeline layers only, got {bad}")

    def new_cache(self, batch_size: int) -> Any:
        """An empty cache for one microbatch (grows as tokens arrive)."""
        from transformers import DynamicCache

        return DynamicCache()

    def select_rows(self, cache: Any, index: torch.Tensor) -> Any:
        """The cache of the rows ``index`` only (finished prompts leave a lane)."""
        cache.batch_select_indices(index)
        return cache

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, cache: Any, mask: torch.Tensor) -> torch.Tensor:
        q = x.shape[1]
        pos = position_ids(mask, q)
        masks: dict[int | None, torch.Tensor | None] = {}
        rotary: Any = None
        for layer in self.layers:
            if isinstance(layer, HFTokenEmbedding):
                x = layer(x, pos)
            elif isinstance(layer, HFBlock):
                if layer.window not in masks:
                    masks[layer.window] = attention_mask(mask, q, layer.window)
                if rotary is None and layer.rotary is not None:
                    rotary = layer.position_embeddings(x, pos)
                x = layer.run(x, mask=masks[layer.window], position_ids=pos, cache=cache,
                              position_embeddings=rotary)
            else:  # the head: only the last position's logits are used (as transformers' generate)
                x = layer.logits(x[:, -1:])
        return x
