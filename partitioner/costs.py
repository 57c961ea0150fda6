"""Per-layer costs and the profile that holds them.

A :class:`Profile` is the only input the solver needs. It can come from
:func:`partitioner.profile`, from another profiler, or be written by hand::

    from partitioner import LayerCost, Profile
    prof = Profile([LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=4_000_000,
                              activation_bytes=1_000_000, output_bytes=250_000)] * 8)
    text = prof.to_json()
    assert Profile.from_json(text) == prof
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

__all__ = ["LayerCost", "Profile", "FixedCosts"]


@dataclass(frozen=True)
class LayerCost:
    """Costs of one layer for one microbatch.

    - ``forward_s`` / ``backward_s``: compute time; ``backward_s`` is the full backward
      (input and weight gradients).
    - ``param_bytes``: bytes of the layer's parameters in the profiled dtype.
    - ``activation_bytes``: bytes saved for backward per microbatch (parameters excluded).
    - ``output_bytes``: bytes of the output, i.e. what crosses a cut placed after this layer.
    - ``weight_grad_s``: the time of the weight-gradient half (W) of a split backward
      (zero-bubble schedules defer it); None when unknown (treated as half of ``backward_s``).
      Without ``input_grad_s`` it is a part of ``backward_s`` (the input half is the rest).
    - ``input_grad_s``: the time of the input-gradient half (I) of a split backward, as the
      engine runs it. A split backward costs more than the whole one (a second pass over the
      graph, one autograd call per weight-owning node): ``input_grad_s + weight_grad_s`` may
      exceed ``backward_s``, and split-backward schedules are charged that sum. None: the split
      costs what the whole backward costs (``backward_s - weight_grad_s``).
    - ``name``: a label for tables (e.g. the module class).
    - ``forward_flops`` / ``backward_flops``: FLOPs when known (analytic profiles).
    - ``shared_input_bytes``: bytes of the layer's input that it saves for backward but that the
      previous layer already counted in its ``activation_bytes`` (e.g. ReLU then Linear save the
      same tensor). A stage starting at this layer receives its own copy, so the memory model
      adds these bytes per in-flight microbatch only when a cut falls just before the layer.
    - ``largest_param_bytes``: bytes of the layer's largest parameter tensor (None: all of
      ``param_bytes``); the optimizer backends' backward transient follows it.
    - ``workspace_bytes``: the transient of the layer's backward beyond what it saved (the
      gradients of its intermediate tensors); None: estimated as twice ``output_bytes``.
    - ``pending_grad_bytes``: what a microbatch keeps between its input-gradient (I) and its
      deferred weight-gradient (W) backward under a split-backward schedule (zb-h1, zb-h2,
      zbv), beyond its saved activations: the gradients arriving at the layer's weight-owning
      autograd nodes (e.g. each Linear's output gradient), which W consumes. None (a profile
      written before the field existed): ``output_bytes`` for a layer with parameters, else 0
      (the gradient at the layer's output, the least a weight-owning layer keeps).
    - ``output_saved_bytes``: bytes of the layer's output that the layer itself saves for
      backward (already in ``activation_bytes``, e.g. a ReLU's result). A chunk ending at this
      layer keeps the rest of its output per held microbatch (the engine's backward roots,
      :func:`partitioner.memory.kept_output_bytes`). None (a profile written before the field
      existed): 0, the whole output is kept.
    - ``loss_input_bytes`` / ``loss_saved_bytes`` (the layer profiled with the loss only): the
      bytes of the tensors the layer hands to the loss (an LM head's logits; 0 when the head's
      output is no tensor, a fused head forming one graph with its loss) and, of
      ``activation_bytes``, what the loss itself saves (the fp32 log-softmax). Under the
      per-layer graph cut of a split backward (``engine.stage``, DeepSpeed's backends) the
      layer and its loss are two segments: the layer's output is kept as its segment's root
      and, from I to W, with its gradient, while the loss's graph and saved tensors are freed
      at I (:meth:`partitioner.memory.MemorySettings.loss_cut_bytes`). None: unknown (0).
    - ``param_numels``: the elements of each of the layer's trainable parameter tensors, in
      ``parameters()`` order (what a ZeRO backend flattens and partitions:
      :func:`engine.footprint.zero_partition_overlap`). None: unknown.
    """

    forward_s: float
    backward_s: float
    param_bytes: int
    activation_bytes: int
    output_bytes: int
    weight_grad_s: float | None = None
    name: str = ""
    forward_flops: float | None = None
    backward_flops: float | None = None
    shared_input_bytes: int = 0
    largest_param_bytes: int | None = None
    workspace_bytes: int | None = None
    pending_grad_bytes: int | None = None
    input_grad_s: float | None = None
    output_saved_bytes: int | None = None
    loss_input_bytes: int | None = None
    loss_saved_bytes: int | None = None
    param_numels: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.param_numels is not None:   # a JSON round trip gives a list
            object.__setattr__(self, "param_numels", tuple(int(n) for n in self.param_numels))
        for f in ("forward_s", "backward_s", "param_bytes", "activation_bytes", "output_bytes"):
            v = getattr(self, f)
            if v is None or v < 0:
                raise ValueError(f"LayerCost.{f} must be >= 0, got {v!r}")
        if self.pending_grad_bytes is not None and self.pending_grad_bytes < 0:
            raise ValueError(f"LayerCost.pending_grad_bytes must be >= 0 or None, got {self.pending_grad_bytes!r}")
        if self.input_grad_s is not None:
            if self.input_grad_s < 0 or self.weight_grad_s is None or self.weight_grad_s < 0:
                raise ValueError(f"LayerCost.input_grad_s={self.input_grad_s!r} needs weight_grad_s "
                                 f"(got {self.weight_grad_s!r}); both must be >= 0")
        elif self.weight_grad_s is not None and not (0 <= self.weight_grad_s <= self.backward_s * (1 + 1e-9) + 1e-12):
            raise ValueError(
                f"LayerCost.weight_grad_s={self.weight_grad_s!r} must lie in [0, backward_s={self.backward_s!r}] "
                "(or give input_grad_s, the split's measured input half)"
            )

    @property
    def pending_bytes(self) -> int:
        """:attr:`pending_grad_bytes`, or its default when unknown (see the class docstring)."""
        if self.pending_grad_bytes is not None:
            return self.pending_grad_bytes
        return self.output_bytes if self.param_bytes > 0 else 0

    @property
    def weight_s(self) -> float:
        """Weight-gradient time, defaulting to half of the backward when unknown."""
        return self.backward_s / 2 if self.weight_grad_s is None else self.weight_grad_s

    @property
    def input_s(self) -> float:
        """Input-gradient time of a split backward (default: the backward less :attr:`weight_s`)."""
        if self.input_grad_s is not None:
            return self.input_grad_s
        return max(self.backward_s - self.weight_s, 0.0)

    @property
    def split_backward_s(self) -> float:
        """The backward's time when split into I and W (zero-bubble schedules).

        >>> LayerCost(1.0, 2.0, 0, 0, 0, weight_grad_s=1.1, input_grad_s=1.2).split_backward_s
        2.3
        """
        return self.input_s + self.weight_s

    def times_scaled(self, k: float) -> "LayerCost":
        """This layer with every time (forward, backward, W, I) multiplied by ``k``.

        >>> LayerCost(1.0, 2.0, 0, 0, 0, weight_grad_s=1.0).times_scaled(0.5).weight_s
        0.5
        """
        k = float(k)
        w = None if self.weight_grad_s is None else self.weight_grad_s * k
        if w is not None and self.input_grad_s is None:
            w = min(w, self.backward_s * k)   # stays a part of the backward under rounding
        return replace(self, forward_s=self.forward_s * k, backward_s=self.backward_s * k, weight_grad_s=w,
                       input_grad_s=None if self.input_grad_s is None else self.input_grad_s * k)

    @property
    def compute_s(self) -> float:
        """Forward plus backward time."""
        return self.forward_s + self.backward_s


class JsonMixin:
    """``to_json`` / ``from_json`` for classes that define ``to_dict`` / ``from_dict``."""

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialise to a JSON string (and write it to ``path`` when given)."""
        text = json.dumps(self.to_dict(), indent=1)  # type: ignore[attr-defined]
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Any:
        """Parse a JSON string, or read a file path, written by :meth:`to_json`."""
        s = str(text_or_path)
        if not s.lstrip().startswith("{"):
            s = Path(s).read_text()
        return cls.from_dict(json.loads(s))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class FixedCosts:
    """What the runtime adds to compute on one machine, charged by the plan's prediction.

    Measured once per machine by ``engine.overhead.measure_fixed_costs`` (its dict gives these
    fields) on a model whose layers cost almost nothing:

    - ``action_s``: per compute action (F, B, I, W): dispatch, posting transfers, bookkeeping;
    - ``message_latency_s``: per point-to-point message, on top of bytes / link rate;
    - ``link_bytes_per_s``: the link's rate (used when ``partition`` is given no link);
    - ``step_s``: per optimizer step (zero_grad, reading the step's verdict, an empty update);
    - ``optimizer_s_per_byte``: seconds per parameter byte of the update, per optimizer name;
    - ``message_busy_s``: per message end (a send issued, a receive posted), what the call costs
      its rank beyond ``action_s`` when the ranks are computing (measured with compute running,
      not on the compute-free model);
    - ``action_s_send_wait`` / ``step_s_send_wait``: ``action_s`` and ``step_s`` for the
      schedules whose sends the gloo runtime waits before each compute, with its transport thread
      under SCHED_BATCH (``engine.schedules.send_mode`` ``"compute"``: gpipe, 1f1b); None: the
      same as the others (:meth:`runtime_costs`);
    - ``action_s_yield`` / ``step_s_yield``: the same for the schedules that yield to their sends
      in flight (``send_mode`` ``"yield"``: interleaved-1f1b); None: ``action_s``, ``step_s``;
    - ``cores``: the processors the machine's ranks share (the CPU cores this process may run
      on); the plan time-shares them when a pipeline has more ranks than cores. None: one
      processor per rank.
    - ``shared_efficiency``: the fraction of those cores' time that ranks outnumbering them get
      (``partitioner.shared.fit_shared_costs``, from a pipeline of three ranks on two cores
      measured by ``engine.overhead.measure_cpu_costs`` at two microbatch sizes); the plan
      simulates such a pipeline on ``cores x shared_efficiency``. 1.0: not measured.
    - ``shared_efficiency_by_mode``: per runtime mode (``engine.schedules.send_mode``), that
      fraction where it was fitted apart (``fit_shared_costs``: the schedules that wait for their
      sends before each compute block more often); a mode not in it gets ``shared_efficiency``
      (:meth:`shared_efficiency_for`).
    - ``shared_action_s``: what each compute action costs such ranks beyond ``action_s`` (a
      switch between ranks and the caches it refills; fitted with ``shared_efficiency``, which
      the size of the actions tells apart from it); charged only when ranks outnumber the cores.
      0.0: not measured.

    The CPU a rank spends off its compute, charged as load on the shared cores only when a
    pipeline's ranks outnumber them (``engine.overhead.measure_cpu_costs``; the figures above are
    wall times measured with a core per rank):

    - ``step_cpu_s``: per runtime mode (``send_mode``), the main thread's CPU per step outside
      its actions (the CPU part of the per-step cost);
    - ``message_cpu_byte_s``: CPU seconds per byte of a message end (every thread: gloo's
      transport thread copies), charged for the bytes beyond ``message_busy_bytes``, the size at
      which ``message_busy_s`` (which holds the rest of a message's CPU) is measured;
      ``message_cpu_s``: the same line's CPU at zero bytes (a record).
    
    >>> FixedCosts(action_s=2e-4, optimizer_s_per_byte={"sgd": 3e-10}).optimizer_s("sgd", 4e6)
    0.0012
    """

    action_s: float = 0.0
    message_latency_s: float = 0.0
    link_bytes_per_s: float | None = None
    step_s: float = 0.0
    optimizer_s_per_byte: dict[str, float] = field(default_factory=dict)
    message_busy_s: float = 0.0
    action_s_send_wait: float | None = None
    step_s_send_wait: float | None = None
    action_s_yield: float | None = None
    step_s_yield: float | None = None
    cores: int | None = None
    shared_efficiency: float = 1.0
    shared_efficiency_by_mode: dict[str, float] = field(default_factory=dict)
    shared_action_s: float = 0.0
    step_cpu_s: dict[str, float] = field(default_factory=dict)
    message_cpu_s: float = 0.0
    message_cpu_byte_s: float = 0.0
    message_busy_bytes: int = 16384

    def runtime_costs(self, mode: str) -> tuple[float, float]:
        """(per action, per step) for a schedule the runtime runs in ``mode``
        (``engine.schedules.send_mode``: ``"compute"``, ``"yield"`` or ``"step"``).

        >>> FixedCosts(action_s=3e-4, step_s=2e-3, action_s_send_wait=1e-4).runtime_costs("compute")
        (0.0001, 0.002)
        """
        own = {"compute": (self.action_s_send_wait, self.step_s_send_wait),
               "yield": (self.action_s_yield, self.step_s_yield), "step": (None, None)}
        if mode not in own:
            raise ValueError(f"runtime mode {mode!r}: one of {sorted(own)} "
                             "(engine.schedules.send_mode)")
        action, step = own[mode]
        return (self.action_s if action is None else action,
                self.step_s if step is None else step)

    def shared_efficiency_for(self, mode: str) -> float:
        """The fraction of the shared cores' time that ranks outnumbering them get under a
        schedule the runtime runs in ``mode`` (``engine.schedules.send_mode``).

        >>> FixedCosts(shared_efficiency=0.8, shared_efficiency_by_mode={"step": 0.9}).shared_efficiency_for("compute")
        0.8
        """
        return float(self.shared_efficiency_by_mode.get(mode, self.shared_efficiency))

    def shared_cpu(self, mode: str, message_bytes: float) -> tuple[float, float]:
        """(per step, per message end of ``message_bytes``) CPU seconds that a rank spends off its
        actions and that its charged wall costs do not hold as load on shared cores, for a
        schedule the runtime runs in ``mode``: the main thread's per-step CPU, and a message's
        per-byte CPU beyond ``message_busy_bytes``.

        >>> FixedCosts(step_cpu_s={"compute": 7e-4}, message_cpu_byte_s=2e-10).shared_cpu("compute", 16384 + 1e6)
        (0.0007, 0.0002)
        """
        extra = max(0.0, float(message_bytes) - self.message_busy_bytes) * self.message_cpu_byte_s
        return float(self.step_cpu_s.get(mode, 0.0)), extra

    def optimizer_s(self, optimizer: str, param_bytes: float) -> float:
        """Seconds of one ``optimizer`` update of ``param_bytes`` bytes of parameters."""
        return float(self.optimizer_s_per_byte.get(optimizer.lower(), 0.0)) * float(param_bytes)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FixedCosts":
        """From ``engine.overhead.measure_fixed_costs``'s dict (extra keys are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Profile(JsonMixin):
    """An ordered list of :class:`LayerCost` plus how it was obtained.

    ``dtype`` is the parameter/activation dtype of the profile (it sets bytes per parameter
    for the optimizer-state model); ``meta`` is free-form provenance (device, mode, ...);
    ``fixed``: the runtime's fixed costs on the machine (None: compute only).
    """

    layers: list[LayerCost]
    dtype: str = "float32"
    meta: dict[str, Any] = field(default_factory=dict)
    fixed: FixedCosts | None = None

    def __post_init__(self) -> None:
        self.layers = list(self.layers)
        if not self.layers:
            raise ValueError("Profile needs at least one layer")

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def itemsize(self) -> int:
        """Bytes per parameter element for ``dtype``."""
        return _ITEMSIZE.get(self.dtype.replace("torch.", ""), 4)

    @property
    def total_params(self) -> int:
        """Number of parameters (elements) of the whole model."""
        return sum(lc.param_bytes for lc in self.layers) // self.itemsize

    def to_dict(self) -> dict[str, Any]:
        d = {"dtype": self.dtype, "meta": self.meta, "layers": [asdict(lc) for lc in self.layers]}
        if self.fixed is not None:
            d["fixed"] = asdict(self.fixed)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        known = {f.name for f in fields(LayerCost)}
        layers = []
        for i, row in enumerate(d["layers"]):
            extra = set(row) - known
            if extra:
                raise ValueError(f"layer {i}: unknown LayerCost fields {sorted(extra)}; known: {sorted(known)}")
            layers.append(LayerCost(**row))
        fixed = FixedCosts.from_dict(d["fixed"]) if d.get("fixed") else None
        return cls(layers=layers, dtype=d.get("dtype", "float32"), meta=dict(d.get("meta", {})),
                   fixed=fixed)



_ITEMSIZE = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8, "double": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
