"""Pipelined generation: continuous microbatching through the pipeline ranks, a KV cache per
lane per stage, so that every stage stays busy.

The prompts go into ``microbatches`` lanes (at most ``microbatch_size`` prompts each), shortest
first, so that a lane's prompts need little left padding. Rank 0
drives: it runs a lane step on its chunk (a prefill of the lane's prompts, or one decode step)
and sends the output on with a control tensor naming the step and the lane's prompts; ranks
1..p-1 apply the same step to their copy of the lane and send on; the last rank samples (greedy,
or temperature / top-k / top-p with a per-prompt seeded generator) and sends the tokens back to
rank 0. Rank 0 takes the lanes in the order their tokens return, so while rank 1 decodes lane A
rank 0 decodes lane B. A prompt that reaches its eos or ``max_new_tokens`` leaves its lane (the
chunk's ``select_rows`` drops its cache rows); a lane left empty takes the next waiting prompts.

Prompts of a lane are left-padded to its longest; the 2D mask ``[b, past + q]`` (0 = padding)
goes to every chunk with its input, and the model side derives positions and the causal mask
from it. The engine knows nothing of the model: the model side passes a factory that turns a
rank's layers into a :class:`CachedChunk` (docs/contracts.md, "engine.generate").

Example (inside a worker started by ``engine.launch``)::

    gen = Generator(spec.layers, [(0, 3), (3, 6)], chunk=spec.cached_chunk, ties=spec.ties)
    out = gen.generate([[5, 6, 7], [8, 9]], max_new_tokens=16,
                       sampling=SamplingConfig(do_sample=True, top_p=0.9, seed=1))
    out.tokens        # [[...16 new tokens...], [...]] on every rank
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine.comm import P2P, flatten
from engine.mesh import Mesh
from engine.runtime import check_stage_ranges
from engine.stage import build_layers

__all__ = ["CachedChunk", "SamplingConfig", "GenerationResult", "Generator", "filter_logits",
           "sample_next", "left_pad", "check_prompts", "trim_at_eos", "cast_parameters"]


@runtime_checkable
class CachedChunk(Protocol):
    """The model side of generation: one rank's layers, run with a KV cache.

    ``new_cache(batch_size)`` returns an empty cache for one microbatch.
    ``chunk(x, cache, mask)`` runs the layers on the new positions and updates ``cache``:
    ``x`` is token ids ``[b, q]`` (int64) on the first chunk, else what the previous chunk
    returned; ``mask`` is ``[b, past + q]`` (1 = token, 0 = left padding) over the cached and
    the new positions. The last chunk returns logits ``[b, q', vocab]`` whose last position
    scores the next token (``q'`` may be 1); the others a tensor or a flat tuple of tensors for
    the next chunk. Optional: ``select_rows(cache, index)`` returns the cache of the rows
    ``index`` only, so that finished prompts leave their lane.
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


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module``'s floating-point parameters in ``dtype``, its buffers left as they are (a
    rotary ``inv_freq`` stays fp32, as in a transformers model loaded with that dtype).

    >>> cast_parameters(nn.Linear(2, 2), torch.bfloat16).weight.dtype
    torch.bfloat16
    """
    for prm in module.parameters():
        if prm.is_floating_point():
            prm.data = prm.data.to(dtype)
    return module


class Generator:
    """One rank's part of pipelined generation: builds its own layers (from factories, seeded
    per global layer like ``Pipeline``), ties parameters shared across ranks, and runs
    :meth:`generate`. ``chunk``: the model's factory from a list of layers to a
    :class:`CachedChunk` (e.g. ``ModelSpec.cached_chunk``)."""

    def __init__(self, layers: Any, stage_ranges: Sequence[Sequence[int]], *,
                 chunk: Callable[[list[nn.Module]], CachedChunk], seed: int = 0,
                 device: torch.device | str | None = None, ties: Sequence[tuple[str, str]] = (),
                 comm_timeout_s: float = 60.0, dtype: torch.dtype | None = None):
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
        if dtype is not None:
            for layer in self.layers:
                cast_parameters(layer, dtype)
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
                 microbatch_size: int | None = None, pad_token_id: int = 0,
                 eos_token_id: int | Sequence[int] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` for every prompt, a prompt stopping at its first
        ``eos_token_id`` (collective over the pipeline ranks; every rank passes the same arguments
        and gets the same result). ``microbatches``: lanes decoded concurrently (default: the
        number of stages); ``microbatch_size``: most prompts in a lane at once (default: all the
        prompts fit); the other prompts enter a lane as its prompts finish."""
        sampling = sampling or SamplingConfig()
        sampling.check()
        rows = check_prompts(prompts, max_new_tokens)
        n, k = len(rows), int(max_new_tokens)
        lanes = max(1, min(int(microbatches or self.num_stages), n))
        size = int(microbatch_size or math.ceil(n / lanes))
        if size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
        stops = set() if eos_token_id is None else (
            {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id})
        run = _Run(self, rows, k, size, int(pad_token_id), stops, sampling)
        if self.mesh.distributed and self.mesh.world_size > 1:
            dist.barrier(group=self.mesh.pipeline_group)
        t0, cpu0 = time.perf_counter(), time.process_time()
        out = run.control(lanes) if self.mesh.pipeline_rank == 0 else run.follow()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        payload = [[out, wall]]
        if self.mesh.distributed and self.mesh.world_size > 1:
            dist.broadcast_object_list(payload, src=self.mesh.global_rank(0), group=self.mesh.pipeline_group)
        tokens, wall = payload[0]
        new = sum(len(t) for t in tokens)
        return GenerationResult(tokens, new, wall, new / wall if wall > 0 else float("inf"), lanes,
                                {"forward_s": run.forward_s, "comm_wait_s": run.wait_s(), "cpu_s": cpu,
                                 "lane_steps": run.steps, "pipeline_rank": self.mesh.pipeline_rank})


