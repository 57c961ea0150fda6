"""Fault injection for the benchmark tests: a layer that fails and a worker that hangs.

A module of its own (not a test file) because spawned workers unpickle them by module path.

Example::

    from faults import FailingLayer
    layers = [..., functools.partial(FailingLayer, "boom")]   # raises in forward
"""

from __future__ import annotations

import time

from torch import Tensor, nn

__all__ = ["FailingLayer", "hang_worker"]


class FailingLayer(nn.Module):
    """An identity layer (with one parameter) whose forward raises ``RuntimeError(message)``."""

    def __init__(self, message: str = "injected failure") -> None:
        super().__init__()
        self.message = message
        self.scale = nn.Parameter(Tensor([1.0]))

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError(self.message)


def hang_worker(seconds: float) -> None:
    """Sleeps ``seconds`` (to test a launch timeout)."""
    time.sleep(seconds)
