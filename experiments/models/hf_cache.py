"""How a chunk of Hugging Face pipeline layers runs with a KV cache (the model side of
`engine.generate`; implements its `CachedChunk` protocol).

The engine hands a chunk its input (token ids on the first chunk, hidden states after), the
chunk's cache, and the 2D attention mask `[b, past + q]` (0 = left padding) covering the cache
and the new positions. From the mask the chunk derives what transformers' `generate` does:
position ids `cumsum(mask) - 1` (0 on padding), the causal (and sliding-window) 4D mask, and the
rotary embeddings (computed once per call, shared by the chunk's blocks). The cache is a
transformers `DynamicCache` whose layers write each step's keys and
values into a buffer reserved ahead (:func:`reserved_layer_class`) (twice the length, at least 32 more positions) instead of
concatenating the whole cache anew at every step; each decoder layer writes its own slot (its
global layer index).

Example:
    >>> chunk = HFCachedChunk(layers)                    # doctest: +SKIP
    >>> cache = chunk.new_cache(batch_size=2)            # doctest: +SKIP
    >>> logits = chunk(ids, cache, mask)                 # doctest: +SKIP
    >>> logits = chunk(next_ids, cache, mask_plus_one)   # doctest: +SKIP

(prefill: ids ``[2, L]``, mask ``[2, L]``; decode: ids ``[2, 1]``, mask ``[2, L + 1]``)
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch import nn

from experiments.models.hf import HFBlock, HFHead, HFTokenEmbedding, attention_mask

__all__ = ["HFCachedChunk", "reserved_layer_class", "position_ids", "generation_refusal", "decode_layout"]

ATTENTION_TYPES = ("full_attention", "sliding_attention")
"""`config.layer_types` entries whose layers keep a key/value cache this chunk drives."""


def generation_refusal(model: nn.Module, layers: str) -> str | None:
    """Why the chunk cannot generate with a model (whose decoder layers are at `layers`), or
    None: every decoder layer must be an attention layer taking a KV cache (state-space and
    hybrid layers keep another cache and read a 2D mask: mamba, falcon_mamba, ...).

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
    ...                                      num_attention_heads=2, vocab_size=32))
    >>> generation_refusal(model, "model.layers") is None
    True
    """
    types = getattr(model.config, "layer_types", None) or []
    other = sorted({t for t in types if t not in ATTENTION_TYPES})
    if other:
        return f"layer types {other} keep a cache that pipeshard's generation does not drive (only {ATTENTION_TYPES})"
    for i, block in enumerate(model.get_submodule(layers)):
        if not (hasattr(block, "self_attn") or any("Attention" in type(m).__name__ for m in block.modules())):
            return (f"decoder layer {i} ({type(block).__name__}) has no attention module: its state-space or "
                    "recurrent cache is not one pipeshard's generation drives")
    return None


def position_ids(mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """Positions of the last `q_len` columns of a left-padded mask, as transformers' generate
    computes them: `cumsum - 1`, 0 on padding.

    >>> position_ids(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), 2).tolist()
    [[0, 1], [2, 3]]
    """
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 0)[:, mask.shape[1] - q_len:]


@functools.lru_cache(maxsize=None)
def reserved_layer_class() -> type:
    """The cache layer class of :class:`HFCachedChunk` (built on first use: transformers is
    imported lazily): a transformers `DynamicLayer` that reserves its buffers ahead.

    >>> layer = reserved_layer_class()()
    >>> k = torch.ones(1, 2, 3, 4)
    >>> keys, _ = layer.update(k, k)
    >>> keys, _ = layer.update(k[:, :, :1], k[:, :, :1])
    >>> tuple(keys.shape), layer.reserved, layer.get_seq_length()
    ((1, 2, 4, 4), 35, 4)
    """
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A `DynamicLayer` whose keys and values are views of the first `length` positions of
        buffers reserved ahead: a decode step writes one position (a `DynamicLayer` copies the
        whole cache into a new tensor with `torch.cat`): the same values, the same attention."""

        reserved = 0

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._k = self._v = None
            old = self.get_seq_length()
            new = old + key_states.shape[-2]
            if self._k is None or new > self._k.shape[-2]:
                self._reserve(new, key_states, value_states, old)
            self._k[:, :, old:new] = key_states
            self._v[:, :, old:new] = value_states
            self.keys, self.values = self._k[:, :, :new], self._v[:, :, :new]
            return self.keys, self.values

        def _reserve(self, new: int, key_states: torch.Tensor, value_states: torch.Tensor, old: int) -> None:
            size = max(2 * new, new + 32)
            k = key_states.new_empty(*key_states.shape[:2], size, key_states.shape[-1])
            v = value_states.new_empty(*value_states.shape[:2], size, value_states.shape[-1])
            if old:
                k[:, :, :old], v[:, :, :old] = self.keys, self.values
            self._k, self._v, self.reserved = k, v, size

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.get_seq_length() > 0:
                n = self.get_seq_length()
                self._k, self._v = self._k[indices], self._v[indices]
                self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise NotImplementedError("ReservedLayer: repeat the rows before the cache is filled")

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("ReservedLayer: cropping is not used by pipeshard's generation")

    return ReservedLayer


