"""What a pipeline transfer costs in a plan: the link each stage boundary's messages take.

A cut after layer ``i`` sends that layer's output forward and its gradient back: one message of
``output_bytes`` each way per microbatch. :func:`transfer_model` decides, once per plan, where
the rate comes from (first match wins):

1. ``"config"``: ``link_bytes_per_s`` given to ``partition`` (``partitioner.link_bytes_per_s``),
   every boundary at that rate, plus the profile's per-message latency when it has fixed costs;
2. ``"measured"``: the link the profile's fixed costs measured on this machine
   (``FixedCosts.link_bytes_per_s`` and ``message_latency_s``);
3. ``"device_spec"``: the device spec's links (``DeviceSpec.links`` with ``gpus_per_node``): per
   boundary, NVLink when the two neighbouring pipeline ranks share a node in the engine's rank
   order, the sending GPU's NIC when they do not (``partitioner.collectives.pipeline_hops``),
   ``latency + bytes / rate`` (:meth:`partitioner.collectives.Links.p2p`), nothing between two
   chunks on one rank;
4. ``"free"``: none of these; transfers cost the fixed costs' latency only (0 without them).

:meth:`Transfers.rows` gives the per-layer transfer seconds as distinct rows and each boundary's
row, what the exact split search takes as per-stage cut times (``partitioner.feasible``) and the
simulator as one transfer per boundary (``engine.simulate(comm_s=...)``).

Example::

    >>> from partitioner.collectives import Links
    >>> t = transfer_model(None, None, Links(300e9, 25e9, 25e-6, 30e-6, gpus_per_node=8), [0, 1], 2, 1, 1)
    >>> t.source, t.hops, t.labels()
    ('device_spec', ('intra',), ['device_spec intra-node'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .collectives import Links, node_crossings, pipeline_hops
from .costs import FixedCosts

__all__ = ["Transfers", "transfer_model", "LINK_SOURCES"]

LINK_SOURCES = ("config", "measured", "device_spec", "free")
_HOP_LABEL = {"intra": "device_spec intra-node", "inter": "device_spec inter-node", "local": "on rank"}


@dataclass(frozen=True)
class Transfers:
    """A plan's transfer model: ``source`` (one of :data:`LINK_SOURCES`), the one ``rate`` of
    every boundary (config / measured; None otherwise) with ``latency_s`` per message, or per
    boundary the ``hops`` (``"intra"`` / ``"inter"`` / ``"local"``) priced on ``links``."""

    source: str
    rate: float | None = None
    latency_s: float = 0.0
    hops: tuple[str, ...] | None = None
    links: Links | None = None
    mixed: bool = False   # the replicas cross nodes at different boundaries (each boundary: its worst)

    def rows(self, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, row_of)``: the distinct per-layer transfer times (seconds of one message
        when a cut follows each layer of ``out`` bytes), shape ``(rows, n)``, and each
        boundary's row. One row and no boundaries' choice (``row_of`` all 0) unless per-boundary
        hops differ.

        >>> Transfers("config", 1e9, 1e-6).rows(np.array([1e6, 2e6]))[0].tolist()
        [[0.001001, 0.002001]]
        """
        out = np.asarray(out, dtype=np.float64)
        if self.hops is None or self.links is None:
            row = (out / self.rate if self.rate else np.zeros(out.size)) + self.latency_s
            return row[None, :], np.zeros(0, dtype=np.int64)
        kinds = sorted(set(self.hops), key=("intra", "inter", "local").index)
        rows = np.stack([np.zeros(out.size) if h == "local" else self.links.p2p(out, h) for h in kinds])
        return rows, np.array([kinds.index(h) for h in self.hops], dtype=np.int64)

    def labels(self) -> list[str]:
        """Per boundary, where its rate comes from (``Plan.boundary_links``) when the hops
        are known; else one label, the source (an empty list)."""
        return [_HOP_LABEL[h] for h in self.hops] if self.hops is not None else []

    @property
    def link_bytes_per_s(self) -> float | None:
        """The plan's one figure: the rate given or measured, or the slowest link a boundary
        crosses ranks on (device spec); None when transfers are free or all stay on a rank."""
        if self.hops is None or self.links is None:
            return self.rate
        rates = [self.links.inter_bytes_per_s if h == "inter" else self.links.intra_bytes_per_s
                 for h in self.hops if h != "local"]
        return min(rates) if rates else None

    def note(self) -> str:
        """One line for the plan's notes: where its transfer costs come from."""
        if self.hops is None or self.links is None:
            what = {"config": "partitioner.link_bytes_per_s", "measured": "measured on this machine (fixed costs)",
                    "free": "no link given: transfers cost"}[self.source]
            rate = f" {self.rate / 1e9:.3g} GB/s" if self.rate else (" nothing" if not self.latency_s else "")
            lat = f" + {self.latency_s * 1e6:.3g} us per message" if self.latency_s else ""
            return f"pipeline transfers: {what}{rate}{lat}"
        lk = self.links
        inter = [i for i, h in enumerate(self.hops) if h == "inter"]
        mixed = ("; the replicas cross nodes at different boundaries, each boundary is charged at its worst "
                 "replica's link (an upper bound on the step)" if self.mixed else "")
        return (f"pipeline transfers: device spec links, {lk.gpus_per_node} GPUs per node in the engine's rank order; "
                f"boundaries {inter or 'none'} cross nodes (NIC {lk.inter_bytes_per_s / 1e9:.3g} GB/s + "
                f"{lk.inter_latency_s * 1e6:.3g} us), the others within a node (NVLink {lk.intra_bytes_per_s / 1e9:.3g} "
                f"GB/s + {lk.intra_latency_s * 1e6:.3g} us) or on one rank{mixed}")


def transfer_model(fixed: FixedCosts | None, link_bytes_per_s: float | None, links: Links | None,
                   chunk_ranks: Sequence[int], num_stages: int, data_parallel: int, tensor_parallel: int
                   ) -> Transfers:
    """The :class:`Transfers` of a plan (module docstring: an explicit rate wins, then the
    measured one, then the device spec's links when they know the node size).

    >>> transfer_model(None, 2e9, None, [0, 1], 2, 1, 1).source
    'config'
    """
    latency = fixed.message_latency_s if fixed is not None else 0.0
    if link_bytes_per_s is not None:
        return Transfers("config", float(link_bytes_per_s), latency)
    if fixed is not None and fixed.link_bytes_per_s is not None:
        return Transfers("measured", float(fixed.link_bytes_per_s), latency)
    if links is not None and links.gpus_per_node is not None and len(chunk_ranks) > 1:
        hops = pipeline_hops(chunk_ranks, num_stages, data_parallel, tensor_parallel, links.gpus_per_node)
        cross = node_crossings(chunk_ranks, num_stages, data_parallel, tensor_parallel, links.gpus_per_node)
        mixed = bool((cross != cross[:, :1]).any())
        return Transfers("device_spec", None, 0.0, tuple(hops), links, mixed)
    return Transfers("free", None, latency)
