"""Test harness for engine.zero: a hand-written tiny pipeline x data-parallel mesh on gloo.

World = p * d ranks on ``engine.mesh.Mesh`` (rank = replica * p + pipeline_rank). Each rank holds
chunks c with c % p == its pipeline rank (v chunks per rank for the interleaved layout) and runs
GPipe order by hand (isend / blocking recv). The reference is one process on the whole batch
(``problems.reference``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from engine.mesh import Mesh
from problems import batches, ranges, reference as _reference

DIMS = [(6, 8), (8, 8), (8, 8), (8, 3)]
GLOBAL_BATCH = 8


def make_config(**kw: Any) -> Any:
    from engine.optim import OptimizerConfig

    return OptimizerConfig(**kw, backend="deepspeed")


def make_layer(i: int) -> nn.Module:
    torch.manual_seed(1000 + i)
    lin = nn.Linear(*DIMS[i])
    return nn.Sequential(lin, nn.Tanh()) if i < len(DIMS) - 1 else lin


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batches(step, seed=7, batch=GLOBAL_BATCH, in_dim=DIMS[0][0], out_dim=DIMS[-1][1])


def reference(cfg: Any, steps: int | list[int], autocast: torch.dtype | None = None) -> dict:
    """Single process, whole batch: losses, grad norms and final parameters.

    ``steps``: a count, or the list of data steps whose updates are applied (a skipped step's
    data is left out).
    """
    factories = [functools.partial(make_layer, i) for i in range(len(DIMS))]
    ref = _reference(factories, data, cfg, steps, autocast=autocast)
    ref["numel"] = sum(p.numel() for p in ref["model"].parameters())
    return ref


def build_mesh(p: int, d: int) -> Mesh:
    return Mesh(p, d)


class Stage:
    """This rank's chunks as one nn.ModuleList (what the runtime hands to the optimizer)."""

    def __init__(self, mesh: Mesh, virtual: int) -> None:
        self.mesh = mesh
        self.ranges = ranges(len(DIMS), mesh.num_stages * virtual)
        self.mine = [c for c in range(len(self.ranges)) if c % mesh.num_stages == mesh.pipeline_rank]
        self.chunks = {c: nn.Sequential(*[make_layer(i) for i in range(*self.ranges[c])]) for c in self.mine}
        self.module = nn.ModuleList([self.chunks[c] for c in self.mine])

    def named_global_params(self) -> dict[str, torch.Tensor]:
        out = {}
        for c in self.mine:
            start = self.ranges[c][0]
            for name, t in self.chunks[c].named_parameters():
                j, rest = name.split(".", 1)
                out[f"{start + int(j)}.{rest}"] = t
        return out


def pipeline_step(opt: Any, stage: Stage, step: int, *, split_backward: bool = False,
                  microbatches: int = 2, poison: Callable[[int, int], bool] | None = None,
                  autocast: torch.dtype | None = None) -> dict:
    """One training step in GPipe order; returns the global mean loss and the optimizer result."""
    mesh, ranges, m = stage.mesh, stage.ranges, microbatches
    C = len(ranges)
    x, y = data(step)
    per = GLOBAL_BATCH // mesh.data_parallel
    xs = x[mesh.replica * per:(mesh.replica + 1) * per].chunk(m)
    ys = y[mesh.replica * per:(mesh.replica + 1) * per].chunk(m)
    peer = mesh.global_rank  # of a chunk's pipeline rank, in this replica
    inputs, outputs, scaled, losses, sends = {}, {}, {}, [], []
    for c in range(C):
        if c not in stage.chunks:
            continue
        for i in range(m):
            if c == 0:
                inp = xs[i]
            else:
                inp = torch.empty(per // m, DIMS[ranges[c][0]][0])
                dist.recv(inp, src=peer(c - 1))
                inp.requires_grad_()
            inputs[c, i] = inp
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                out = stage.chunks[c](inp)
            out = out.float()
            outputs[c, i] = out
            if c == C - 1:
                loss = nn.functional.mse_loss(out, ys[i])
                losses.append(loss.item())
                scaled[c, i] = opt.scale_loss(loss)
            else:
                sends.append(dist.isend(out.detach().contiguous(), dst=peer(c + 1)))
    deferred = []
    for c in reversed(range(C)):
        if c not in stage.chunks:
            continue
        for i in range(m):
            if c == C - 1:
                tensors, grads = [scaled[c, i]], None
            else:
                g = torch.empty_like(outputs[c, i])
                dist.recv(g, src=peer(c + 1))
                if poison is not None and poison(c, i):
                    g = g * math.inf
                tensors, grads = [outputs[c, i]], [g]
            if split_backward:
                if c > 0:
                    opt.backward(tensors, grads, inputs=[inputs[c, i]], retain_graph=True)
                deferred.append((tensors, grads, list(stage.chunks[c].parameters())))
            else:
                opt.backward(tensors, grads)
            if c > 0:
                sends.append(dist.isend(inputs[c, i].grad.contiguous(), dst=peer(c - 1)))
    for tensors, grads, params in deferred:  # weight halves, all after the input halves
        opt.backward(tensors, grads, inputs=params)
    for s in sends:
        s.wait()
    skipped, norm = opt.step()
    loss = torch.tensor([sum(losses) / m if losses else 0.0], dtype=torch.float64)
    dist.all_reduce(loss)  # only the last-stage ranks contribute
    return {"loss": loss.item() / mesh.data_parallel, "skipped": skipped, "norm": norm, "lr": opt.lr()}


# ---------------------------------------------------------------------------- spawning
def spawn(fn: Callable, world: int, *args: Any) -> list[Any]:
    """Run fn(*args) on `world` gloo ranks (tests/dist_helpers.run_workers); per-rank results."""
    from dist_helpers import run_workers

    return run_workers(fn, world, *args, timeout_s=600)


# ---------------------------------------------------------------------------- workers
def _snapshot(stage: Stage) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in stage.named_global_params().items()}