def decode_layout(layers: Sequence[nn.Module]) -> list[str]:
    """Store the LM head's fp32 weight of `layers` column-major on the CPU (the same values and
    parameter, strides swapped), where a decode step's `[rows, d] x [d, vocab]` product is
    faster: one thread, 16 rows, d=512, vocab 32000: 12.6-13.0 ms against 16.9-21 ms row-major
    (MKL reads a column-major weight without repacking it; docs/performance.md), and bit-identical
    outputs at 8-32 rows. Block weights gain nothing (and a 400-row prefill is slower), so they
    stay. A head whose weight another module of `layers` shares (a tied embedding) is left as
    it is. Returns the names of the weights changed ("<layer>.lm_head.weight").

    >>> from torch import nn
    >>> head = HFHead(nn.Identity(), nn.Linear(4, 6, bias=False))
    >>> decode_layout([head]), head.lm_head.weight.stride()
    (['0.lm_head.weight'], (1, 6))
    """
    changed = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, HFHead):
            continue
        w = layer.lm_head.weight
        shared = any(p is w for j, other in enumerate(layers) if j != i for p in other.parameters())
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 or shared or w.stride(0) == 1:
            continue
        w.data = w.data.t().contiguous().t()
        changed.append(f"{i}.lm_head.weight")
    return changed


class HFCachedChunk:
    """Runs a list of HF pipeline layers (`HFTokenEmbedding`, `HFBlock`s, `HFHead`) with a cache
    (the LM head's weight in the decode layout: :func:`decode_layout`)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        kinds = (HFTokenEmbedding, HFBlock, HFHead)
        bad = [type(m).__name__ for m in self.layers if not isinstance(m, kinds)]
        if bad:
            raise TypeError(f"HFCachedChunk runs HF pipeline layers only, got {bad}")
        decode_layout(self.layers)

    def new_cache(self, batch_size: int) -> Any:
        """An empty cache for one microbatch (grows as tokens arrive, into reserved buffers)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.layer_class_to_replicate = reserved_layer_class()
        return cache

    def select_rows(self, cache: Any, index: torch.Tensor) -> Any:
        """The cache of the rows ``index`` only (finished prompts leave a lane)."""
        cache.batch_select_indices(index)
        return cache

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, cache: Any, mask: torch.Tensor) -> torch.Tensor:
        q = x.shape[1]
        pos = position_ids(mask, q)
        masks: dict[int | None, torch.Tensor | None] = {}
        rotary: dict[str | None, Any] = {}   # per layer type (gemma3: local and global tables)
        for layer in self.layers:
            if isinstance(layer, HFTokenEmbedding):
                x = layer(x, pos)
            elif isinstance(layer, HFBlock):
                if layer.window not in masks:
                    masks[layer.window] = attention_mask(mask, q, layer.window)
                if layer.rotary is not None and layer.layer_type not in rotary:
                    rotary[layer.layer_type] = layer.position_embeddings(x, pos)
                x = layer.run(x, mask=masks[layer.window], position_ids=pos, cache=cache,
                              position_embeddings=rotary.get(layer.layer_type))
            else:  # the head: only the last position's logits are used (as transformers' generate)
                x = layer.logits(x[:, -1:])
        return x

