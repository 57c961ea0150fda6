"""Tiny GPT-like layers for the partitioner tests (independent of experiments/models)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Block(nn.Module):
    """Pre-LN block; attention written with contiguous bmm so saved tensors can be hand counted."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.h = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        return t.view(b, s, self.h, d // self.h).transpose(1, 2).contiguous().view(b * self.h, s, d // self.h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)
        q = self._heads(self.q(h)) * (1.0 / math.sqrt(d // self.h))
        k, v = self._heads(self.k(h)), self._heads(self.v(h))
        att = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        y = torch.bmm(att, v).view(b, self.h, s, d // self.h).transpose(1, 2).contiguous().view(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt_factories(vocab: int, dim: int, heads: int, layers: int, seq: int) -> list:
    return ([lambda: Embed(vocab, dim, seq)] + [lambda: Block(dim, heads) for _ in range(layers)]
            + [lambda: Head(dim, vocab)])


class TpMLP(nn.Module):
    """A residual MLP with a tensor-parallel plan (``engine.tp``'s ``tp_plan``): the up
    projection column-parallel, the down projection row-parallel (one all-reduce forward, one
    backward)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))

    def tp_plan(self, tp: int) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
