"""Data-parallel gradient reduction that overlaps the last backward (the torch backend).

Each parameter's gradient is final once it has been accumulated once per microbatch. A
post-accumulate-grad hook counts the accumulations; when every gradient of a bucket is final,
the bucket is all-reduced asynchronously over the data-parallel group while the backward of
the remaining layers (and the rest of the schedule) goes on, as DDP does. Buckets are filled
in the order gradients become final and launched strictly in bucket order, so every replica
issues the same collectives in the same order. ``finish`` waits for them, writes the sums
back and reduces synchronously whatever did not complete its count (a parameter unused in
some microbatch).

Example::

    reducer = GradBucketReducer(params, mesh.dp_group, microbatches=8)
    ...  # the schedule's backwards accumulate gradients; full buckets start reducing
    reducer.finish()          # every p.grad now holds the sum over replicas
    reducer.reset()           # before the next step
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GradBucketReducer"]


class GradBucketReducer:
    """All-reduce (sum) the gradients of ``params`` over ``group``, a bucket as soon as it is final."""

    def __init__(self, params: Sequence[Tensor], group: Any, microbatches: int, *,
                 bucket_bytes: int = 25 * 2**20):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.m, self.bucket_bytes = group, int(microbatches), int(bucket_bytes)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.launched_early = 0   # buckets launched from a hook during backward, this step
        self.reset()

    def reset(self) -> None:
        """Forget this step's counts and buckets (call with ``zero_grad``)."""
        self._count: dict[int, int] = {}
        self._open: list[Tensor] = []          # final gradients' params, not yet in a launched bucket
        self._open_bytes = 0
        self._works: list[tuple[Any, Tensor, list[Tensor]]] = []
        self.launched_early = 0

    def _on_grad(self, p: Tensor) -> None:
        n = self._count.get(id(p), 0) + 1
        self._count[id(p)] = n
        if n != self.m:
            return
        if self._open and p.grad.dtype != self._open[0].grad.dtype:
            self._launch()
        self._open.append(p)
        self._open_bytes += p.grad.numel() * p.grad.element_size()
        if self._open_bytes >= self.bucket_bytes:
            self._launch()
            self.launched_early += 1

    def _launch(self) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in self._open])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._works.append((work, flat, self._open))
        self._open, self._open_bytes = [], 0

    def finish(self) -> None:
        """Wait for the launched buckets, write the sums into ``p.grad``, reduce the rest now."""
        done = {id(p) for p in self._open}
        if self._open:
            self._launch()   # the last, partly filled bucket of final gradients
        done |= {id(p) for _, _, ps in self._works for p in ps}
        rest = [p for p in self.params if id(p) not in done]
        for p in rest:       # unused (no grad) or not accumulated m times: same order on every replica
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if rest:
            self._open = rest
            self._launch()
        for work, flat, ps in self._works:
            work.wait()
            off = 0
            for p in ps:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                off += p.numel()
        self._works = []

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