def run_case(case: dict) -> dict:
    """Build a fresh stage + DeepSpeedStageOptimizer and train ``case['steps']`` steps."""
    from engine.zero import DeepSpeedStageOptimizer

    mesh = case["mesh"]
    stage = Stage(mesh, case.get("virtual", 1))
    opt = DeepSpeedStageOptimizer(make_config(**case["cfg"]), stage.module, dp_group=mesh.dp_group,
                                  pipeline_group=mesh.pipeline_group, microbatches=2,
                                  precision=case.get("precision", "fp32"),
                                  nonfinite=case.get("nonfinite", "raise"))
    poison_step = case.get("poison_step")
    results, scales = [], []
    for s in range(case["steps"]):
        poison = None
        if s == poison_step and mesh.rank == 0:  # stage 0 of replica 0 only
            poison = lambda c, i: i == 0  # noqa: E731
        try:
            results.append(pipeline_step(opt, stage, s, split_backward=case.get("split", False),
                                         poison=poison, autocast=case.get("autocast")))
        except FloatingPointError as exc:  # NonFiniteError
            results.append({"raised": type(exc).__name__, "message": str(exc)})
            break
        scales.append(opt.loss_scale)
    return {"results": results, "params": _snapshot(stage), "state_bytes": opt.optimizer_state_bytes(),
            "scales": scales, "scaler": type(opt.scaler).__name__, "stage_numel": sum(p.numel() for p in stage.module.parameters())}


def run_resume(case: dict) -> dict:
    """Train 2 steps, save state, rebuild everything fresh, load, train step 3."""
    from engine.zero import DeepSpeedStageOptimizer

    mesh = case["mesh"]
    kw = dict(dp_group=mesh.dp_group, pipeline_group=mesh.pipeline_group, microbatches=2, precision="fp32")
    stage = Stage(mesh, 1)
    opt = DeepSpeedStageOptimizer(make_config(**case["cfg"]), stage.module, **kw)
    for s in range(2):
        pipeline_step(opt, stage, s)
    sd = opt.state_dict()
    weights = _snapshot(stage)
    lr_before = opt.lr()

    fresh = Stage(mesh, 1)
    with torch.no_grad():
        for k, p in fresh.named_global_params().items():
            p.copy_(weights[k])
    opt2 = DeepSpeedStageOptimizer(make_config(**case["cfg"]), fresh.module, **kw)
    # The optimizer is built before the weights are set in a real resume as well: perturb the
    # module after construction so a stale DeepSpeed master copy would show.
    with torch.no_grad():
        for p in fresh.module.parameters():
            p.add_(1.0)
        for k, p in fresh.named_global_params().items():
            p.copy_(weights[k])
    opt2.load_state_dict(sd)
    lr_after = opt2.lr()
    res = pipeline_step(opt2, fresh, 2)
    return {"params": _snapshot(fresh), "state": sd, "loss": res["loss"],
            "lr": (lr_before, lr_after)}


def run_cases(cases: list[dict], p: int = 2, d: int = 2) -> list[dict]:
    mesh = build_mesh(p, d)
    out = []
    for case in cases:
        case = dict(case, mesh=mesh)
        out.append((run_resume if case.get("resume") else run_reduce_walk if case.get("walk") else run_case)(case))
    return out


# ---------------------------------------------------------------------------- ZeRO-2's reduces
# two chunks of Linear layers (in, out): 3,976 elements, a 1,988-element bucket with d = 2; the
# first chunk's 32 x 48 weight overflows the bucket its hook meets, then is reduced alone
WALK_CHUNKS = [[(32, 48), (48, 16)], [(16, 64), (64, 8)]]


