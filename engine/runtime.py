"""The pipeline runtime: one process per (pipeline stage, data-parallel replica) runs its rank's
lowered action list (``engine.schedules.lower``) and then the optimizer step.

Example (inside a worker started by ``engine.launch``; see the README's "Programmatic API")::

    pipe = Pipeline([lambda: nn.Linear(8, 8) for _ in range(4)], [(0, 2), (2, 4)],
                    loss_fn=nn.functional.mse_loss, schedule="1f1b", microbatches=4,
                    optimizer=OptimizerConfig(name="sgd", lr=0.1))
    result = pipe.train_step(x, y)        # x, y: the global batch; result.loss on every rank
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engine.allocator import tune_cpu_allocator
from engine.transport import set_transport_threads
from engine.backend import make_optimizer
from engine.choices import check_nonfinite, check_precision, check_recompute_granularity, loss_scaled
from engine.comm import P2P
from engine.executor import Executor, mean_loss
from engine.mesh import Mesh
from engine.policy import default_recv_lookahead, default_send_wait, default_transport_threads
from engine.optim import (NonFiniteError, OptimizerConfig, StageOptimizer,
                          check_optimizer_config, compute_dtype)
from engine.stage import Chunk, build_layers

__all__ = ["Pipeline", "StepResult", "check_stage_ranges", "default_recv_lookahead",
           "default_send_wait", "default_transport_threads"]


@dataclass
class StepResult:
    loss: float                  # global-batch mean, identical on every rank
    skipped: bool                # fp16 overflow / nonfinite="skip"
    grad_norm: float | None
    lr: float
    step_time_s: float
    stats: dict = field(default_factory=dict)   # this rank's figures


@dataclass(frozen=True)
class _Item:
    """A program entry for forward-only programs (same fields as Action / Comm)."""
    kind: str
    stage: int
    microbatch: int
    peer: int = -1


def check_stage_ranges(stage_ranges: Sequence[Sequence[int]], num_layers: int,
                       num_chunks: int | None = None) -> list[tuple[int, int]]:
    """Check that half-open ranges cover ``range(num_layers)`` exactly once, in order, each
    non-empty, and (if given) that there are ``num_chunks`` of them. Returns them as tuples."""
    ranges = [tuple(int(v) for v in r) for r in stage_ranges]
    if num_chunks is not None and len(ranges) != num_chunks:
        raise ValueError(f"got {len(ranges)} stage ranges for {num_chunks} model chunks "
                         "(num_stages x virtual_stages); pass one (start, stop) range per chunk")
    if not ranges:
        raise ValueError("stage_ranges is empty; pass one (start, stop) layer range per chunk")
    expect = 0
    for k, r in enumerate(ranges):
        if len(r) != 2:
            raise ValueError(f"stage range {k} is {r}; each must be a (start, stop) pair")
        start, stop = r
        if start != expect:
            what = "overlaps the previous one" if start < expect else \
                f"leaves layers {expect}..{start - 1} unassigned"
            raise ValueError(f"stage range {k} {r} {what}; ranges must be contiguous and cover "
                             f"layers 0..{num_layers - 1} exactly once, e.g. from "
                             "partitioner.partition(...).stage_ranges")
        if stop <= start:
            raise ValueError(f"stage range {k} {r} is empty; every chunk needs at least one "
                             f"layer (use fewer stages than the {num_layers} layers)")
        expect = stop
    if expect != num_layers:
        raise ValueError(f"stage ranges end at layer {expect} but the model has {num_layers} "
                         f"layers; the last range must stop at {num_layers}")
    return ranges


def _per_chunk(flag: bool | Sequence[bool], n_chunks: int) -> list[bool]:
    """``activation_checkpointing``: one bool for every chunk, or one per chunk (a plan's
    ``stage_recompute``, in chunk order)."""
    if isinstance(flag, (bool, int)):
        return [bool(flag)] * n_chunks
    flags = [bool(x) for x in flag]
    if len(flags) != n_chunks:
        raise ValueError(f"activation_checkpointing has {len(flags)} entries for {n_chunks} "
                         "chunks; give one bool, or one per chunk (e.g. plan.stage_recompute)")
    return flags


def _check_layout(num_layers: int, stage_ranges: Sequence[Sequence[int]], schedule: Any,
                  microbatches: int, virtual_stages: int, max_inflight: int | None = None) -> Any:
    """The stage ranges against the model and the schedule; returns the validated schedule."""
    from engine.schedules import Schedule, build_schedule, validate

    v = virtual_stages if not isinstance(schedule, Schedule) else schedule.virtual_stages
    n_chunks = len(stage_ranges)
    if n_chunks == 0:
        raise ValueError("stage_ranges is empty; pass one (start, stop) layer range per "
                         "chunk, e.g. partitioner.partition(...).stage_ranges")
    if n_chunks > num_layers:
        raise ValueError(f"{n_chunks} stage ranges for a model of {num_layers} layers: every "
                         f"chunk needs at least one layer; use at most {num_layers} stages "
                         "(x virtual_stages)")
    if n_chunks % v:
        raise ValueError(f"{n_chunks} stage ranges is not a multiple of virtual_stages={v}; "
                         "pass num_stages x virtual_stages ranges")
    p = n_chunks // v
    check_stage_ranges(stage_ranges, num_layers, n_chunks)
    if isinstance(schedule, Schedule):
        sched = schedule
        if sched.num_stages != p or sched.microbatches != microbatches:
            raise ValueError(f"schedule is for {sched.num_stages} stages x "
                             f"{sched.microbatches} microbatches, the pipeline has {p} x "
                             f"{microbatches}")
    else:
        sched = build_schedule(schedule, p, microbatches, v, max_inflight=max_inflight)
    validate(sched)
    return sched


def _check_tensor_parallel(optimizer: OptimizerConfig, precision: str,
                           ties: Sequence[tuple[str, str]]) -> None:
    """What tensor parallelism runs with: the torch backend (ZeRO 0) or FSDP2 (ZeRO 3), no
    ties."""
    from engine.optim import resolve_backend

    backend = resolve_backend(optimizer, precision)
    if backend not in ("torch", "fsdp"):
        raise ValueError(f"tensor_parallel > 1 runs on the torch optimizer backend (zero_stage 0) "
                         f"or FSDP2 (zero_stage 3), not {backend!r} (zero_stage="
                         f"{optimizer.zero_stage}): DeepSpeed's ZeRO-1/2 with tensor parallelism "
                         "is not built; set optimizer.zero_stage=0 or 3 (and a precision with "
                         "fp32 weights: fp32 or *-autocast) or tensor_parallel=1")
    if ties:
        raise ValueError(f"tensor_parallel > 1 does not support tied parameters ({ties[0][0]} "
                         f"tied to {ties[0][1]}); untie them (model.tie_embeddings=false) or "
                         "set tensor_parallel=1")


def _check_zero2_ties(ties: Sequence[tuple[str, str]], num_layers: int,
                      stage_ranges: Sequence[Sequence[int]], sched: Any) -> None:
    """ZeRO-2 shards gradients during backward: no parameter may be tied across ranks."""
    for a, b in ties:
        la, lb = (str(t).partition(".")[0] for t in (a, b))
        if not (la.isdigit() and lb.isdigit()):
            continue  # malformed: Pipeline's tie setup says how to write it
        la, lb = int(la), int(lb)
        if not (la < num_layers and lb < num_layers):
            continue
        owner = [sched.rank_of(next(c for c, (x, y) in enumerate(stage_ranges)
                                    if x <= layer < y)) for layer in (la, lb)]
        if owner[0] != owner[1]:
            raise ValueError(
                f"zero_stage=2 cannot be used with {a} tied to {b} across pipeline "
                f"stages {owner[0]} and {owner[1]}: their gradients are summed "
                "between stages before the step, but ZeRO-2 shards gradients "
                "during backward; use zero_stage=1, or untie")


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The random state a step's forwards draw from (CPU, and the device's on CUDA)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device)
                                   if device.type == "cuda" else None)


def _set_rng_state(device: torch.device, state: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class Pipeline:
    """One rank's view of a pipeline-parallel (x data-parallel) training job.

    See docs/contracts.md for the arguments. Extra keyword ``recv_lookahead``: how many upcoming
    receives are posted ahead of the compute that needs them (default:
    :func:`default_recv_lookahead`, 2 on NCCL; on gloo 2 for interleaved-1f1b and zbv, else 0);
    ``max_inflight``:
    zb-h2's bound on the microbatches a rank holds. ``transport_threads``: the scheduling policy
    of gloo's transport thread (:mod:`engine.transport`; default: :func:`default_transport_threads`,
    ``"batch"`` on gloo for gpipe, 1f1b and interleaved-1f1b, else ``"normal"``); ``send_wait``:
    what a rank does about its sends before each compute (:func:`default_send_wait`). Chunks are placed by the schedule
    (``Schedule.rank_of``: looped, or a V for zbv, whose first and last chunks share rank 0).
    ``activation_checkpointing``: one bool for every chunk, or one per chunk (global chunk
    order, e.g. ``Plan.stage_recompute``: recompute only where memory needs it).
    ``recompute_granularity``: what one checkpoint of a recomputing chunk covers, ``"chunk"``
    (the whole chunk) or ``"layer"`` (each layer: a held microbatch keeps every layer's input,
    a backward recomputes one layer at a time; ``engine.stage``), e.g. ``Plan.recompute_granularity``.
    """

    def __init__(self, layers: Any, stage_ranges: Sequence[Sequence[int]], *,
                 loss_fn: Callable[[Any, Any], Tensor], schedule: Any = "1f1b",
                 microbatches: int, virtual_stages: int = 1, data_parallel: int = 1,
                 optimizer: OptimizerConfig | None = None, precision: str = "fp32",
                 activation_checkpointing: bool | Sequence[bool] = False, seed: int = 0,
                 device: torch.device | str | None = None, ties: Sequence[tuple[str, str]] = (),
                 nonfinite: str = "raise", comm_timeout_s: float = 60.0,
                 recv_lookahead: int | None = None, diagnose_every: int = 100, memory_every: int = 0,
                 max_inflight: int | None = None, transport_threads: str | None = None,
                 send_wait: str | None = None, tensor_parallel: int = 1, recompute_granularity: str = "chunk"):
        from engine.schedules import lower

        sched = self.check_arguments(
            len(layers), stage_ranges, schedule=schedule, microbatches=microbatches,
            virtual_stages=virtual_stages, data_parallel=data_parallel, optimizer=optimizer,
            precision=precision, nonfinite=nonfinite, comm_timeout_s=comm_timeout_s,
            world_size=dist.get_world_size() if dist.is_available() and dist.is_initialized()
            else None, ties=ties, max_inflight=max_inflight, tensor_parallel=tensor_parallel,
            recompute_granularity=recompute_granularity)
        v, p = sched.virtual_stages, sched.num_stages
        self.ranges = check_stage_ranges(stage_ranges, len(layers), p * v)
        n_chunks = p * v
        self.schedule, self.num_stages, self.virtual_stages = sched, p, v
        self.microbatches, self.data_parallel = microbatches, data_parallel
        self.mesh = Mesh(p, data_parallel, int(tensor_parallel))
        self.precision, self.loss_fn = precision, loss_fn
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device())
            if self.mesh.backend == "nccl" else torch.device("cpu"))
        if self.device.type == "cpu":
            tune_cpu_allocator()  # engine/allocator.py: no page-fault churn per microbatch
        self.config = optimizer or OptimizerConfig()
        me = self.mesh.pipeline_rank
        self.my_stages = sched.stages_of(me)
        self.program = lower(sched)[me]
        from engine.launch import set_worker_info
        set_worker_info(stage=me, replica=self.mesh.replica)

        autocast = self._autocast_factory()
        self.recompute = recompute = _per_chunk(activation_checkpointing, n_chunks)
        self.chunks: dict[int, Chunk] = {}
        for s in self.my_stages:
            start, stop = self.ranges[s]
            built = [self._parallelize(m.to(self._build_dtype())) for m in
                     build_layers(layers, start, stop, seed, self.device)]
            self.chunks[s] = Chunk(
                s, start, built,
                loss_fn=loss_fn if s == n_chunks - 1 else None,
                activation_checkpointing=recompute[s], autocast=autocast,
                measure_activations=False, recompute_granularity=recompute_granularity)
        self._tie_groups: list[tuple[Any, str]] = []
        norm_skip = self._setup_ties(ties)
        for c in self.chunks.values():
            c.refresh_params()
        self.layer_module = nn.ModuleDict({str(c.start + j): layer
                                           for c in self.chunks.values()
                                           for j, layer in enumerate(c.module)})
        self.optimizer: StageOptimizer = make_optimizer(
            self.config, self.layer_module, self.mesh, microbatches=microbatches,
            precision=precision, nonfinite=nonfinite, norm_skip=norm_skip)
        self._reread_params()
        self.p2p = P2P(self.mesh, comm_timeout_s, self.device)
        # The graph-node I/W split needs a backend that takes GradientEdge roots; else per-layer cuts.
        node_split = None if self.optimizer.accepts_gradient_edges else False
        split = {(a.stage, a.microbatch) for a in self.program if a.kind == "I"}
        if recv_lookahead is None:
            recv_lookahead = default_recv_lookahead(self.mesh.backend, sched)
        if transport_threads is None:
            transport_threads = default_transport_threads(self.mesh.backend, sched)
        if transport_threads is not None:  # after every group and the optimizer exist
            set_transport_threads(transport_threads)
        self.transport_threads = transport_threads
        self.send_wait = default_send_wait(self.mesh.backend, sched, transport_threads, send_wait)
        self.executor = Executor(self.chunks, self.p2p, sched, lookahead=int(recv_lookahead),
                                 split=split, node_split=node_split, send_wait=self.send_wait)
        self.executor.compute_hooks = hasattr(self.optimizer, "after_compute")  # engine.fsdp
        self.nonfinite = nonfinite
        self.diagnose_every = int(diagnose_every)
        self.memory_every = int(memory_every)
        self.step_count = 0

    @property
    def tensor_parallel(self) -> int:
        """Tensor-parallel ranks per stage and replica (``engine.tp``)."""
        return self.mesh.tensor_parallel

    @staticmethod
    def check_arguments(num_layers: int, stage_ranges: Sequence[Sequence[int]], *,
                        schedule: Any = "1f1b", microbatches: int, virtual_stages: int = 1,
                        data_parallel: int = 1, optimizer: OptimizerConfig | None = None,
                        precision: str = "fp32", nonfinite: str = "raise",
                        comm_timeout_s: float = 60.0, world_size: int | None = None,
                        global_batch: int | None = None,
                        ties: Sequence[tuple[str, str]] = (),
                        max_inflight: int | None = None, tensor_parallel: int = 1,
                        recompute_granularity: str = "chunk") -> Any:
        """Check a pipeline's arguments without starting anything; returns the validated
        ``Schedule``. ``Pipeline`` runs the same checks inside each worker; call this in the
        launching process to refuse bad input before any worker starts::

            Pipeline.check_arguments(len(layers), ranges, schedule="1f1b", microbatches=4,
                                     data_parallel=2, world_size=4, global_batch=32)
            launch(worker, 4, ...)

        ``world_size``: the number of processes that will run it (must be stages x replicas);
        ``global_batch``: the batch size passed to ``train_step`` (must split into
        ``data_parallel`` x ``microbatches``). ``max_inflight``: zb-h2's memory knob (see
        ``engine.schedules.build_schedule``). ``tensor_parallel``: ranks per stage and replica
        (``engine.tp``; world = stages x data_parallel x tensor_parallel).
        ``recompute_granularity``: "chunk" or "layer". Raises ``ValueError`` saying how to fix it.
        """
        check_precision(precision)
        check_recompute_granularity(recompute_granularity)
        check_nonfinite(nonfinite)
        if not (isinstance(comm_timeout_s, (int, float)) and comm_timeout_s > 0):
            raise ValueError(f"comm_timeout_s must be a positive number of seconds, got "
                             f"{comm_timeout_s!r}")
        if int(data_parallel) < 1:
            raise ValueError(f"data_parallel must be >= 1, got {data_parallel}")
        if int(tensor_parallel) < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        sched = _check_layout(num_layers, stage_ranges, schedule, microbatches, virtual_stages,
                              max_inflight)
        p, t = sched.num_stages, int(tensor_parallel)
        if world_size is not None and world_size != p * data_parallel * t:
            what = f" x {t} tensor-parallel ranks" if t > 1 else ""
            raise ValueError(f"{world_size} processes cannot run {p} stages x {data_parallel} "
                             f"replicas{what}; start {p * data_parallel * t} (launch(fn, "
                             f"{p * data_parallel * t}) or torchrun --nproc-per-node) or change "
                             "the layout")
        if global_batch is not None and global_batch % (data_parallel * microbatches):
            per = data_parallel * microbatches
            raise ValueError(f"global batch of {global_batch} is not divisible by data_parallel "
                             f"({data_parallel}) x microbatches ({microbatches}); use a batch "
                             f"size that is a multiple of {per}")
        if optimizer is not None:
            check_optimizer_config(optimizer, precision)
            if int(optimizer.zero_stage) == 2:
                _check_zero2_ties(ties, num_layers, stage_ranges, sched)
            if t > 1:
                _check_tensor_parallel(optimizer, precision, ties)
            if int(optimizer.zero_stage) == 3 and ties:
                raise ValueError(f"zero_stage=3 (FSDP2) does not support tied parameters yet "
                                 f"({ties[0][0]} tied to {ties[0][1]}); untie them or use "
                                 "zero_stage 0, 1 or 2")
        return sched

    # ---- setup helpers -------------------------------------------------------------------------
    def _parallelize(self, layer: nn.Module) -> nn.Module:
        """Under tensor parallelism, ``layer`` sharded over the tp group by its plan
        (``engine.tp``); else as it is."""
        if self.tensor_parallel == 1:
            return layer
        from engine.tp import parallelize_layer

        return parallelize_layer(layer, self.mesh.submesh("tp"))

    def _reread_params(self) -> None:
        """ZeRO moves parameters into flat buffers, FSDP2 shards them: the chunks re-read what
        they differentiate (under FSDP2 the gathered parameters, ``engine.fsdp``)."""
        params_of = getattr(self.optimizer, "compute_parameters", None)
        for c in self.chunks.values():
            c.refresh_params(params_of)

    def _build_dtype(self) -> torch.dtype:
        """The layers' dtype: the precision's weights, or fp32 under ZeRO-3 (FSDP2's masters)."""
        from engine.fsdp import weight_dtype_for

        return weight_dtype_for(self.config.zero_stage, self.precision)

    def _autocast_factory(self) -> Callable[[], Any]:
        dtype = compute_dtype(self.precision)
        if dtype is None:
            return contextlib.nullcontext
        dev = self.device.type
        return lambda: torch.autocast(dev, dtype=dtype)

    def _chunk_of_layer(self, layer: int) -> int:
        for s, (a, b) in enumerate(self.ranges):
            if a <= layer < b:
                return s
        raise ValueError(f"tied layer {layer} is outside the model (0..{self.ranges[-1][1] - 1})")

    def _param_ref(self, key: str) -> tuple[int, str]:
        layer, _, name = key.partition(".")
        if not layer.isdigit() or not name:
            raise ValueError(f"tie {key!r} must look like '<layer index>.<parameter name>', "
                             "e.g. '0.weight'")
        return int(layer), name

    def _get_param(self, layer: int, name: str) -> nn.Parameter:
        chunk = self.chunks[self._chunk_of_layer(layer)]
        return chunk.module[layer - chunk.start].get_parameter(name)

    def _set_param(self, layer: int, name: str, prm: nn.Parameter) -> None:
        chunk = self.chunks[self._chunk_of_layer(layer)]
        mod = chunk.module[layer - chunk.start]
        owner, _, leaf = name.rpartition(".")
        setattr(mod.get_submodule(owner) if owner else mod, leaf, prm)

    def _setup_ties(self, ties: Sequence[tuple[str, str]]) -> list[str]:
        """Tied parameters: same rank -> one Parameter object; different ranks -> equal copies
        (broadcast from the first) whose gradients are summed before every step."""
        norm_skip: list[str] = []
        me = self.mesh.pipeline_rank
        for a, b in ties:
            (la, na), (lb, nb) = self._param_ref(a), self._param_ref(b)
            ra = self.schedule.rank_of(self._chunk_of_layer(la))
            rb = self.schedule.rank_of(self._chunk_of_layer(lb))
            if ra == rb:
                if me == ra:
                    pa, pb = self._get_param(la, na), self._get_param(lb, nb)
                    if pa.shape != pb.shape:
                        raise ValueError(f"tied parameters {a} {tuple(pa.shape)} and {b} "
                                         f"{tuple(pb.shape)} differ in shape")
                    self._set_param(lb, nb, pa)
                continue
            group = self.mesh.pipeline_group if self.num_stages == 2 else None
            for rep in range(self.data_parallel if group is None else 0):
                # every rank creates every group, in order
                g = dist.new_group([self.mesh.global_rank(ra, rep), self.mesh.global_rank(rb, rep)])
                if rep == self.mesh.replica:
                    group = g
            if me in (ra, rb):
                prm = self._get_param(la, na) if me == ra else self._get_param(lb, nb)
                with torch.no_grad():
                    dist.broadcast(prm.data, src=self.mesh.global_rank(ra), group=group)
                self._tie_groups.append((group, prm))
                if me == rb:
                    norm_skip.append(b)
        return norm_skip

    # ---- public API --------------------------------------------------------------------------
    def named_layer_parameters(self) -> dict[int, dict[str, Tensor]]:
        """This rank's parameters by global layer index (a pending post-validated step is
        validated first)."""
        self.settle()
        return {c.start + j: dict(layer.named_parameters())
                for c in self.chunks.values() for j, layer in enumerate(c.module)}

    def state_dict(self) -> dict:
        """This rank's layers keyed by global layer index, plus optimizer state and step.

        The layers hold fp32 weights whatever the precision: with 16-bit weights, the
        optimizer's fp32 masters (a collective over the data-parallel group under ZeRO), so a
        checkpoint resumes exactly, with any split, replica count or precision."""
        self.settle()
        whole = getattr(self.optimizer, "layer_state_dict", lambda m: m.state_dict())
        if self._build_dtype() == torch.float32:
            layers = {int(k): whole(m) for k, m in self.layer_module.items()}
        else:
            layers = self._master_layers()
        return {"layers": layers, "optimizer": self.optimizer.state_dict(),
                "step": self.step_count}

    def _master_layers(self) -> dict[int, dict[str, Tensor]]:
        masters = self.optimizer.master_weights()
        by_id = {id(p): masters[n] for n, p in self.layer_module.named_parameters()
                 if n in masters}
        out = {}
        for k, m in self.layer_module.items():
            sd = {n: (t.float() if t.is_floating_point() else t) for n, t in m.state_dict().items()}
            for n, p in m.named_parameters(remove_duplicate=False):
                if id(p) in by_id:
                    sd[n] = by_id[id(p)]
            out[int(k)] = sd
        return out

    def checkpoint_template(self) -> dict[int, dict[str, Tensor]]:
        """Per layer of this rank, meta tensors with the names, shapes and dtypes that
        :meth:`state_dict` writes (floating tensors as fp32): what a checkpoint must match."""
        return {int(k): {n: torch.empty(t.shape, device="meta",
                                        dtype=torch.float32 if t.is_floating_point() else t.dtype)
                         for n, t in m.state_dict().items()}
                for k, m in self.layer_module.items()}

    def load_state_dict(self, sd: dict) -> None:
        """Load this rank's layers (by global index; others ignored) and optimizer state. With
        16-bit weights the layers' (fp32) weights also become the optimizer's masters."""
        self.settle()
        layers = sd["layers"]
        for k, m in self.layer_module.items():
            if int(k) not in layers:
                raise KeyError(f"checkpoint has no layer {k}; it comes from another model")
            getattr(self.optimizer, "load_layer_state_dict", nn.Module.load_state_dict)(
                m, layers[int(k)])
        if "optimizer" in sd:
            self.optimizer.load_state_dict(sd["optimizer"])
        if self._build_dtype() != torch.float32:
            self.optimizer.load_master_weights({f"{k}.{n}": t for k, params in layers.items()
                                                for n, t in params.items()})
        self.step_count = int(sd.get("step", self.step_count))

    def train_step(self, inputs: Any, targets: Any, *, diagnose: bool | None = None,
                   measure_memory: bool | None = None) -> StepResult:
        """One optimizer step on the global batch (see docs/contracts.md). ``diagnose`` (default:
        every ``diagnose_every`` steps; the same on every rank) adds the costly figures: bytes
        saved for backward, the peak of live activations and the global gradient norm, and checks
        every forward output for NaN/inf (other steps check the loss and the gradients, and replay
        the forward of a step whose loss is non-finite to name the stage where it began).
        ``measure_memory`` (default: the first two steps and every ``memory_every`` steps when
        ``memory_every`` > 0; implies ``diagnose``) measures this rank's peak with torch's
        MemTracker (``engine.memtrack``) into ``stats["memory_measured"]``: a diagnostic that
        slows the step several-fold."""
        if measure_memory is None:
            k, n = self.step_count, self.memory_every
            measure_memory = n > 0 and (k < 2 or k % n == 0)
        if measure_memory:
            from engine.memtrack import measure_step
            opt = self.optimizer
            result, report = measure_step(
                lambda: self._train_step(inputs, targets, True), modules=[self.layer_module],
                optimizers=getattr(opt, "torch_optimizers", lambda: [])(),
                kinds=getattr(opt, "memory_kinds", lambda: {})(), device=self.device)
            result.stats["memory_measured"] = report.to_dict()
            return result
        if diagnose is None:
            diagnose = self.diagnose_every > 0 and self.step_count % self.diagnose_every == 0
        return self._train_step(inputs, targets, diagnose)

    def _train_step(self, inputs: Any, targets: Any, diagnose: bool) -> StepResult:
        t0 = time.perf_counter()
        pending = getattr(self.optimizer, "validation_pending", False)
        rng = _rng_state(self.device) if pending else None
        self.optimizer.zero_grad()
        stats, loss, bad_chunks, t1 = self._run_train(inputs, targets, diagnose)
        if pending:
            # step_sync="post_validate": the previous step's verdict, reduced while this step ran.
            # If its update was rolled back, this step ran on void parameters: run it again,
            # from the same random state, on the corrected ones.
            record = self.optimizer.validate()
            stats["validated"] = record
            if record is not None and record["replay"]:
                void_s = t1 - t0
                _set_rng_state(self.device, rng)
                self.optimizer.zero_grad()
                stats, loss, bad_chunks, t1 = self._run_train(inputs, targets, diagnose)
                stats.update(validated=record, void_run_s=void_s)
        if bad_chunks and not diagnose:
            bad_chunks = self._locate_nonfinite(inputs, targets)
        if bad_chunks:
            stats["nonfinite_stage"] = bad_chunks[0]
            if self.nonfinite == "raise" and not loss_scaled(self.precision):
                raise self._nonfinite_error(bad_chunks, loss)
        skipped, norm = self.optimizer.step(need_norm=diagnose)
        stats["optimizer_s"] = time.perf_counter() - t1
        dt = time.perf_counter() - t0
        stats["idle_s"] = max(0.0, dt - stats["forward_s"] - stats["backward_s"]
                              - stats["optimizer_s"])
        if diagnose:
            stats["optimizer_state_bytes"] = self.optimizer.optimizer_state_bytes()
        if getattr(self.optimizer, "validation_pending", False):
            stats["rollback_bytes"] = self.optimizer.rollback_bytes
        if hasattr(self.optimizer, "all_gathers"):   # engine.fsdp: per action kind
            stats["fsdp_all_gathers"] = dict(self.optimizer.all_gathers)
        self.step_count += 1
        return StepResult(loss, bool(skipped), norm, self.optimizer.lr(), dt, stats)

    def _run_train(self, inputs: Any, targets: Any, diagnose: bool
                   ) -> tuple[dict, float, list[int], float]:
        """Run the step's program, sum gradients over replicas and tied copies, read the
        verdict: ``(stats, loss, non-finite chunks, time after the program)``."""
        # diagnostic steps also check every forward output for NaN/inf (engine.executor)
        stats = self._run(self.program, inputs, targets, train=True, diagnose=diagnose,
                          check=diagnose)
        t1 = time.perf_counter()
        self.optimizer.sync_gradients()   # replicas first: it waits for the overlapped buckets
        for group, prm in self._tie_groups:
            dist.all_reduce(self.optimizer.accumulated_grad(prm), group=group)
        # The step's verdict (loss and, on a checked step, per chunk whether its forward output
        # was non-finite) reached every rank with the last microbatch's messages, with no
        # collective across the pipeline: every rank takes the same decision.
        del stats["_losses"], stats["_flags"]
        loss, bad_chunks = self._read_verdict(stats.pop("_verdict"))
        return stats, loss, bad_chunks, t1

    def settle(self) -> dict | None:
        """``optimizer.step_sync="post_validate"``: validate the last step now (wait for its
        global norm and flags; roll its update back and redo it if needed) and return the
        record (``TorchStageOptimizer.validate``); None when nothing is pending. ``eval_step``,
        ``state_dict``, ``load_state_dict`` and ``named_layer_parameters`` settle first; call it
        after the last step to read final parameters another way."""
        validate = getattr(self.optimizer, "validate", None)
        return validate() if validate is not None else None

    def _nonfinite_error(self, bad_chunks: list[int], loss: float) -> NonFiniteError:
        first = bad_chunks[0]
        a, b = self.ranges[first]
        return NonFiniteError(
            f"non-finite forward output at step {self.step_count} on pipeline stage "
            f"{self.schedule.rank_of(first)} (model chunk {first}, layers {a}..{b - 1}); "
            f"first of the chunks {bad_chunks} whose output was NaN/inf; loss={loss}. "
            "Lower the lr, enable grad_clip, check the data, or pass nonfinite='skip' "
            "to skip such steps")

    def _locate_nonfinite(self, inputs: Any, targets: Any) -> list[int]:
        """The chunks whose forward output is NaN/inf on this step's batch, found by replaying its
        forward with every output checked: run by every rank after an unchecked step whose loss
        was non-finite (the verdict is the same everywhere). Dropout draws anew; if the replay is
        finite, the last chunk (the loss) is named."""
        last = self.schedule.num_chunks - 1
        with torch.no_grad():
            stats = self._run(self._forward_program(), inputs, targets, train=False,
                              diagnose=False, check=True)
        bad = torch.zeros(last + 1, dtype=torch.float64, device=self.device)
        for s, flag in stats["_flags"].items():
            bad[s] = flag
        if self.mesh.distributed and self.mesh.world_size > 1:
            dist.all_reduce(bad)
        found = [s for s, b in enumerate(bad.cpu().tolist()) if b != 0]
        return found or [last]

    def eval_step(self, inputs: Any, targets: Any) -> float:
        """Forward-only loss on the global batch (same on every rank)."""
        self.settle()
        with torch.no_grad():
            stats = self._run(self._forward_program(), inputs, targets, train=False,
                              diagnose=False)
        return self._reduce_loss(stats["_losses"])

    # ---- execution ---------------------------------------------------------------------------
    def _forward_program(self) -> list[_Item]:
        sched, last, me = self.schedule, self.schedule.num_chunks - 1, self.mesh.pipeline_rank
        prog: list[_Item] = []
        for i in range(self.microbatches):
            for s in self.my_stages:
                if s > 0 and sched.rank_of(s - 1) != me:
                    prog.append(_Item("RECV_F", s, i, sched.rank_of(s - 1)))
                prog.append(_Item("F", s, i))
                if s < last and sched.rank_of(s + 1) != me:
                    prog.append(_Item("SEND_F", s, i, sched.rank_of(s + 1)))
        return prog

    def _microbatches(self, value: Any, what: str) -> list[Any] | None:
        if value is None:
            return None
        parts = value if isinstance(value, (tuple, list)) else (value,)
        n = parts[0].shape[0]
        d, m = self.data_parallel, self.microbatches
        if n % (d * m):
            raise ValueError(f"global batch of {n} {what} is not divisible by data_parallel "
                             f"({d}) x microbatches ({m}); use a batch size that is a multiple "
                             f"of {d * m}")
        per = n // d
        mbs = [[] for _ in range(m)]
        for t in parts:
            if t.shape[0] != n:
                raise ValueError(f"all {what} tensors need the same batch size (dim 0)")
            rep = t[self.mesh.replica * per:(self.mesh.replica + 1) * per].to(self.device)
            for i, c in enumerate(rep.chunk(m)):
                mbs[i].append(c)
        return [tuple(x) if isinstance(value, (tuple, list)) else x[0] for x in mbs]

    def _run(self, program: Sequence[Any], inputs: Any, targets: Any, *, train: bool,
             diagnose: bool, check: bool = False) -> dict:
        last = self.schedule.num_chunks - 1
        x_mbs = self._microbatches(inputs, "inputs") if 0 in self.chunks else None
        y_mbs = self._microbatches(targets, "targets") if last in self.chunks else None
        if 0 in self.chunks and x_mbs is None:
            raise ValueError(f"rank {self.mesh.rank} runs the first stage and needs the inputs")
        if last in self.chunks and y_mbs is None:
            raise ValueError(f"rank {self.mesh.rank} runs the last stage and needs the targets")
        return self.executor.run(program, x_mbs, y_mbs, self.optimizer, train=train,
                                 diagnose=diagnose, check=check)

    def _read_verdict(self, verdict: Tensor) -> tuple[float, list[int]]:
        """(mean loss over replicas, chunks whose forward was non-finite) from this replica's
        verdict (``engine.executor``); with replicas, summed over this stage's data-parallel
        group first."""
        if self.data_parallel > 1:
            dist.all_reduce(verdict, group=self.mesh.dp_group)
        v = verdict.cpu()
        return float(v[0]) / self.data_parallel, [s for s in range(len(v) - 1) if v[1 + s] != 0]

    def _reduce_loss(self, losses: list[Tensor]) -> float:
        """Evaluation: the mean over microbatches on the last stage, averaged over replicas, on
        every rank (a forward-only step sends nothing back up to carry it)."""
        buf = torch.zeros(1, dtype=torch.float64, device=self.device)
        if losses and self.mesh.tp_rank == 0:   # every tp rank of the last stage has it
            buf[0] = mean_loss(losses) / self.data_parallel
        if self.mesh.distributed and self.mesh.world_size > 1:
            dist.all_reduce(buf)
        return float(buf.cpu()[0])
