"""Collective times of the 3-D layout (pp x dp x tp): the links they run on and what they cost.

The mesh is ``(pp, dp, tp)`` with tp innermost (``engine.ranks.mesh_rank``): the ``t`` ranks of
a tensor-parallel group are neighbours, a data-parallel group (the replicas of one pipeline rank
and tp rank) is ``stages x tp`` ranks apart. A node holds ``gpus_per_node`` consecutive ranks;
a group inside one node runs on its NVLink (``"intra"``), a group spanning nodes on each GPU's
own NIC (``"inter"``: InfiniBand / RoCE; a ring is as fast as its slowest link), which
:func:`group_link` decides per layout. :class:`Links` holds both links' per-GPU bandwidth (one
direction), a latency per collective and the fraction of the bandwidth a collective reaches
(``efficiency``); the GPU presets (``partitioner.devices``) carry their datasheet figures
(docs/device-model.md sources each one), and the GPUs one node holds (``gpus_per_node``: which
groups and which pipeline neighbours share a node, :func:`group_link`, :func:`pipeline_hops`).

A pipeline transfer (one point-to-point message of ``B`` bytes between neighbouring stages) costs
``latency + B / bandwidth`` on its link (:meth:`Links.p2p`): NVLink when the two ranks share a
node, the sending GPU's NIC when they do not, nothing between two chunks on one rank.

Ring-algorithm costs over ``n`` ranks for a message of ``B`` bytes (the whole tensor), the
alpha-beta model NCCL's own tuning uses::

    all_reduce      = latency + 2 (n - 1) / n * B / (bandwidth * efficiency)
    all_gather      = latency +   (n - 1) / n * B / (bandwidth * efficiency)   # B: the gathered tensor
    reduce_scatter  = latency +   (n - 1) / n * B / (bandwidth * efficiency)   # B: the unreduced tensor

One rank (``n = 1``) costs nothing.

Example::

    >>> links = Links(intra_bytes_per_s=100e9, inter_bytes_per_s=10e9, intra_latency_s=0.0,
    ...               inter_latency_s=0.0, efficiency=1.0)
    >>> links.all_reduce(8e9, 8, "intra")        # 2 * 7/8 * 8e9 / 100e9
    0.14
    >>> links.all_gather(8e9, 8, "inter"), links.all_gather(8e9, 1, "inter")
    (0.7, 0.0)
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["Links", "megatron_allreduces", "ring_factor", "fit_links", "measured_links", "pipeline_hops",
           "node_crossings", "group_link", "COLLECTIVES", "HOPS", "GROUPS"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
HOPS = ("intra", "inter", "local")   # a pipeline boundary: within a node, across nodes, on one rank
GROUPS = ("tp", "dp")   # the collectives' groups of the 3-D layout: tensor parallel, data parallel (replicas)


@dataclass(frozen=True)
class Links:
    """Per-GPU link rates (bytes/s, one direction), a latency per collective (s) and the
    fraction of the rate a ring collective reaches: ``intra`` inside a node (NVLink), ``inter``
    between nodes (the GPU's NIC). ``gpus_per_node``: the ranks one node holds, which decides
    the link of each group (:func:`group_link`) and pipeline boundary (:func:`pipeline_hops`);
    None: not known (e.g. the local gloo ranks of one machine): tensor parallel is taken as
    intra-node, data parallel as inter-node, and pipeline transfers are not priced from these
    links."""

    intra_bytes_per_s: float
    inter_bytes_per_s: float
    intra_latency_s: float = 0.0
    inter_latency_s: float = 0.0
    efficiency: float = 1.0
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.intra_bytes_per_s <= 0 or self.inter_bytes_per_s <= 0:
            raise ValueError("Links: link rates must be > 0 bytes/s")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Links.efficiency={self.efficiency!r}; use a fraction in (0, 1]")
        if self.intra_latency_s < 0 or self.inter_latency_s < 0:
            raise ValueError("Links: latencies must be >= 0 s")
        if self.gpus_per_node is not None and int(self.gpus_per_node) < 1:
            raise ValueError(f"Links.gpus_per_node={self.gpus_per_node!r}; use a count >= 1 (or None: not known)")

    def _rate(self, link: str) -> tuple[float, float]:
        if link == "intra":
            return self.intra_bytes_per_s * self.efficiency, self.intra_latency_s
        if link == "inter":
            return self.inter_bytes_per_s * self.efficiency, self.inter_latency_s
        raise ValueError(f"link={link!r}; use 'intra' (within a node) or 'inter' (across nodes)")

    def time(self, kind: str, nbytes: float, ranks: int, link: str) -> float:
        """Seconds of a ring collective ``kind`` (one of :data:`COLLECTIVES`) of ``nbytes`` over
        ``ranks`` ranks on ``link``: ``latency + ring_factor(kind, ranks) * nbytes / rate``."""
        if ranks <= 1:
            return 0.0
        rate, lat = self._rate(link)
        return lat + ring_factor(kind, ranks) * float(nbytes) / rate

    def all_reduce(self, nbytes: float, ranks: int, link: str) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks on ``link``."""
        return self.time("all_reduce", nbytes, ranks, link)

    def all_gather(self, nbytes: float, ranks: int, link: str) -> float:
        """Seconds of a ring all-gather whose gathered tensor has ``nbytes`` bytes."""
        return self.time("all_gather", nbytes, ranks, link)

    def reduce_scatter(self, nbytes: float, ranks: int, link: str) -> float:
        """Seconds of a ring reduce-scatter of an ``nbytes``-byte tensor (each rank keeps 1/ranks)."""
        return self.time("reduce_scatter", nbytes, ranks, link)

    def p2p(self, nbytes: Any, hop: str) -> Any:
        """Seconds of one point-to-point message of ``nbytes`` on ``hop`` (one of :data:`HOPS`):
        ``latency + nbytes / rate`` at the link's full rate (``efficiency`` is a ring collective's
        figure, not a send's), 0 for ``"local"`` (two chunks on one rank).

        >>> Links(100e9, 10e9, 1e-6, 2e-6).p2p(1e9, "intra"), Links(100e9, 10e9).p2p(1e9, "local")
        (0.010001, 0.0)
        """
        if hop == "local":
            return 0.0
        if hop == "intra":   # (nbytes may be a numpy array: one message per element)
            return self.intra_latency_s + nbytes / self.intra_bytes_per_s
        if hop == "inter":
            return self.inter_latency_s + nbytes / self.inter_bytes_per_s
        raise ValueError(f"hop={hop!r}; use one of {HOPS}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def node_crossings(chunk_ranks: Sequence[int], num_stages: int, data_parallel: int, tensor_parallel: int,
                   gpus_per_node: int) -> np.ndarray:
    """Per boundary between chunk ``c`` and ``c + 1`` (rows) and replica (columns), whether some
    tp rank's two neighbouring pipeline ranks sit on different nodes: nodes are consecutive
    global ranks, ``gpus_per_node`` each, in the engine's rank order (``engine.ranks.mesh_rank``:
    tp innermost, then pp, dp outermost).

    >>> node_crossings([0, 1, 2], 3, 2, 1, 4).tolist()      # replica 1 is ranks 3 | 4, 5
    [[False, True], [False, False]]
    """
    from engine.ranks import mesh_rank

    g, p, t = int(gpus_per_node), int(num_stages), int(tensor_parallel)
    src = np.asarray(chunk_ranks[:-1], dtype=np.int64)[:, None, None]
    dst = np.asarray(chunk_ranks[1:], dtype=np.int64)[:, None, None]
    d = np.arange(int(data_parallel), dtype=np.int64)[None, :, None]
    q = np.arange(t, dtype=np.int64)[None, None, :]
    return (mesh_rank(d, src, q, p, t) // g != mesh_rank(d, dst, q, p, t) // g).any(axis=2)


def group_link(kind: str, num_stages: int, data_parallel: int, tensor_parallel: int,
               gpus_per_node: int | None) -> str:
    """The link the collectives of ``kind`` (one of :data:`GROUPS`) run on in the layout
    ``num_stages x data_parallel x tensor_parallel``: ``"intra"`` when every such group lies
    within one node, ``"inter"`` when some group spans nodes (a ring is as fast as its slowest
    link, and the groups sync at the step). A ``"tp"`` group is the ``tensor_parallel`` ranks of
    one replica and pipeline rank, a ``"dp"`` group the ``data_parallel`` replicas of one
    pipeline rank and tp rank; nodes are blocks of ``gpus_per_node`` consecutive global ranks in
    the engine's order (``engine.ranks.mesh_rank``: tp innermost, then pp, dp outermost).
    ``gpus_per_node=None`` (not known): ``"intra"`` for tp, ``"inter"`` for dp.

    >>> group_link("tp", 2, 4, 8, 8), group_link("tp", 1, 1, 16, 8)    # tp 8 is one node; tp 16 is two
    ('intra', 'inter')
    >>> group_link("dp", 2, 4, 1, 8), group_link("dp", 2, 4, 1, 4)     # pp 2 x dp 4: one node of 8; not of 4
    ('intra', 'inter')
    >>> group_link("dp", 8, 8, 8, None), group_link("tp", 8, 8, 8, None)
    ('inter', 'intra')
    """
    if kind not in GROUPS:
        raise ValueError(f"group kind {kind!r}; use one of {GROUPS}")
    p, d, t = int(num_stages), int(data_parallel), int(tensor_parallel)
    if min(p, d, t) < 1:
        raise ValueError(f"num_stages, data_parallel and tensor_parallel must be >= 1 (got {p}, {d}, {t})")
    if gpus_per_node is None:
        return "intra" if kind == "tp" else "inter"
    g = int(gpus_per_node)
    if g < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node!r}; use a count >= 1 (or None: not known)")
    return "intra" if _within_nodes(2 if kind == "tp" else 0, p, d, t, g) else "inter"


@functools.lru_cache(maxsize=4096)   # the 3-D search asks for the same few layouts many times
def _within_nodes(axis: int, p: int, d: int, t: int, g: int) -> bool:
    """Whether every group along ``axis`` of the ``[replica, pipeline rank, tp rank]`` mesh lies
    within one node of ``g`` consecutive ranks (:func:`group_link`)."""
    from engine.ranks import mesh_rank

    node = mesh_rank(np.arange(d)[:, None, None], np.arange(p)[None, :, None], np.arange(t)[None, None, :],
                     p, t) // g
    return bool((node == np.take(node, [0], axis=axis)).all())


def pipeline_hops(chunk_ranks: Sequence[int], num_stages: int, data_parallel: int, tensor_parallel: int,
                  gpus_per_node: int) -> list[str]:
    """Per boundary between chunk ``c`` and ``c + 1`` (``chunk_ranks``: each chunk's pipeline
    rank, the schedule's placement), the link its transfers take: ``"local"`` when both chunks
    run on one rank, ``"intra"`` when the two ranks share a node for every replica and tp rank,
    ``"inter"`` when they do not for some (:func:`node_crossings`; the slowest replica sets the
    step, the replicas sync at their gradient reduction).

    >>> pipeline_hops([0, 1, 2, 3], 4, 1, 1, 2)             # ranks 0-1 | 2-3: the middle boundary crosses
    ['intra', 'inter', 'intra']
    >>> pipeline_hops([0, 1, 1, 0], 2, 1, 1, 8)             # zbv: the V's turn stays on rank 1
    ['intra', 'local', 'intra']
    >>> pipeline_hops([0, 1, 2], 3, 2, 1, 4)                # replica 1 is ranks 3 | 4, 5
    ['inter', 'intra']
    """
    apart = node_crossings(chunk_ranks, num_stages, data_parallel, tensor_parallel, gpus_per_node).any(axis=1)
    return ["local" if a == b else "inter" if x else "intra"
            for a, b, x in zip(chunk_ranks[:-1], chunk_ranks[1:], apart.tolist())]


def megatron_allreduces(num_layers: int) -> list[tuple[int, int]]:
    """Per pipeline layer, the tensor-parallel all-reduces of its activation in the forward and
    in the backward (Megatron-style TP without sequence parallelism): a vocabulary-parallel
    embedding first (its output summed over the tp ranks: 1 forward, none backward, its input is
    token ids), transformer blocks (a column- then row-parallel attention and MLP: 2 forward, the
    input gradients of the two column-parallel halves 2 backward), a vocabulary-parallel head
    last (its input is replicated: its gradient summed in the backward; the loss's max and sum
    over the vocabulary shards are a few bytes per token, not counted).

    >>> megatron_allreduces(4)
    [(1, 0), (2, 2), (2, 2), (0, 1)]
    """
    if num_layers < 1:
        return []
    if num_layers == 1:
        return [(1, 1)]
    return [(1, 0)] + [(2, 2)] * (num_layers - 2) + [(0, 1)]


def ring_factor(kind: str, ranks: int) -> float:
    """The bytes a ring collective moves per rank, as a multiple of the whole tensor's:
    ``2 (n - 1) / n`` for an all-reduce, ``(n - 1) / n`` for an all-gather (of the gathered
    tensor) and a reduce-scatter (of the unreduced one).

    >>> ring_factor("all_reduce", 4), ring_factor("all_gather", 2)
    (1.5, 0.5)
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"collective {kind!r}; use one of {COLLECTIVES}")
    n = int(ranks)
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n if n > 1 else 0.0


def fit_links(points: Sequence[tuple[str, int, float, float]]) -> Links:
    """The :class:`Links` of one machine's local ranks (the same figures ``intra`` and ``inter``,
    efficiency 1) from measured collectives ``(kind, ranks, nbytes, seconds)``: the line
    ``seconds = latency + ring_factor(kind, ranks) * nbytes / rate`` through all of them, least
    squares on relative residuals (the sizes span orders of magnitude; a negative intercept is
    taken as no latency, the rate refitted through the origin; times that do not grow with the
    bytes give a latency only, at 1e15 bytes/s). Raises ValueError when fewer than two sizes
    are given.

    >>> pts = [(k, 2, b, 1e-4 + ring_factor(k, 2) * b / 1e9) for k in COLLECTIVES for b in (1e3, 1e6)]
    >>> links = fit_links(pts)
    >>> round(links.intra_latency_s * 1e6, 3), round(links.intra_bytes_per_s / 1e9, 6)
    (100.0, 1.0)
    """
    xs = np.array([ring_factor(k, n) * float(b) for k, n, b, _ in points], dtype=np.float64)
    ys = np.array([float(t) for *_, t in points], dtype=np.float64)
    if len(set(xs.tolist())) < 2:
        raise ValueError(f"fit_links needs collectives of at least two sizes over >= 2 ranks; got {len(xs)} points")
    w = 1.0 / np.maximum(ys, 1e-12)   # relative residuals: the sizes span orders of magnitude
    slope, intercept = np.polyfit(xs, ys, 1, w=w)
    if intercept < 0:
        intercept, slope = 0.0, float(np.sum(w * w * xs * ys) / np.sum(w * w * xs * xs))
    if slope <= 1e-15:   # flat (latency-bound, noisy): the line through the weighted mean at a huge rate
        slope = 1e-15
        intercept = float(np.sum(w * (ys - slope * xs)) / np.sum(w))
    lat = float(intercept)
    return Links(1.0 / float(slope), 1.0 / float(slope), lat, lat, 1.0)


def measured_links(measured: Mapping[str, Any], shared_cores: bool = False) -> Links:
    """The :class:`Links` of a machine's local gloo ranks from ``engine.overhead.measure_collectives``'s
    dict: :func:`fit_links` of its idle ``points``, or with ``shared_cores`` (the job's ranks
    outnumber the cores) of its ``busy_points``.

    >>> pts = [["all_reduce", 2, b, 1e-4 + b / 1e9] for b in (1e3, 1e6)]
    >>> round(measured_links({"points": pts, "busy_points": pts}).intra_bytes_per_s / 1e9, 6)
    1.0
    """
    return fit_links([tuple(p) for p in measured["busy_points" if shared_cores else "points"]])
