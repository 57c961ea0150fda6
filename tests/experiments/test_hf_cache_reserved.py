"""The generation cache layer that reserves its buffers ahead holds exactly what transformers'
`DynamicLayer` holds: through a prefill, decode steps that outgrow the reservation, and rows
leaving the lane."""
import torch
from transformers.cache_utils import DynamicLayer

from experiments.models.hf_cache import HFCachedChunk, reserved_layer_class


def test_reserved_layer_equals_dynamic_layer():
    gen = torch.Generator().manual_seed(0)
    ours, ref = reserved_layer_class()(), DynamicLayer()
    steps = [torch.randn(3, 2, 5, 4, generator=gen)] + [torch.randn(3, 2, 1, 4, generator=gen) for _ in range(40)]
    reserved = []
    for j, k in enumerate(steps):
        if j == 20:  # row 1 leaves
            idx = torch.tensor([0, 2])
            ours.batch_select_indices(idx)
            ref.batch_select_indices(idx)
        if j >= 20:
            k = k[:2]
        got, want = ours.update(k, -k), ref.update(k, -k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert ours.get_seq_length() == ref.get_seq_length()
        reserved.append(ours.reserved)
    assert reserved[0] == 37 and max(reserved) > 37           # reserved ahead, then grown once
    assert len(set(reserved)) == 2


def test_chunk_cache_uses_reserved_layers():
    from transformers.cache_utils import Cache

    cache = HFCachedChunk([]).new_cache(2)
    assert isinstance(cache, Cache)
    cache.update(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4), 1)
    assert type(cache.layers[1]) is reserved_layer_class() and cache.get_seq_length(1) == 3


def test_decode_layout_keeps_the_head_logits():
    from torch import nn

    from experiments.models.hf import HFHead
    from experiments.models.hf_cache import decode_layout

    gen = torch.Generator().manual_seed(0)
    head = HFHead(nn.Identity(), nn.Linear(64, 3000, bias=False))
    weight = head.lm_head.weight
    hidden = torch.randn(16, 1, 64, generator=gen)
    with torch.no_grad():
        want = head.logits(hidden)
        assert decode_layout([head]) == ["0.lm_head.weight"]
        assert head.lm_head.weight is weight and weight.stride() == (1, 3000)
        assert torch.equal(head.logits(hidden), want)
    assert decode_layout([head]) == []                       # already column-major
    tied = HFHead(nn.Identity(), nn.Linear(64, 3000, bias=False))
    emb = nn.Embedding(3000, 64)
    tied.lm_head.weight = emb.weight
    holder = nn.Module()
    holder.emb = emb
    assert decode_layout([holder, tied]) == [] and emb.weight.is_contiguous()