STOP, PREFILL, DECODE = 0, 1, 2   # what a lane step does (the first slot of its control tensor)
_CTRL = 4                          # op, lane, rows, payload is a tuple; then the rows' prompt indices


@dataclass
class _Lane:
    """One lane on one rank: the prompts in its rows, its KV cache and its 2D mask."""

    rows: list[int] = field(default_factory=list)
    cache: Any = None
    mask: Tensor | None = None


class _Link:
    """One channel of generation messages, with a ``P2P`` of its own: every message is its own
    step, so it travels packed with its header when its shapes equal the previous message's
    (decode steps of equal lanes), and alone after its header when they changed."""

    def __init__(self, gen: "Generator", boundary: int, peer: int, lag: int) -> None:
        self.p2p = P2P(gen.mesh, gen.p2p.timeout_s, gen.device)
        self.boundary, self.peer, self.lag, self.n = boundary, peer, lag, 0

    def send(self, value: Any) -> None:
        self.p2p.new_step()
        self.p2p.send("F", self.boundary, self.n, value, self.peer)
        self.p2p.flush()
        self.n += 1
        self.p2p.wait_sends(keep_last=self.lag)  # the old ones are long received: no wait

    def post(self) -> Any:
        """Post the next message's receive (after the previous one was waited)."""
        self.p2p.new_step()
        r = self.p2p.post("F", self.boundary + 1, self.n, self.peer)
        self.p2p.flush()
        self.n += 1
        return r


