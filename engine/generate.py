"""Pipelined generation: a forward-only schedule through the pipeline ranks, with a KV cache per
stage, the prompts batched into microbatches so that the stages stay busy.

One chunk per rank. The schedule runs rounds ``k = 0 .. K-1`` (round 0 is the prefill of the
prompts, every later round decodes one token) and in every round the microbatches in order:

    rank 0      takes microbatch i's prompts (round 0) or the tokens the last rank sampled for
                it in the previous round, runs its chunk with microbatch i's cache, sends on
    rank s      receives microbatch i's hidden states, runs its chunk, sends on
    rank p-1    runs its chunk, samples the next token (greedy, or temperature / top-k / top-p
                with a per-prompt seeded generator) and sends it back to rank 0

so with ``m >= p`` microbatches, microbatch i's step on stage s overlaps microbatch j's on stage
s+1, and rank 0 finds microbatch i's token waiting when it comes back to it. Transfers use
``engine.comm.P2P`` (the token feedback is the channel from the last chunk to rank 0); every
round renews the shape handshake, since the prefill and the decode steps differ in length.

Prompts of different lengths are left-padded to the longest; the 2D mask ``[b, past + q]``
(0 = padding) goes to every chunk with its input, and the model side derives positions and the
causal mask from it. The engine knows nothing of the model: the model side passes a factory
that turns a rank's layers into a :class:`CachedChunk` (docs/contracts.md, "engine.generate").

Example (inside a worker started by ``engine.launch``)::

    gen = Generator(spec.layers, [(0, 3), (3, 6)], chunk=spec.cached_chunk, ties=spec.ties)
    out = gen.generate([[5, 6, 7], [8, 9]], max_new_tokens=16,
                       sampling=SamplingConfig(do_sample=True, top_p=0.9, seed=1))
    out.tokens        # [[...16 new tokens...], [...]] on every rank
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine.comm import P2P
from engine.mesh import Mesh
from engine.runtime import check_stage_ranges
from engine.stage import build_layers

__all__ = ["CachedChunk", "SamplingConfig", "GenerationResult", "Generator", "filter_logits",
           "sample_next", "left_pad", "check_prompts", "trim_at_eos"]


@runtime_checkable
class CachedChunk(Protocol):
    """The model side of generation: one rank's layers, run with a KV cache.

    ``new_cache(batch_size)`` returns an empty cache for one microbatch.
    ``chunk(x, cache, mask)`` runs the layers on the new positions and updates ``cache``:
    ``x`` is token ids ``[b, q]`` (int64) on the first chunk, else what the previous chunk
    returned; ``mask`` is ``[b, past + q]`` (1 = token, 0 = left padding) over the cached and
    the new positions. The last chunk returns logits ``[b, q', vocab]`` whose last position
    scores the next token (``q'`` may be 1); the others a tensor or a flat tuple of tensors for
    the next chunk.
    """

    def new_cache(self, batch_size: int) -> Any: ...

    def __call__(self, x: Any, cache: Any, mask: Tensor) -> Any: ...


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy (``do_sample=False``) or sampling with temperature, top-k (0 = off) and top-p
    (1.0 = off), applied in that order. ``seed``: prompt j samples from its own generator seeded
    with ``seed * 1_000_003 + j``, so the tokens do not depend on stages or microbatching."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}; use do_sample=False "
                             "for greedy decoding")
        if int(self.top_k) < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")


@dataclass
class GenerationResult:
    tokens: list[list[int]]      # new tokens per prompt (cut after the first eos, if any)
    new_tokens: int              # tokens computed: prompts x max_new_tokens
    wall_s: float                # first forward to last sample (the last rank's clock)
    tokens_per_s: float
    microbatches: int
    stats: dict = field(default_factory=dict)   # this rank's forward_s, comm_wait_s


def filter_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Logits ``[b, v]`` scaled by the temperature, then outside the top-k, then outside the
    smallest set with probability >= top_p set to -inf (the most likely token always stays).

    >>> filter_logits(torch.tensor([[1.0, 3.0, 2.0]]), top_k=2).tolist()
    [[-inf, 3.0, 2.0]]
    """
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1)
        cum = ordered.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_next(logits: Tensor, sampling: SamplingConfig, generators: Sequence[torch.Generator] | None = None
                ) -> Tensor:
    """Next token per row of ``logits`` ``[b, v]``: argmax, or a draw from the filtered
    distribution with row r's generator."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    probs = filter_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p).softmax(-1)
    gens = generators or [None] * probs.shape[0]
    return torch.cat([torch.multinomial(probs[r], 1, generator=gens[r]) for r in range(probs.shape[0])])


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Token ids and mask ``[n, longest]``, prompts aligned right (left padding).

    >>> ids, mask = left_pad([[5, 6], [7]], 0)
    >>> ids.tolist(), mask.tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), int(pad_token_id), dtype=torch.int64)
    mask = torch.zeros((len(prompts), longest), dtype=torch.int64)
    for r, p in enumerate(prompts):
        if p:
            ids[r, longest - len(p):] = torch.tensor(list(p), dtype=torch.int64)
            mask[r, longest - len(p):] = 1
    return ids, mask


def check_prompts(prompts: Any, max_new_tokens: int, *, vocab: int | None = None,
                  max_positions: int | None = None) -> list[list[int]]:
    """The prompts as lists of ints, checked (non-empty, ids in the vocabulary, room for the new
    tokens when positions are limited); raises ValueError saying how to fix it."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists, e.g. [[1, 2, 3], [4, 5]]")
    out = []
    for j, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not p:
            raise ValueError(f"prompt {j} is {p!r}; each prompt must be a non-empty list of token ids")
        ids = [int(t) for t in p]
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"prompt {j} has token ids {bad[:5]} outside the vocabulary 0..{(vocab or 1) - 1}")
        out.append(ids)
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in out)
    if max_positions is not None and longest + int(max_new_tokens) > max_positions:
        raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"the model's {max_positions} positions; shorten the prompts or generate fewer tokens")
    return out


