"""Collective times of the 3-D layout (pp x dp x tp): the links they run on and what they cost.

The mesh is ``(pp, dp, tp)`` with tp innermost (``engine.mesh``): the ``t`` ranks of a
tensor-parallel group are neighbours, inside one node (NVLink), while a data-parallel group
spans nodes (one NIC per GPU, InfiniBand / RoCE). :class:`Links` holds both links' per-GPU
bandwidth (one direction), a latency per collective and the fraction of the bandwidth a
collective reaches (``efficiency``); the GPU presets (``partitioner.devices``) carry their
datasheet figures (docs/device-model.md sources each one).

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

from dataclasses import asdict, dataclass

__all__ = ["Links", "megatron_allreduces"]


@dataclass(frozen=True)
class Links:
    """Per-GPU link rates (bytes/s, one direction), a latency per collective (s) and the
    fraction of the rate a ring collective reaches: ``intra`` inside a node (tensor parallel),
    ``inter`` between nodes (data parallel)."""

    intra_bytes_per_s: float
    inter_bytes_per_s: float
    intra_latency_s: float = 0.0
    inter_latency_s: float = 0.0
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        if self.intra_bytes_per_s <= 0 or self.inter_bytes_per_s <= 0:
            raise ValueError("Links: link rates must be > 0 bytes/s")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Links.efficiency={self.efficiency!r}; use a fraction in (0, 1]")
        if self.intra_latency_s < 0 or self.inter_latency_s < 0:
            raise ValueError("Links: latencies must be >= 0 s")

    def _rate(self, link: str) -> tuple[float, float]:
        if link == "intra":
            return self.intra_bytes_per_s * self.efficiency, self.intra_latency_s
        if link == "inter":
            return self.inter_bytes_per_s * self.efficiency, self.inter_latency_s
        raise ValueError(f"link={link!r}; use 'intra' (tensor parallel) or 'inter' (data parallel)")

    def all_reduce(self, nbytes: float, ranks: int, link: str) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` ranks on ``link``."""
        if ranks <= 1:
            return 0.0
        rate, lat = self._rate(link)
        return lat + 2.0 * (ranks - 1) / ranks * float(nbytes) / rate

    def all_gather(self, nbytes: float, ranks: int, link: str) -> float:
        """Seconds of a ring all-gather whose gathered tensor has ``nbytes`` bytes."""
        if ranks <= 1:
            return 0.0
        rate, lat = self._rate(link)
        return lat + (ranks - 1) / ranks * float(nbytes) / rate

    def reduce_scatter(self, nbytes: float, ranks: int, link: str) -> float:
        """Seconds of a ring reduce-scatter of an ``nbytes``-byte tensor (each rank keeps 1/ranks)."""
        return self.all_gather(nbytes, ranks, link)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


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