class _Run:
    """One rank's part of one ``generate`` call. Rank 0 decides every lane step (:meth:`control`):
    which prompts a lane holds (a prefill when a lane (re)starts, then decode steps, the rows that
    finished dropped), runs its chunk and sends the output downstream with a control tensor; the
    other ranks (:meth:`follow`) apply the same step to their copy of the lane; the last samples
    and sends the tokens back to rank 0, which thus has lane B's step to run while lane A's runs
    downstream."""

    def __init__(self, gen: "Generator", prompts: list[list[int]], k: int, size: int, pad: int,
                 stops: set[int], sampling: SamplingConfig) -> None:
        self.gen, self.prompts, self.k, self.size, self.pad = gen, prompts, k, size, pad
        self.stops, self.sampling = stops, sampling
        p, me = gen.num_stages, gen.mesh.pipeline_rank
        self.p, self.last = p, me == p - 1
        self.select = getattr(gen.chunk, "select_rows", None)
        lag = 8 * (p + 4)
        self.down = _Link(gen, me, me + 1, lag) if me < p - 1 else None
        self.up = _Link(gen, me - 1, me - 1, lag) if me > 0 else None
        self.back = _Link(gen, p - 1, 0, lag) if p > 1 and self.last else None
        self.fb = _Link(gen, p - 1, p - 1, lag) if p > 1 and me == 0 else None
        self.gens = None
        if self.last and sampling.do_sample:
            self.gens = [torch.Generator(device=gen.device).manual_seed(sampling.seed * 1_000_003 + j)
                         for j in range(len(prompts))]
        self.lanes: dict[int, _Lane] = {}
        self.local: list[Tensor] = []  # the sampled tokens when rank 0 is also the last rank
        self.forward_s, self.steps = 0.0, 0

    def wait_s(self) -> float:
        return sum(link.p2p.wait_s for link in (self.down, self.up, self.back, self.fb) if link is not None)

    def _enter(self, lane: _Lane, op: int, rows: list[int]) -> Tensor | None:
        """Apply a step's rows to this rank's lane; the token ids of a prefill."""
        dev = self.gen.device
        if op == PREFILL:
            ids, mask = left_pad([self.prompts[j] for j in rows], self.pad)
            lane.rows, lane.cache, lane.mask = rows, self.gen.chunk.new_cache(len(rows)), mask.to(dev)
            return ids.to(dev)
        if rows != lane.rows:  # finished prompts leave the lane
            idx = torch.tensor([lane.rows.index(j) for j in rows], device=dev)
            lane.cache = self.select(lane.cache, idx)
            lane.mask, lane.rows = lane.mask[idx], rows
        lane.mask = torch.cat([lane.mask, lane.mask.new_ones(lane.mask.shape[0], 1)], dim=1)
        return None

    def _step(self, lane_id: int, op: int, rows: list[int], x: Any) -> None:
        """Run this rank's chunk for one lane step, then send on (or sample, on the last rank)."""
        t = time.perf_counter()
        y = self.gen.chunk(x, self.lanes[lane_id].cache, self.lanes[lane_id].mask)
        self.steps += 1
        if self.last:
            gens = [self.gens[j] for j in rows] if self.gens else None
            tok = sample_next(y[:, -1, :], self.sampling, gens)
            self.forward_s += time.perf_counter() - t
            if self.back is not None:
                self.back.send(tok)
            else:
                self.local.append(tok)
            return
        is_tuple, ts = flatten(y)
        ctrl = torch.full((_CTRL + self.size,), -1, dtype=torch.int64)
        ctrl[:_CTRL] = torch.tensor([op, lane_id, len(rows), int(is_tuple)])
        ctrl[_CTRL:_CTRL + len(rows)] = torch.tensor(rows)
        self.forward_s += time.perf_counter() - t
        self.down.send((ctrl.to(self.gen.device), *ts))

    def _issue(self, lane_id: int, op: int, rows: list[int], x: Tensor | None, inflight: deque) -> None:
        ids = self._enter(self.lanes[lane_id], op, rows)
        inflight.append(lane_id)
        if self.fb is not None and self._fb_next is None:  # post the answer's receive before computing
            self._fb_next = self.fb.post()
        self._step(lane_id, op, rows, ids if op == PREFILL else x)

    def _feedback(self, more: bool) -> Tensor:
        """The tokens sampled for the oldest lane step in flight (``more``: others follow it)."""
        if self.fb is None:
            return self.local.pop(0)
        toks = self._fb_next.wait()
        self._fb_next = self.fb.post() if more else None
        return toks

    def control(self, lanes: int) -> list[list[int]]:
        """Rank 0: admit the prompts into lanes, decide and run every lane step, collect the
        tokens; a prompt is done at ``k`` tokens or an eos, a lane refills when all its are."""
        # shortest first: a lane's prompts have similar lengths (less left padding to compute)
        # and the first prefill, which the downstream ranks wait for, is the shortest
        pending = deque(sorted(range(len(self.prompts)), key=lambda j: len(self.prompts[j])))
        out: list[list[int]] = [[] for _ in self.prompts]
        done = [False] * len(self.prompts)
        inflight: deque[int] = deque()
        self._fb_next = None
        n = len(self.prompts)
        for lane_id in range(lanes):  # the first prompts spread evenly over the lanes
            take = min(self.size, n // lanes + (lane_id < n % lanes))
            self.lanes[lane_id] = _Lane()
            self._issue(lane_id, PREFILL, [pending.popleft() for _ in range(take)], None, inflight)
        while inflight:
            lane_id = inflight.popleft()
            toks = self._feedback(bool(inflight))
            lane = self.lanes[lane_id]
            for j, t in zip(lane.rows, toks.tolist()):
                if not done[j]:
                    out[j].append(int(t))
                    done[j] = len(out[j]) >= self.k or int(t) in self.stops
            active = [j for j in lane.rows if not done[j]]
            if active:  # without select_rows the finished rows run on, their tokens unused
                rows = active if self.select is not None else lane.rows
                idx = torch.tensor([lane.rows.index(j) for j in rows], device=toks.device)
                self._issue(lane_id, DECODE, rows, toks[idx].unsqueeze(1), inflight)
            elif pending:
                self._issue(lane_id, PREFILL, [pending.popleft() for _ in range(min(self.size, len(pending)))],
                            None, inflight)
        if self.down is not None:
            stop = torch.full((_CTRL + self.size,), -1, dtype=torch.int64)
            stop[:_CTRL] = torch.tensor([STOP, 0, 0, 0])
            self.down.send((stop.to(self.gen.device),))
        self._finish()
        return out

    def follow(self) -> None:
        """Ranks 1..p-1: apply rank 0's lane steps in the order they arrive, until its stop."""
        r = self.up.post()
        while True:
            value = r.wait()
            ctrl = value[0]
            op, lane_id, nrows, is_tuple = ctrl[:_CTRL].tolist()
            if op == STOP:
                if self.down is not None:
                    self.down.send((ctrl,))
                break
            r = self.up.post()
            rows = ctrl[_CTRL:_CTRL + nrows].tolist()
            lane = self.lanes.setdefault(lane_id, _Lane())
            self._enter(lane, op, rows)
            self._step(lane_id, op, rows, tuple(value[1:]) if is_tuple else value[1])
        self._finish()

    def _finish(self) -> None:
        for link in (self.down, self.up, self.back, self.fb):
            if link is not None:
                link.p2p.wait_sends()
