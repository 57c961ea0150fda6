"""engine.generate, model-agnostic: a toy causal model with its own cache format (no
transformers) generates through 1 and 3 pipeline ranks exactly what recomputing the whole
sequence at every step gives, for left-padded prompts of different lengths, with an embedding
tied to the head across the first and last rank; plus the sampling, padding and prompt checks.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from dist_helpers import run_workers

from engine.generate import (Generator, SamplingConfig, cast_parameters, check_prompts, filter_logits,
                             left_pad, sample_next, trim_at_eos)

V, D = 40, 16
PROMPTS = [[3, 4, 5], [7], [9, 1, 2, 8, 6], [11, 12], [5, 5, 5, 5]]


class Mix(nn.Module):
    """x_t + tanh(W mean_{j <= t, unmasked} x_j): causal, attends over the unpadded prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, state: tuple | None = None) -> tuple:
        m = mask[:, -x.shape[1]:, None].to(x.dtype)
        s0, c0 = state if state is not None else (torch.zeros_like(x[:, :1]), torch.zeros_like(m[:, :1]))
        s = s0 + (x * m).cumsum(1)
        c = c0 + m.cumsum(1)
        return x + torch.tanh(self.lin(s / c.clamp(min=1))), (s[:, -1:], c[:, -1:])


def factories() -> list:
    return [lambda: nn.Embedding(V, D), Mix, Mix, Mix, lambda: nn.Linear(D, V, bias=False)]


TIES = [("0.weight", "4.weight")]


class ToyChunk:
    """The toy's side of the CachedChunk protocol: its cache is {layer: (running sum, count)}."""

    def __init__(self, layers: list) -> None:
        self.layers = layers

    def new_cache(self, batch_size: int) -> dict:
        return {}

    def __call__(self, x, cache, mask):
        for j, layer in enumerate(self.layers):
            if isinstance(layer, Mix):
                x, cache[j] = layer(x, mask, cache.get(j))
            else:
                x = layer(x)
        return x


class SelectingChunk(ToyChunk):
    """The toy with ``select_rows``: finished prompts leave their lane."""

    def select_rows(self, cache: dict, index: torch.Tensor) -> dict:
        return {j: (s[index], c[index]) for j, (s, c) in cache.items()}


def reference(steps: int) -> list[list[int]]:
    """Greedy decoding recomputing the whole (left-padded) sequence at every step, one module."""
    layers = []
    for i, f in enumerate(factories()):
        torch.manual_seed(i)
        layers.append(f())
    layers[4].weight = layers[0].weight
    ids, mask = left_pad(PROMPTS, 0)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            x = ids
            for layer in layers:
                x = layer(x, mask)[0] if isinstance(layer, Mix) else layer(x)
            nxt = x[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    return torch.cat(out, 1).tolist()


def _worker(ranges: list, microbatches: int) -> dict:
    torch.set_num_threads(1)
    gen = Generator(factories(), ranges, chunk=ToyChunk, ties=TIES)
    greedy = gen.generate(PROMPTS, 7, microbatches=microbatches)
    sampled = gen.generate(PROMPTS, 5, microbatches=microbatches,
                           sampling=SamplingConfig(do_sample=True, top_p=0.8, seed=3))
    return {"greedy": greedy.tokens, "sampled": sampled.tokens, "stats": greedy.stats}


def test_one_rank_equals_recomputing_the_sequence():
    out = _worker([(0, 5)], 2)
    assert out["greedy"] == reference(7)


def test_three_ranks_equal_one():
    one = _worker([(0, 5)], 1)
    results = run_workers(_worker, 3, [(0, 2), (2, 4), (4, 5)], 3)
    for r in results:
        assert r["greedy"] == reference(7)
        assert r["sampled"] == one["sampled"]
    assert [r["stats"]["pipeline_rank"] for r in results] == [0, 1, 2]


def _lanes_worker(ranges: list, eos: int, size: int | None) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, chunk in (("select", SelectingChunk), ("no_select", ToyChunk)):
        gen = Generator(factories(), ranges, chunk=chunk, ties=TIES)
        res = gen.generate(PROMPTS, 7, microbatches=2, microbatch_size=size, eos_token_id=eos)
        out[name] = {"tokens": res.tokens, "new": res.new_tokens, "steps": res.stats["lane_steps"]}
    return out


@pytest.mark.parametrize("size", [None, 2])
def test_eos_stops_a_prompt_and_lanes_refill(size):
    """A prompt stops at its eos, the others go on; with 2-prompt lanes the 5 prompts enter as
    lanes finish. Through 3 ranks and on one, with and without select_rows: the reference's
    tokens cut after the first eos."""
    ref = reference(7)
    eos = ref[2][1]  # prompt 2 stops after its second token; others may stop too
    want = [trim_at_eos(r, eos) for r in ref]
    assert any(len(w) < 7 for w in want) and any(len(w) == 7 for w in want)
    for res in [_lanes_worker([(0, 5)], eos, size)] + run_workers(_lanes_worker, 3, [(0, 2), (2, 4), (4, 5)], eos, size):
        for name in ("select", "no_select"):
            assert res[name]["tokens"] == want, name
            assert res[name]["new"] == sum(map(len, want))
        assert res["select"]["steps"] <= res["no_select"]["steps"]


def test_bf16_weights():
    layer = cast_parameters(nn.Linear(3, 3), torch.bfloat16)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
    gen = Generator(factories(), [(0, 5)], chunk=ToyChunk, ties=TIES, dtype=torch.bfloat16)
    assert {p.dtype for m in gen.layers for p in m.parameters()} == {torch.bfloat16}
    assert len(gen.generate(PROMPTS, 3).tokens[0]) == 3


def test_the_engine_does_not_import_transformers():
    root = Path(__file__).resolve().parents[2] / "engine"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "transformers" for n in names), path.name


def test_sampling_helpers():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    assert filter_logits(logits, top_p=1e-6).isinf().tolist() == [[True, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_k=2)).sum() == 2
    assert sample_next(logits, SamplingConfig()).tolist() == [1]
    g = [torch.Generator().manual_seed(0)]
    draws = {sample_next(logits, SamplingConfig(do_sample=True, top_k=2), g).item() for _ in range(50)}
    assert draws == {1, 2}
    for bad, msg in ((dict(temperature=0.0), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p")):
        with pytest.raises(ValueError, match=msg):
            SamplingConfig(do_sample=True, **bad).check()


def test_padding_eos_and_prompt_checks():
    ids, mask = left_pad([[1, 2, 3], [4]], 9)
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert trim_at_eos([5, 6, 7, 6], [7, 6]) == [5, 6] and trim_at_eos([1, 2], None) == [1, 2]
    assert check_prompts([(1, 2)], 3, vocab=5, max_positions=5) == [[1, 2]]
    for prompts, kw, msg in (([], {}, "non-empty list"), ([[]], {}, "prompt 0"), ([[7]], {"vocab": 5}, "outside"),
                             ([[1, 2, 3]], {"max_positions": 4}, "exceeds"), ("abc", {}, "non-empty list")):
        with pytest.raises(ValueError, match=msg):
            check_prompts(prompts, 2, **kw)
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_prompts([[1]], 0)
