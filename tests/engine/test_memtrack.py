"""engine.memtrack: MemTracker's measurement of a step, repeatable without leaking."""
from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from engine.memtrack import measure_step


def test_measuring_a_step_keeps_nothing_of_it_alive():
    """MemTracker's module tracker hooks every module's inputs; on a leaf input (what a pipeline
    stage receives) the hook would keep the input and its gradient alive after the step. Every
    measurement must find the same memory, and the step's tensors must be freed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 48))
    inputs: list[weakref.ref] = []

    def step():
        x = torch.randn(4, 64, requires_grad=True)
        inputs.append(weakref.ref(x))
        model(x).sum().backward()

    reports = [measure_step(step, modules=[model])[1] for _ in range(4)]
    gc.collect()
    assert all(r() is None for r in inputs)
    # tensors alive before the step that are not the model's (other tests' in this process)
    # count as "other"; the step's own memory is the same at every measurement
    own = [r.peak_bytes - r.breakdown["other"] for r in reports]
    assert own[1] == own[2] == own[3], own
    # weights + gradients are all there and counted by kind
    numel = sum(p.numel() for p in model.parameters())
    assert reports[3].breakdown["parameters"] == 4 * numel
    assert reports[3].breakdown["gradients"] == 4 * numel