def trim_at_eos(tokens: Sequence[int], eos_token_id: int | Sequence[int] | None) -> list[int]:
    """The tokens up to and including the first end-of-sequence token.

    >>> trim_at_eos([4, 2, 7], 2)
    [4, 2]
    """
    stops = set() if eos_token_id is None else (
        {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id})
    out = []
    for t in tokens:
        out.append(int(t))
        if t in stops:
            break
    return out


class Generator:
    """One rank's part of pipelined generation: builds its own layers (from factories, seeded
    per global layer like ``Pipeline``), ties parameters shared across ranks, and runs
    :meth:`generate`. ``chunk``: the model's factory from a list of layers to a
    :class:`CachedChunk` (e.g. ``ModelSpec.cached_chunk``)."""

    def __init__(self, layers: Any, stage_ranges: Sequence[Sequence[int]], *,
                 chunk: Callable[[list[nn.Module]], CachedChunk], seed: int = 0,
                 device: torch.device | str | None = None, ties: Sequence[tuple[str, str]] = (),
                 comm_timeout_s: float = 60.0):
        p = len(stage_ranges)
        self.ranges = check_stage_ranges(stage_ranges, len(layers), p)
        self.mesh = Mesh(p, 1)
        self.num_stages = p
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if self.mesh.backend == "nccl"
            else torch.device("cpu"))
        me = self.mesh.pipeline_rank
        from engine.launch import set_worker_info
        set_worker_info(stage=me, replica=0)
        self.start, stop = self.ranges[me]
        self.layers = build_layers(layers, self.start, stop, seed, self.device)
        for layer in self.layers:
            layer.eval()
        self._tie(ties)
        self.chunk = chunk(self.layers)
        self.p2p = P2P(self.mesh, comm_timeout_s, self.device)

    def _owner(self, layer: int) -> int:
        return next(s for s, (a, b) in enumerate(self.ranges) if a <= layer < b)

    def _param(self, layer: int, name: str) -> tuple[nn.Module, str, nn.Parameter]:
        owner, _, leaf = name.rpartition(".")
        mod = self.layers[layer - self.start]
        mod = mod.get_submodule(owner) if owner else mod
        return mod, leaf, getattr(mod, leaf)

    def _tie(self, ties: Sequence[tuple[str, str]]) -> None:
        """Tied parameters hold the first one's value: one object on one rank, a broadcast
        copy across ranks (as ``Pipeline`` does)."""
        me = self.mesh.pipeline_rank
        for a, b in ties:
            (la, _, na), (lb, _, nb) = a.partition("."), b.partition(".")
            la, lb = int(la), int(lb)
            ra, rb = self._owner(la), self._owner(lb)
            if ra == rb:
                if me == ra:
                    mod, leaf, _ = self._param(lb, nb)
                    setattr(mod, leaf, self._param(la, na)[2])
                continue
            group = dist.new_group([ra, rb])
            if me in (ra, rb):
                prm = self._param(la, na)[2] if me == ra else self._param(lb, nb)[2]
                with torch.no_grad():
                    dist.broadcast(prm.data, src=self.mesh.global_rank(ra), group=group)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 sampling: SamplingConfig | None = None, microbatches: int | None = None,
                 pad_token_id: int = 0, eos_token_id: int | Sequence[int] | None = None) -> GenerationResult:
        """Generate ``max_new_tokens`` for every prompt (collective over the pipeline ranks;
        every rank passes the same arguments and gets the same result). ``microbatches``:
        default the number of stages (at most one per prompt)."""
        sampling = sampling or SamplingConfig()
        sampling.check()
        rows = check_prompts(prompts, max_new_tokens)
        n, k = len(rows), int(max_new_tokens)
        m = max(1, min(int(microbatches or self.num_stages), n))
        size = math.ceil(n / m)
        rows = rows + [rows[-1]] * (m * size - n)  # equal microbatches; the filler is dropped
        ids, mask = left_pad(rows, pad_token_id)
        last = self.mesh.pipeline_rank == self.num_stages - 1
        gens = None
        if last and sampling.do_sample:
            gens = [torch.Generator(device=self.device).manual_seed(sampling.seed * 1_000_003 + j)
                    for j in range(len(rows))]
        if self.mesh.distributed and self.mesh.world_size > 1:
            dist.barrier(group=self.mesh.pipeline_group)
        wait0 = self.p2p.wait_s
        t0 = time.perf_counter()
        out, fwd = self._run(ids.to(self.device).split(size), mask.to(self.device).split(size), k, sampling, gens)
        wall = time.perf_counter() - t0
        payload = [[out[:n].tolist(), wall] if last else None]
        if self.mesh.distributed and self.mesh.world_size > 1:
            dist.broadcast_object_list(payload, src=self.mesh.last_rank, group=self.mesh.pipeline_group)
        tokens, wall = payload[0]
        tokens = [trim_at_eos(t, eos_token_id) for t in tokens]
        return GenerationResult(tokens, n * k, wall, n * k / wall if wall > 0 else float("inf"), m,
                                {"forward_s": fwd, "comm_wait_s": self.p2p.wait_s - wait0,
                                 "pipeline_rank": self.mesh.pipeline_rank})

    @torch.no_grad()
    def _run(self, ids: Sequence[Tensor], masks: Sequence[Tensor], rounds: int, sampling: SamplingConfig,
             gens: list[torch.Generator] | None) -> tuple[Tensor | None, float]:
        p, me, m = self.num_stages, self.mesh.pipeline_rank, len(ids)
        first, last = me == 0, me == p - 1
        caches = [self.chunk.new_cache(x.shape[0]) for x in ids]
        masks = list(masks)
        feed: list[Any] = list(ids)           # rank 0's next inputs when it is also the last rank
        sampled: list[list[Tensor]] = [[] for _ in range(m)]
        fwd = 0.0
        for k in range(rounds):
            self.p2p.new_step(speculate=False)  # prefill and decode shapes differ each round
            for i in range(m):
                if first and (k == 0 or p == 1):
                    x = feed[i]
                elif first:  # the token the last rank sampled for microbatch i last round
                    x = self.p2p.post("F", p, (k - 1) * m + i, p - 1).wait()
                else:
                    x = self.p2p.post("F", me, k * m + i, me - 1).wait()
                t = time.perf_counter()
                y = self.chunk(x, caches[i], masks[i])
                if last:
                    rows = gens[i * len(masks[i]):(i + 1) * len(masks[i])] if gens else None
                    tok = sample_next(y[:, -1, :], sampling, rows).unsqueeze(1)
                    sampled[i].append(tok)
                    if p == 1:
                        feed[i] = tok
                    elif k < rounds - 1:
                        self.p2p.send("F", p - 1, k * m + i, tok, 0)
                else:
                    self.p2p.send("F", me, k * m + i, y, me + 1)
                self.p2p.flush()  # NCCL batches: issue the send now, so the next rank can start
                fwd += time.perf_counter() - t
                masks[i] = torch.cat([masks[i], masks[i].new_ones(masks[i].shape[0], 1)], dim=1)
        self.p2p.wait_sends()
        out = torch.cat([torch.cat(s, dim=1) for s in sampled]).cpu() if last else None
        return out, fwd
