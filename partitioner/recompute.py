"""Per-layer activation checkpointing as a profile: the one rule for a layer checkpointed on its own.

pipeshard's engine checkpoints a whole chunk by default (``engine.stage``: a held microbatch
keeps the chunk's input, its backward recomputes the chunk, so one microbatch's activations of
every layer of the chunk exist at once). torchtitan's and Megatron's "full" activation
checkpointing wraps each transformer block instead: a held microbatch keeps every block's input,
and a backward recomputes one block at a time; the engine runs that with
``recompute_granularity="layer"`` (every layer of a recomputing chunk). :func:`checkpoint_each_layer`
turns a profile into the second (each checkpointed layer saves only its input; its activations
and backward workspace become its backward's transient; its backward runs its forward again).
:func:`partitioner.partition` with ``recompute_granularity="layer"`` prices its recomputing chunks
by this rule (every layer); called directly, with ``activation_checkpointing=False``, it predicts
another runtime's memory and time (blocks only) to compare with published figures.
:func:`sequence_parallel_profile` is the one rule for sequence parallelism: it divides what lies on
the residual stream by tp once (a held block input included), and refuses a profile it has
already divided.

Example::

    >>> from partitioner import LayerCost, Profile
    >>> prof = Profile([LayerCost(1.0, 2.0, 8, 100, 10, workspace_bytes=5)] * 3)
    >>> c = checkpoint_each_layer(prof, [1]).layers[1]
    >>> c.activation_bytes, c.workspace_bytes, c.backward_s
    (10, 105, 3.0)
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .costs import Profile

__all__ = ["checkpoint_each_layer", "sequence_parallel_profile", "SP_NORM_TENSORS"]


def checkpoint_each_layer(profile: Profile, layers: Sequence[int] | None = None) -> Profile:
    """``profile`` with each of ``layers`` (default: all but the first and the last, the
    transformer blocks of an LM's pipeline layers) checkpointed on its own (module docstring):
    its saved activations the input it receives (the previous layer's output, as the profile has
    it: ``[b, t / tp, d]`` in a :func:`sequence_parallel_profile`; 0 for the first), its
    workspace its former activations plus workspace (recomputed then freed by its backward), its
    backward (and a split backward's input half) longer by its forward."""
    n = len(profile)
    chosen = set(range(1, n - 1) if layers is None else (int(i) for i in layers))
    bad = sorted(i for i in chosen if not 0 <= i < n)
    if bad:
        raise ValueError(f"layers {bad} are not in the profile's {n} layers")
    out = []
    for i, c in enumerate(profile.layers):
        if i not in chosen:
            out.append(c)
            continue
        held = profile.layers[i - 1].output_bytes if i > 0 else 0
        ws = c.workspace_bytes if c.workspace_bytes is not None else 2 * c.output_bytes
        out.append(dataclasses.replace(
            c, activation_bytes=int(held), workspace_bytes=int(c.activation_bytes + ws), shared_input_bytes=0,
            output_saved_bytes=0, backward_s=c.backward_s + c.forward_s,
            input_grad_s=None if c.input_grad_s is None else c.input_grad_s + c.forward_s,
            backward_flops=None if c.backward_flops is None or c.forward_flops is None
            else c.backward_flops + c.forward_flops))
    return dataclasses.replace(profile, layers=out, meta=dict(profile.meta, checkpointed_layers=sorted(chosen)))


SP_NORM_TENSORS = "sp_norm_tensors"
"""``Profile.meta`` key: residual-stream tensors each norm saves that sequence parallelism splits
(:func:`sequence_parallel_profile`, in units of the residual stream; the experiments' wiring knows
the model's norm: an RMSNorm 2 on a 4-byte stream, 3 on a 16-bit one (its input upcast to fp32),
a LayerNorm 1)."""


def sequence_parallel_profile(profile: Profile, tp: int, norms: int = 2) -> Profile:
    """``profile`` (one tp rank's shapes, profiled with the residual stream whole) as the engine
    runs it under sequence parallelism over ``tp`` ranks (``model.sequence_parallel``): every
    layer's output but the last (the embedding's and the blocks', the residual stream
    ``[b, t, d]``) is ``[b, t / tp, d]`` per rank, so ``output_bytes`` (what crosses a cut, the
    boundary buffers, a recomputing chunk's held input, a chunk's kept output; and
    :func:`checkpoint_each_layer`'s held block inputs) is divided by ``tp``. Saved activations:
    each of a block's ``norms`` (the head's one final norm) saves ``k`` residual-stream tensors
    that, split on the sequence, become ``1 / tp`` (the projections after it save the
    all-gathered output, whole either way): ``k (1 - 1 / tp)`` tensors less per norm. ``k`` is
    ``profile.meta[SP_NORM_TENSORS]``, default 2: an RMSNorm in fp32 saves its input and its
    normalised input (with 16-bit weights its input upcast to fp32 and its normalised input: 3;
    a LayerNorm its input only: 1). The residual stream's size is the
    layer's input as profiled. Refuses a profile already divided (``meta["sequence_parallel"]``):
    the rule is applied once.

    >>> from partitioner import LayerCost, Profile
    >>> prof = Profile([LayerCost(1.0, 2.0, 8, 100, 10)] * 3)
    >>> [(c.output_bytes, c.activation_bytes) for c in sequence_parallel_profile(prof, 2).layers]
    [(5, 100), (5, 80), (10, 90)]
    """
    tp = int(tp)
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if int(profile.meta.get("sequence_parallel", 1)) > 1:
        raise ValueError(f"the profile is already planned under sequence parallelism over "
                         f"{profile.meta['sequence_parallel']} ranks; give the profile with the residual stream "
                         "whole (sequence_parallel_profile divides it once)")
    if tp == 1:
        return profile
    k = float(profile.meta.get(SP_NORM_TENSORS, 2))
    n = len(profile)
    out = []
    for i, c in enumerate(profile.layers):
        count = 0 if i == 0 else (1 if i == n - 1 else int(norms))
        fewer = int(count * k * (1 - 1 / tp) * (profile.layers[i - 1].output_bytes if i > 0 else 0))
        sent = c.output_bytes // tp if i < n - 1 else c.output_bytes
        saved = None if c.output_saved_bytes is None else min(c.output_saved_bytes, sent)
        out.append(dataclasses.replace(c, output_bytes=sent, output_saved_bytes=saved,
                                       activation_bytes=max(0, c.activation_bytes - fewer)))
    return dataclasses.replace(profile, layers=out, meta=dict(profile.meta, sequence_parallel=tp))
