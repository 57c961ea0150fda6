"""The partition plan: stage ranges, predicted time and memory, explanation, exports.

Example::

    plan = partitioner.partition(prof, 4, microbatches=8)
    print(plan.summary())
    plan.to_json("plan.json")
    parts = plan.to_deepspeed_parts()             # [0, b1, b2, b3, n]
    spec = plan.to_pipelining_split_points()      # {"5": SplitPoint.BEGINNING, ...}
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence
from partitioner.costs import JsonMixin

__all__ = ["Plan", "PartitionError", "format_search"]


class PartitionError(ValueError):
    """The problem has no solution; the message names what would work."""


@dataclass
class Plan(JsonMixin):
    """A pipeline split and its predicted cost.

    Per chunk (``num_stages * virtual_stages`` entries; chunk c runs on rank ``chunk_ranks[c]``,
    the schedule's placement: c % num_stages, or a V for zbv):
    ``stage_ranges`` (half-open layer ranges), ``stage_time_s`` (forward + backward, plus
    recomputation and boundary transfers), ``stage_memory_bytes`` (predicted peak),
    ``stage_activation_bytes`` (saved-for-backward bytes at the peak), ``stage_inflight``,
    ``stage_pending`` (split-backward schedules: the microbatches whose weight gradients are
    still deferred at the rank's peak; their kept gradients count in ``temporary``),
    ``stage_recompute`` (and ``recompute_granularity``: "chunk", one checkpoint per recomputing
    chunk, or "layer", one per layer; marked R and RL in the summary). ``sequence_parallel``: the
    profile was planned under sequence parallelism (``partitioner.recompute.sequence_parallel_profile``,
    its ``meta["sequence_parallel"]``). Per rank: ``rank_memory_bytes`` (predicted peak), ``rank_fits`` and
    ``rank_memory_breakdown`` (per rank, bytes of ``parameters``, ``gradients``,
    ``optimizer_state``, ``activations``, ``communication``, ``temporary`` at that peak; they sum
    to ``rank_memory_bytes``; see ``partitioner.memory``). A chunk's ``stage_memory_bytes`` is its
    share of its rank's peak (the shares of a rank sum to it). ``precision``: the run's, as
    planned (what the parameters cost).

    ``step_s`` / ``bubble_fraction``: from :meth:`simulate` (``engine.simulate`` on these
    costs; see ``predicted_by``). ``lower_bound_s``: a lower bound on the step of this schedule for any
    split, using ``bottleneck_lower_bound_s = max(largest layer, total / chunks)`` (gpipe and
    1f1b: ``(m - 1) * that + total``; other schedules: ``max(m * per-rank bound, total)``).
    ``gap = step_s / lower_bound_s - 1``. ``max_inflight``: zb-h2's memory knob as planned
    (None: the schedule's default). Fixed costs of the runtime (``partitioner.FixedCosts``, from
    the profile): ``action_s`` is charged on every compute action, ``message_busy_s`` on every
    action per message it sends or receives across ranks, ``boundary_comm_s`` includes the
    per-message latency, and ``step_fixed_s`` (per step) plus the slowest rank's optimizer update
    (``rank_optimizer_s``) are added to the simulated schedule. ``shared_cores``: the processors
    one pipeline's ranks share (``FixedCosts.cores`` over the replicas and tp ranks on the machine); when
    fewer than its ranks, :meth:`simulate` time-shares them (None: a processor per rank) and
    charges, as load on them, the CPU a rank spends off its actions that the wall costs above do
    not hold (``FixedCosts.shared_cpu``): ``step_cpu_s``, the per-step CPU, and each rank's
    optimizer update, run as the step's tail after its last action (``engine.simulate``'s
    ``tail_s``); ``boundary_cpu_s``, per boundary, the per-byte CPU of one message end beyond
    what ``message_busy_s`` holds. ``search``: when
    ``partitioner.search`` chose this plan's layout, its record (the choice, the alternatives
    with their predicted step and memory, every layout considered; see ``SearchResult.record``).
    Pipeline transfers (``boundary_comm_s``: one message's seconds per boundary, each way) come
    from ``link_source`` (:mod:`partitioner.transfers`): ``"config"`` (the ``link_bytes_per_s``
    given), ``"measured"`` (the fixed costs' link), ``"device_spec"`` (the device's NVLink or NIC
    by whether the boundary's two ranks share a node: ``boundary_links``, per boundary
    ``"device_spec intra-node"``, ``"device_spec inter-node"`` or ``"on rank"``;
    ``link_bytes_per_s`` is then the slowest of them) or ``"free"`` (none given).
    ``split_search``: how the split was chosen: ``"exact"`` (the min-bottleneck split, or the
    fastest predicted step over every split), ``"local search"`` (the min-bottleneck split refined
    by a hill climb on the predicted step over a bounded number of splits: not proven fastest), or
    the baseline's name.
    """

    stage_ranges: list[tuple[int, int]]
    stage_time_s: list[float]
    stage_memory_bytes: list[int]
    bottleneck_s: float
    step_s: float
    bubble_fraction: float
    lower_bound_s: float
    schedule: str = "1f1b"
    num_stages: int = 1
    microbatches: int = 1
    virtual_stages: int = 1
    data_parallel: int = 1
    zero_stage: int = 1
    optimizer: str = "adamw"
    method: str = "optimal"
    fits: bool = True
    memory_limit_bytes: list[int] | None = None
    link_bytes_per_s: float | None = None
    link_source: str | None = None   # where transfer costs come from: config | measured | device_spec | free
    boundary_links: list[str] = field(default_factory=list)   # device_spec: per boundary, its link
    max_inflight: int | None = None
    bottleneck_lower_bound_s: float = 0.0
    closed_form_step_s: float = 0.0
    predicted_by: str = "engine.simulate"
    stage_activation_bytes: list[int] = field(default_factory=list)
    stage_inflight: list[int] = field(default_factory=list)
    stage_pending: list[int] = field(default_factory=list)
    stage_recompute: list[bool] = field(default_factory=list)
    recompute_granularity: str = "chunk"   # a recomputing chunk's checkpoints: the chunk, or each layer
    stage_forward_s: list[float] = field(default_factory=list)
    stage_backward_s: list[float] = field(default_factory=list)
    stage_weight_s: list[float] = field(default_factory=list)
    boundary_comm_s: list[float] = field(default_factory=list)
    action_s: float = 0.0
    message_busy_s: float = 0.0
    step_fixed_s: float = 0.0
    shared_cores: float | None = None
    step_cpu_s: float = 0.0   # charged only when shared_cores < num_stages
    boundary_cpu_s: list[float] = field(default_factory=list)   # idem, per message end of each boundary
    rank_optimizer_s: list[float] = field(default_factory=list)
    rank_collective_s: list[float] = field(default_factory=list)   # the replicas' per-step collectives, exposed
    tensor_parallel: int = 1
    sequence_parallel: bool = False   # the profile planned under sequence parallelism over the tp ranks
    reshard_after_forward: bool | None = None   # ZeRO-3's reshard policy (None: not ZeRO-3)
    rank_memory_bytes: list[int] = field(default_factory=list)
    rank_fits: list[bool] = field(default_factory=list)
    rank_memory_breakdown: list[dict[str, int]] = field(default_factory=list)
    precision: str = "fp32"
    layer_names: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    search: dict[str, Any] | None = None
    split_search: str = "exact"
    step_sync: str = "global"   # optimizer.step_sync: post_validate is predicted in the steady state

    def __post_init__(self) -> None:
        self.stage_ranges = [(int(a), int(b)) for a, b in self.stage_ranges]

    # -- derived ----------------------------------------------------------------------
    @property
    def gap(self) -> float:
        """Optimality gap against the schedule's lower bound: step_s / lower_bound_s - 1."""
        return self.step_s / self.lower_bound_s - 1 if self.lower_bound_s > 0 else 0.0

    @property
    def num_layers(self) -> int:
        return self.stage_ranges[-1][1]

    @property
    def num_chunks(self) -> int:
        return len(self.stage_ranges)

    @property
    def chunk_ranks(self) -> list[int]:
        """The pipeline rank of each chunk (``engine.schedules.chunk_ranks`` of this schedule)."""
        from engine.schedules import chunk_ranks

        return chunk_ranks(self.schedule, self.num_stages, self.virtual_stages)

    @property
    def stage_layers(self) -> list[int]:
        """Number of layers per chunk."""
        return [b - a for a, b in self.stage_ranges]

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank that runs model chunk ``chunk`` (the schedule's placement)."""
        return self.chunk_ranks[chunk]

    def per_rank(self, values: Sequence[float]) -> list[float]:
        """Per-chunk ``values`` summed per pipeline rank (the chunks a rank runs)."""
        out = [0.0] * self.num_stages
        for r, x in zip(self.chunk_ranks, values):
            out[r] += x
        return out

    # -- prediction -------------------------------------------------------------------
    def simulate(self, forward_s: Sequence[float] | None = None,
                 backward_s: Sequence[float] | None = None) -> Any:
        """The predicted timeline of one step's schedule: ``engine.simulate`` of this plan's
        schedule on its per-chunk costs (``stage_forward_s``, ``stage_backward_s`` with
        recomputation, ``stage_weight_s``, ``boundary_comm_s``), each compute action charged
        ``action_s`` more, and ``message_busy_s`` per message it sends or receives across ranks
        (an F and the B or I of the same chunk have the same: one per cut at either end).
        ``forward_s`` / ``backward_s`` replace the compute costs (e.g. measured ones) and keep
        the rest. The one place a plan's timeline is predicted: the planner, the training run's
        timeline pictures and the benchmark's predictions all call it; :meth:`predicted_step_s`
        adds what a step costs beyond its schedule.

        With ``step_sync="post_validate"`` no rank waits for another between steps: the
        simulation runs :attr:`steady_steps` consecutive steps (``simulate(..., steps=N)``), step
        k + 1's warm-up overlapping step k's cool-down, and ``step_s`` is the last one's.

        >>> res = plan.simulate()                         # doctest: +SKIP
        >>> res.step_s, res.bubble_fraction; res.to_png("timeline.png")  # doctest: +SKIP
        """
        from engine.simulate import simulate

        sched, f, b, w, comm = self._schedule_and_costs(forward_s, backward_s)
        tail = None
        if self.shares_cores:   # the step's CPU and each rank's update: load on the shared cores
            opt = list(self.rank_optimizer_s) if len(self.rank_optimizer_s) == self.num_stages else [0.0] * self.num_stages
            tail = [o + self.step_cpu_s for o in opt]
        return simulate(sched, f, b, weight_s=w, comm_s=comm, steps=self.steady_steps,
                        cores=self.shared_cores, tail_s=tail)

    def step_without_cpu_load_s(self) -> float:
        """The step :meth:`simulate` and :meth:`predicted_step_s` predict without the CPU off the
        actions charged as load on shared cores (no ``step_cpu_s`` tail, no ``boundary_cpu_s``:
        the model before they were measured), for comparison; the same as ``step_s`` when the
        ranks do not share cores."""
        from dataclasses import replace

        from engine.simulate import simulate

        plain = replace(self, step_cpu_s=0.0, boundary_cpu_s=[])
        sched, f, b, w, comm = plain._schedule_and_costs(None, None)
        res = simulate(sched, f, b, weight_s=w, comm_s=comm, steps=plain.steady_steps, cores=plain.shared_cores)
        return plain.predicted_step_s(res)

    @property
    def shares_cores(self) -> bool:
        """Whether this pipeline's ranks outnumber the processors they share (``shared_cores``)."""
        return self.shared_cores is not None and self.shared_cores < self.num_stages

    @property
    def steady_steps(self) -> int:
        """Steps :meth:`simulate` runs: 1 (the optimizer step synchronises the ranks) or, with
        ``step_sync="post_validate"``, 3 (the steady state is reached at the second)."""
        return 3 if self.step_sync == "post_validate" else 1

    def build_schedule(self) -> Any:
        """The schedule this plan runs (``engine.schedules.Schedule``): its named schedule, or for
        ``zb-auto`` the one built from this plan's own per-chunk costs (those :meth:`simulate`
        uses), each rank bounded by the in-flight count the memory model read (the same schedule
        built without costs), when no rank of it holds or has pending more microbatches than the
        memory model's peak; else zb-auto built without costs, the schedule the memory model read.
        Either way the plan's memory holds. Pass it to ``engine.Pipeline``.

        >>> plan.build_schedule().actions[0][:3]   # doctest: +SKIP
        """
        return self._schedule_and_costs(None, None)[0]

    def _schedule_and_costs(self, forward_s: Sequence[float] | None, backward_s: Sequence[float] | None
                            ) -> tuple[Any, list[float], list[float], list[float], Any]:
        from engine.schedules import SCHEDULE_INFO, build_schedule, message_ends, peak_inflight

        a = self.action_s
        sched = build_schedule(self.schedule, self.num_stages, self.microbatches, self.virtual_stages,
                               max_inflight=self.max_inflight)
        f = [x + a for x in (self.stage_forward_s if forward_s is None else forward_s)]
        b = list(self.stage_backward_s if backward_s is None else backward_s)
        w = [min(x, y) for x, y in zip(self.stage_weight_s or b, b)]
        if SCHEDULE_INFO[self.schedule].splits_backward:   # I (it carries the messages) and W
            b, w = [x + 2 * a for x in b], [x + a for x in w]
        else:
            b, w = [x + a for x in b], [x + a for x in w]
        ends = message_ends(sched)
        if self.message_busy_s and len(f) == len(b) == len(ends):  # else simulate names the misfit
            f = [x + self.message_busy_s * k for x, k in zip(f, ends)]
            b = [x + self.message_busy_s * k for x, k in zip(b, ends)]
        if self.shares_cores and len(self.boundary_cpu_s) == len(f) - 1 == len(b) - 1:
            extra = self._message_cpu(sched)
            f, b = [x + e for x, e in zip(f, extra)], [x + e for x, e in zip(b, extra)]
        comm = self.boundary_comm_s if len(f) > 1 and self.boundary_comm_s else 0.0
        if self.schedule == "zb-auto" and len(f) == len(b) == len(w) == self.num_stages:
            built = build_schedule("zb-auto", self.num_stages, self.microbatches,
                                   **self._auto_kwargs(peak_inflight(sched), f, b, w, comm,
                                                       self.stage_pending, self.steady_steps))
            if self._within_memory(built):
                sched = built
        return sched, f, b, w, comm

    def _message_cpu(self, sched: Any) -> list[float]:
        """Per chunk, the ``boundary_cpu_s`` of the cross-rank messages each of its F (and B or I)
        actions sends or receives (``engine.schedules.message_ends``, boundary by boundary)."""
        n, c = len(self.boundary_cpu_s) + 1, self.boundary_cpu_s
        cross = [sched.rank_of(s) != sched.rank_of(s + 1) for s in range(n - 1)]
        return [(c[s - 1] if s > 0 and cross[s - 1] else 0.0) + (c[s] if s < n - 1 and cross[s] else 0.0)
                for s in range(n)]

    def _within_memory(self, schedule: Any) -> bool:
        """Whether every state of ``schedule`` holds and has pending no more microbatches per
        chunk than the memory model's peak (``stage_inflight``, ``stage_pending``): then no rank
        needs more than the plan says, whatever the bytes per microbatch."""
        from .memory import schedule_states

        if len(self.stage_inflight) != self.num_chunks or len(self.stage_pending) != self.num_chunks:
            return False
        for r, states in enumerate(schedule_states(schedule)):
            mine = schedule.stages_of(r)
            for held, pend in states:
                if any(h > self.stage_inflight[c] or g > self.stage_pending[c]
                       for h, g, c in zip(held, pend, mine)):
                    return False
        return True

    @staticmethod
    def _auto_kwargs(caps: Sequence[int], f: Sequence[float], b: Sequence[float], w: Sequence[float],
                     comm: Any, pending: Sequence[int], steps: int = 1) -> dict[str, Any]:
        out = {"max_inflight": tuple(caps), "forward_s": tuple(f), "backward_s": tuple(b),
               "weight_s": tuple(w), "comm_s": comm if isinstance(comm, float) else tuple(comm)}
        if steps > 1:   # optimised for the steady state it will run in (post_validate)
            out["steps"] = min(int(steps), 2)
        if len(pending) == len(caps) and min(pending, default=0) >= 1:
            out["max_pending"] = tuple(int(x) for x in pending)
        return out

    def schedule_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that make ``engine.schedules.build_schedule(self.schedule,
        num_stages, microbatches, virtual_stages, **kwargs)`` return :meth:`build_schedule`'s
        schedule (hashable values): ``max_inflight`` for the named schedules, and for zb-auto its
        per-rank bounds and this plan's costs."""
        if self.schedule != "zb-auto":
            return {"max_inflight": self.max_inflight}
        from engine.schedules import build_schedule, peak_inflight
        sched, f, b, w, comm = self._schedule_and_costs(None, None)
        unit = build_schedule("zb-auto", self.num_stages, self.microbatches, max_inflight=self.max_inflight)
        if sched is unit:   # the cost-built one would need more memory than planned
            return {"max_inflight": self.max_inflight}
        return self._auto_kwargs(peak_inflight(unit), f, b, w, comm, self.stage_pending,
                                 self.steady_steps)

    def predicted_step_s(self, sim: Any) -> float:
        """A whole step from its simulated schedule (an ``engine.simulate`` result): plus the
        per-step fixed cost and the optimizer updates. No rank waits for another before its
        update (the step's verdict rides the last microbatch's messages, ``engine.executor``):
        rank ``r`` updates right after its own last action, so the step ends at the latest
        ``end_r + update_r``, not at the schedule's end plus the slowest update. A steady-state
        simulation (several steps, ``step_sync="post_validate"``): its last step plus the
        slowest rank's update (each rank updates between its steps; an upper bound)."""
        if sim.tails:   # shared cores: the updates and the step's CPU ran in the simulation
            return self._shared_step_s(sim)
        ends = [row[-1][2] if row else 0.0 for row in sim.timeline]
        if len(self.rank_collective_s) == len(ends):   # the replicas' gradient sync (and gathers) after the schedule
            ends = [e + c for e, c in zip(ends, self.rank_collective_s)]
        opt = list(self.rank_optimizer_s) or [0.0] * len(ends)
        if len(sim.steps_s) > 1:
            return sim.steps_s[-1] + max(opt, default=0.0) + self.step_fixed_s
        if len(opt) != len(ends):  # not per rank of this schedule: the slowest after the end
            return sim.step_s + self.step_fixed_s + max(opt)
        return max(e + o for e, o in zip(ends, opt)) + self.step_fixed_s

    def _shared_step_s(self, sim: Any) -> float:
        """:meth:`predicted_step_s` of a simulation with the ranks' tails (shared cores): the
        latest tail's end (each rank's update and step CPU, time-shared), plus the replicas'
        collectives after it, plus what the per-step wall cost holds beyond its CPU."""
        rest = max(0.0, self.step_fixed_s - self.step_cpu_s)
        coll = list(self.rank_collective_s) if len(self.rank_collective_s) == len(sim.tails) else [0.0] * len(sim.tails)
        if len(sim.steps_s) > 1:
            return sim.steps_s[-1] + max(coll, default=0.0) + rest
        return max((t[-1][1] if t else 0.0) + c for t, c in zip(sim.tails, coll)) + rest

    # -- JSON -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stage_ranges"] = [list(r) for r in self.stage_ranges]
        d["gap"] = self.gap
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    # -- table ------------------------------------------------------------------------
    @property
    def _recompute_mark(self) -> str:
        return " RL" if self.recompute_granularity == "layer" else " R"

    def summary(self, width: int = 110) -> str:
        """A readable table of the plan (rich when available, else plain text): one row per
        chunk, then each rank's predicted peak by kind."""
        head = ["stage", "rank", "layers", "#", "time ms", "mem GiB", "act GiB", "in-flight", "limit GiB", "fits"]
        rows = []
        p = self.num_stages
        ranks = self.chunk_ranks
        for c, (a, b) in enumerate(self.stage_ranges):
            r = ranks[c]
            lim = self.memory_limit_bytes[r] if self.memory_limit_bytes else None
            rows.append([
                str(c), str(r), f"{a}-{b - 1}" + (self._recompute_mark if self.stage_recompute and self.stage_recompute[c] else ""),
                str(b - a), f"{self.stage_time_s[c] * 1e3:.3f}", f"{self.stage_memory_bytes[c] / 2**30:.3f}",
                f"{self.stage_activation_bytes[c] / 2**30:.3f}" if self.stage_activation_bytes else "-",
                str(self.stage_inflight[c]) if self.stage_inflight else "-",
                "-" if lim is None else f"{lim / 2**30:.3f}",
                ("yes" if self.rank_fits[r] else "NO") if self.rank_fits else "-",
            ])
        title = (f"{self.method} split: {self.num_layers} layers, {self.schedule}, p={p}, m={self.microbatches}"
                 + (f", v={self.virtual_stages}" if self.virtual_stages > 1 else "")
                 + (f", dp={self.data_parallel} zero={self.zero_stage}" if self.data_parallel > 1 else "")
                 + (f", tp={self.tensor_parallel}" if self.tensor_parallel > 1 else "")
                 + (" sequence-parallel" if self.sequence_parallel else "")
                 + (f" reshard_after_forward={str(self.reshard_after_forward).lower()}"
                    if self.reshard_after_forward is not None else "")
                 + f", {self.precision} {self.optimizer}")
        foot = [
            f"step {self.step_s * 1e3:.3f} ms ({self.predicted_by}); bubble {self.bubble_fraction:.1%}; "
            f"bottleneck {self.bottleneck_s * 1e3:.3f} ms",
            f"lower bound {self.lower_bound_s * 1e3:.3f} ms; gap {self.gap:.1%}; fits: {'yes' if self.fits else 'NO'}",
        ] + [f"- {n}" for n in self.notes]
        tables = [(title, head, rows)]
        if self.rank_memory_breakdown:
            tables.append(self._memory_table())
        return _render(tables, foot, width) + (format_search(self.search) if self.search else "")

    def _memory_table(self) -> tuple[str, list[str], list[list[str]]]:
        """Each rank's predicted peak memory by kind (GiB)."""
        keys = ("parameters", "gradients", "optimizer_state", "activations", "communication", "temporary")
        head = ["rank", "params", "grads", "optimizer", "activations", "comm", "temporary", "peak GiB"]
        if any("gathered_parameters" in d for d in self.rank_memory_breakdown):   # ZeRO-3
            keys = ("parameters", "gathered_parameters") + keys[1:]
            head = ["rank", "param shards", "gathered"] + head[2:]
        rows = []
        for r, d in enumerate(self.rank_memory_breakdown):
            rows.append([str(r)] + [f"{d.get(k, 0) / 2**30:.3f}" for k in keys]
                        + [f"{self.rank_memory_bytes[r] / 2**30:.3f}"])
        return "predicted peak memory per rank (GiB)", head, rows

    def __str__(self) -> str:
        return self.summary()

    # -- exports ----------------------------------------------------------------------
    def to_deepspeed_parts(self) -> list[int]:
        """Stage boundaries as DeepSpeed's ``PipelineModule.parts``: ``[0, b1, ..., n]``
        (stage i owns layers ``parts[i]:parts[i+1]``). DeepSpeed's pipeline has no
        interleaving, so this needs ``virtual_stages == 1``."""
        if self.virtual_stages != 1:
            raise ValueError("DeepSpeed's PipelineModule has one chunk per stage; re-plan with virtual_stages=1")
        return [self.stage_ranges[0][0]] + [b for _, b in self.stage_ranges]

    def to_deepspeed_module(self, layers: Sequence[Any], **kwargs: Any) -> Any:
        """Build a ``deepspeed.pipe.PipelineModule`` that uses these boundaries.

        DeepSpeed only knows ``partition_method`` = uniform | parameters | type:regex, so the
        returned module is a subclass whose ``_partition_layers`` installs
        :meth:`to_deepspeed_parts` (checked against DeepSpeed 0.19.8). Needs DeepSpeed's
        process group initialised (world size a multiple of ``num_stages``), as any
        PipelineModule does. ``kwargs`` go to ``PipelineModule`` (``loss_fn``, ...).
        """
        from deepspeed.pipe import PipelineModule

        parts = self.to_deepspeed_parts()
        if len(layers) != parts[-1]:
            raise ValueError(f"the plan covers {parts[-1]} layers but {len(layers)} were given")

        class PlannedPipelineModule(PipelineModule):
            def _partition_layers(self, method: str = "uniform") -> None:  # noqa: ARG002
                self.parts = list(parts)
                stage_id = self._topo.get_coord(self.global_rank).pipe
                self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

        kwargs.setdefault("num_stages", self.num_stages)
        return PlannedPipelineModule(layers=list(layers), **kwargs)

    def to_pipelining_split_points(self, module_names: Sequence[str] | None = None) -> dict[str, Any]:
        """``split_spec`` for ``torch.distributed.pipelining.pipeline``: the first layer of every
        chunk after the first mapped to ``SplitPoint.BEGINNING``.

        ``module_names[i]`` is the qualified name of layer i inside the traced module
        (default ``str(i)``: the children of an ``nn.Sequential``).
        """
        from torch.distributed.pipelining import SplitPoint

        names = [str(i) for i in range(self.num_layers)] if module_names is None else list(module_names)
        if len(names) != self.num_layers:
            raise ValueError(f"module_names has {len(names)} names but the plan has {self.num_layers} layers")
        return {names[a]: SplitPoint.BEGINNING for a, _ in self.stage_ranges[1:]}


def _search_cells(row: dict[str, Any], best: float | None) -> list[str]:
    step, mem = row.get("step_s"), row.get("rank_memory_bytes") or []
    rec = sum(bool(x) for x in row.get("recompute") or [])
    return [row["schedule"], str(row["virtual_stages"]), str(row["microbatches"]),
            "-" if row.get("max_inflight") is None else str(row["max_inflight"]),
            "-" if step is None else f"{step * 1e3:.3f}",
            "-" if step is None or not best else f"{step / best:.3f}x",
            "-" if row.get("bubble_fraction") is None else f"{row['bubble_fraction']:.1%}",
            "-" if not mem else f"{max(mem) / 2**30:.3f}",
            "-" if not mem else str(rec) + (" per-layer" if rec and row.get("recompute_granularity") == "layer" else ""),
            row["status"],
            _costs_cell(row.get("profile") or "")]


def _costs_cell(how: str) -> str:
    """The search's ``Candidate.profile`` in a few characters: ``profiled`` (at that size),
    ``interp a..b``, ``bound a`` (scaled up from a, an upper bound), ``linear a`` (asked for)."""
    words = how.split()
    if how.startswith("profiled"):
        return "profiled"
    if how.startswith("interpolated"):
        return f"interp {words[1]}"
    if how.startswith("scaled linearly"):
        return ("bound " if "upper bound" in how else "linear ") + words[3]
    return how[:12] or "-"


def format_search(record: dict[str, Any], width: int = 120) -> str:
    """The table of a ``partitioner.search`` record (``Plan.search``): the chosen layout (first
    row) and the next best, each with its predicted step, bubble, peak rank memory and the chunks
    that recompute (and "per-layer" for per-layer checkpoints), whether each is planned under
    sequence parallelism where any layout is; then the counts and notes."""
    head = ["#", "schedule", "v", "m", "inflight", "step ms", "vs best", "bubble", "peak rank GiB",
            "recompute", "status", "costs"]
    chosen = record["chosen"]
    rows = [chosen] + list(record.get("alternatives", []))
    best = chosen.get("step_s")
    body = [[("*" if k == 0 else str(k + 1))] + _search_cells(r, best) for k, r in enumerate(rows)]
    if chosen.get("tensor_parallel") is not None:   # the 3-D search: its layout per row
        width = max(width, 170)
        head = head[:1] + ["dp x tp", "ZeRO", "reshard"] + head[1:]
        body = [b[:1] + [f"{r['data_parallel']} x {r['tensor_parallel']}", str(r["zero_stage"]),
                         "-" if r.get("reshard_after_forward") is None else str(r["reshard_after_forward"]).lower()]
                + b[1:] for b, r in zip(body, rows)]
    if any(r.get("sequence_parallel") for r in record.get("candidates", rows)):   # planned both ways
        head = head + ["SP"]
        body = [b + ["yes" if r.get("sequence_parallel") else "no"] for b, r in zip(body, rows)]
    title = (f"search: {record['considered']} layouts ({record.get('ok', 0)} solved, "
             f"{record.get('pruned', 0)} pruned, {record.get('infeasible', 0)} infeasible, "
             f"{record.get('skipped', 0)} skipped), {record['seconds']:.2f} s"
             + (f" ({record['profile_seconds']:.2f} s profiling)" if record.get("profile_seconds", 0) >= 0.01 else "")
             + "; * = chosen")
    foot = [f"- {n}" for n in record.get("notes", [])]
    return _render([(title, head, body)], foot, width, left=("schedule", "status", "costs"),
                   no_wrap=True)


def _render(tables: list[tuple[str, list[str], list[list[str]]]], foot: list[str], width: int,
            left: tuple[str, ...] = ("layers",), no_wrap: bool = False) -> str:
    """Tables (title, header, rows) then the foot lines, with rich (plain text without it);
    the ``left`` columns are left-justified, the others right."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency, plain text is a fallback
        return "".join(_plain(t, h, r, []) for t, h, r in tables) + "\n".join(foot) + "\n"
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    for title, head, rows in tables:
        t = Table(title=title)
        for h in head:
            t.add_column(h, justify="left" if h in left else "right", no_wrap=no_wrap)
        for r in rows:
            t.add_row(*r)
        con.print(t)
    for line in foot:
        con.print(line, highlight=False, markup=False)
    return buf.getvalue()


def _plain(title: str, head: list[str], rows: list[list[str]], foot: list[str]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w[i]) for i, c in enumerate(cells))  # noqa: E731
    out = [title, line(head), "  ".join("-" * x for x in w)] + [line(r) for r in rows] + foot
    return "\n".join(out) + "\n"
