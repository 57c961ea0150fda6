"""ZeRO-3 (FSDP2 per stage, ``engine.fsdp``) state terms of one pipeline rank's memory.

The terms that differ under ``optimizer.zero_stage=3``; the planner's memory model
(``partitioner.memory.MemorySettings`` with ``zero_stage=3``) takes them through
:func:`zero3_footprint`:

* parameters: the fp32 sharded masters, ``4 N / dp`` (FSDP2 shards each tensor's dim 0; a dim 0
  not divisible by dp gives some ranks one row more, which this ignores), plus the gathered
  (unsharded) copies in the compute dtype: every layer of the rank when the layers stay gathered
  for the step (``reshard_after_forward=False``); with resharding, the layers of the chunk that
  computes, or every chunk of the rank under a split backward (a chunk whose microbatch has run I
  keeps its layers gathered until W);
* gradients: accumulated unsharded over the microbatches and reduce-scattered once per step, so
  ``4 N`` in the backward (16-bit compute: the 16-bit gradient of the backward running plus the
  fp32 accumulation, ``(w + 4) N``), ``4 N / dp`` after the reduction (the step);
* optimizer state: the torch optimizer's fp32 state on the shards, ``s N / dp``.

Example::

    >>> t = zero3_state_bytes([1000.0, 3000.0], data_parallel=4, optimizer="adamw")
    >>> t["parameters"], t["gradients"], t["optimizer_state"]   # 4*4000/4 + 4*4000; 4*4000; 8*4000/4
    (20000.0, 16000.0, 8000.0)
    >>> zero3_state_bytes([1000.0, 3000.0], data_parallel=4, reshard_after_forward=True)["parameters"]
    16000.0
"""
from __future__ import annotations

from typing import Sequence

from engine.choices import weight_bytes
from engine.footprint import Footprint, optimizer_state_bytes_per_param

__all__ = ["zero3_state_bytes", "gathered_numel", "zero3_footprint"]


def zero3_footprint(numel: float, largest: float, *, data_parallel: int, precision: str = "fp32",
                    optimizer: str = "adamw", momentum: float = 0.0) -> Footprint:
    """What a rank holding ``numel`` parameters keeps under ZeRO-3, as the planner's memory model
    takes it (an ``engine.footprint.Footprint``), every layer of the rank gathered: ``parameters``
    the fp32 shards plus the gathered copies in the compute dtype (``4 N / dp + w N``; the
    planner books the gathered part as its own term and, when layers reshard between actions,
    only the layers gathered at the peak, :class:`partitioner.memory.MemorySettings`);
    ``gradients`` the fp32 unsharded accumulation (``4 N``: FSDP2 upcasts a 16-bit gradient to
    its fp32 reduce dtype at each layer's post-backward, ``FSDPParam.to_accumulated_grad_if_needed``;
    the gradient a backward makes before it is added is a transient, ``w`` times the largest
    tensor, booked ``backward_temporary``); ``optimizer_state`` on the shards (``s N / dp``); the step holds the
    shards, the reduced gradient shards and the state (no flat copies: the torch optimizer on
    DTensor shards). Gradients exist from the step's first backward (``zero_grad`` sets them to
    None), as with the torch backend.

    >>> f = zero3_footprint(1000, 100, data_parallel=4, precision="bf16")
    >>> f.parameters, f.gradients, f.optimizer_state, f.backward_temporary, f.step_gradients
    (3000.0, 4000.0, 2000.0, 200.0, 1000.0)
    """
    d = int(data_parallel)
    if d < 1:
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    n, big = float(numel), float(min(largest, numel))
    w = min(weight_bytes(precision), 4)
    s = optimizer_state_bytes_per_param(optimizer, momentum)
    return Footprint(parameters=4.0 * n / d + w * n, gradients=4.0 * n, optimizer_state=s * n / d,
                     backward_temporary=w * big, step_gradients=4.0 * n / d,
                     step_temporary=0.0, gradients_from_first_backward=True)


def gathered_numel(chunk_numels: Sequence[float], *, reshard_after_forward: bool,
                   split_backward: bool = False) -> float:
    """Parameters a rank holds gathered at once (elements): all of its chunks' when the layers
    stay gathered or a split backward keeps them from I to W, else its largest chunk's.

    >>> gathered_numel([10.0, 30.0], reshard_after_forward=True), gathered_numel([10.0, 30.0], reshard_after_forward=False)
    (30.0, 40.0)
    """
    if not chunk_numels:
        return 0.0
    if reshard_after_forward and not split_backward:
        return float(max(chunk_numels))
    return float(sum(chunk_numels))


def zero3_state_bytes(chunk_numels: Sequence[float], *, data_parallel: int, precision: str = "fp32",
                      optimizer: str = "adamw", momentum: float = 0.0,
                      reshard_after_forward: bool = False, split_backward: bool = False,
                      phase: str = "backward") -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state of a rank holding chunks of
    ``chunk_numels`` parameters under ZeRO-3 over ``data_parallel`` replicas, in the backward
    (``phase="backward"``: gathered weights, unsharded gradients) or at the optimizer step
    (``"step"``: shards only). See the module docstring for each term."""
    d = int(data_parallel)
    if d < 1:
        raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
    if phase not in ("backward", "step"):
        raise ValueError(f"phase={phase!r}; use 'backward' or 'step'")
    n = float(sum(chunk_numels))
    w = min(weight_bytes(precision), 4)       # the compute (gathered) dtype's bytes
    shards = 4.0 * n / d
    state = optimizer_state_bytes_per_param(optimizer, momentum) * n / d
    if phase == "step":
        return {"parameters": shards, "gradients": shards, "optimizer_state": state}
    gathered = w * gathered_numel(chunk_numels, reshard_after_forward=reshard_after_forward,
                                  split_backward=split_backward)
    grads = (4.0 if w == 4 else w + 4.0) * n
    return {"parameters": shards + gathered, "gradients": grads, "optimizer_state": state}