def run_reduce_walk(case: dict) -> dict:
    """ZeRO-2 with bf16 weights over two chunks, each back-propagated apart as the pipeline
    runs them: every bucket DeepSpeed reduces, as (elements, elements of the gradient whose hook
    started the reduce (0: the backward's epilogue), slices flattened), and the chunks' sizes."""
    from deepspeed.runtime.zero import stage_1_and_2 as ds

    from engine.zero import DeepSpeedStageOptimizer

    mesh = case["mesh"]
    torch.manual_seed(0)
    chunks = [nn.Sequential(*[nn.Linear(i, o) for i, o in dims]) for dims in WALK_CHUNKS]
    module = nn.ModuleList(chunks).to(torch.bfloat16)
    opt = DeepSpeedStageOptimizer(make_config(name="sgd", lr=0.1, zero_stage=2), module, dp_group=mesh.dp_group,
                                  pipeline_group=mesh.pipeline_group, microbatches=1, precision="bf16")
    seen: list[list[int]] = []
    trigger = [0]
    cls, inner = ds.DeepSpeedZeroOptimizer, opt._ds_opt
    hook, average, flatten = cls.reduce_independent_p_g_buckets_and_remove_grads, cls.average_tensor, inner.flatten

    def on_hook(self: Any, param: torch.Tensor, i: int) -> Any:
        trigger[0] = param.numel()
        try:
            return hook(self, param, i)
        finally:
            trigger[0] = 0

    def on_average(self: Any, tensor: torch.Tensor, dtype: torch.dtype) -> Any:
        seen.append([tensor.numel(), trigger[0], 0])
        return average(self, tensor, dtype)

    def on_flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
        if seen:
            seen[-1][2] += len(tensors)
        return flatten(tensors)

    cls.reduce_independent_p_g_buckets_and_remove_grads, cls.average_tensor = on_hook, on_average
    inner.flatten = on_flatten
    try:
        h = chunks[0](torch.randn(4, 32, dtype=torch.bfloat16))
        cut = h.detach().requires_grad_()
        opt.backward([opt.scale_loss(chunks[1](cut).float().pow(2).mean())], None)
        opt.backward([h], [cut.grad])
        opt.step()
    finally:
        cls.reduce_independent_p_g_buckets_and_remove_grads, cls.average_tensor = hook, average
    return {"reduces": seen, "sizes": [[p.numel() for p in c.parameters()] for c in chunks]}


# ---------------------------------------------------------------------------- runtime resume
RESUME_LAYERS = 6


def _resume_layer(i: int) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh()) if i < RESUME_LAYERS - 1 else nn.Linear(8, 3)


def _resume_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batches(step, seed=100, batch=8, in_dim=8, out_dim=3)


def runtime_resume_job(p: int, d: int, zero: int, steps: int, save_dir: str | None,
                       load_dir: str | None, schedule: str = "1f1b", virtual: int = 1,
                       precision: str = "fp32", microbatches: int = 2
                       ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """engine.Pipeline (p stages x d replicas, `schedule` with `virtual` chunks per rank, layers
    split evenly over the chunks): optionally resume from `load_dir`, train `steps` steps,
    optionally checkpoint into `save_dir` (replica 0 writes the layers). Returns the losses and
    this rank's parameters by "<layer>.<name>" (with 16-bit weights: the fp32 masters)."""
    import functools

    from engine import Pipeline
    from engine import checkpoint as ck
    from engine.optim import OptimizerConfig

    n, chunks = RESUME_LAYERS, p * virtual
    cfg = OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.01, warmup_steps=2, zero_stage=zero)
    pipe = Pipeline([functools.partial(_resume_layer, i) for i in range(n)],
                    [(c * n // chunks, (c + 1) * n // chunks) for c in range(chunks)],
                    loss_fn=nn.functional.mse_loss, schedule=schedule, microbatches=microbatches,
                    virtual_stages=virtual, data_parallel=d, optimizer=cfg, precision=precision)
    rank, world = dist.get_rank(), dist.get_world_size()
    start = 0
    if load_dir:
        expected = pipe.checkpoint_template()
        c = ck.load_checkpoint(ck.latest_checkpoint(load_dir), sorted(expected), expected=expected,
                               num_layers=RESUME_LAYERS, rank=rank, world=world)
        pipe.load_state_dict({"layers": c.layers, "step": c.meta["step"],
                              "optimizer": ck.merge_optimizer_state(c.optimizer, c.meta["optimizer"])})
        start = c.meta["step"]
    losses = [pipe.train_step(*_resume_data(s)).loss for s in range(start, start + steps)]
    if save_dir:
        sd = pipe.state_dict()  # collective with ZeRO (the optimizer state is gathered)
        per_layer, scalars = ck.split_optimizer_state(sd["optimizer"])
        first = rank < p
        ck.save_checkpoint(save_dir, start + steps, layers=sd["layers"] if first else {},
                           optimizer=per_layer if first else {}, num_layers=RESUME_LAYERS,
                           meta={"step": start + steps, "optimizer": scalars})
    if precision in ("bf16", "fp16"):
        return losses, pipe.optimizer.master_weights()
    named = {f"{i}.{n}": t.detach().clone()
             for i, ps in pipe.named_layer_parameters().items() for n, t in ps.items()}
    return losses, named
