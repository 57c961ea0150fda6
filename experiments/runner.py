"""The per-rank training loop behind `python -m experiments.train`.

`run_worker(job)` runs on every rank (started by `engine.launch`, or in-process under
`torchrun`): it builds this rank's part of the model as an `engine.Pipeline` with the plan's
stage ranges, resumes from a checkpoint when the job names one, and trains `train.steps` steps on
batches that are pure functions of (seed, step). The rank that owns the loss (last stage of
replica 0) writes `metrics.jsonl`, logs to W&B and shows the progress bar; every rank joins the
collectives (per-stage figures gathered every `train.log_every` steps, the stop flag every step,
the evaluation loss, checkpoints).

SIGTERM / SIGINT set a flag; the flag is combined across all ranks after every step (so every
rank stops after the same step, also when only one node got the signal), a checkpoint is
written when checkpointing is on, and the worker returns normally.

Example (what `experiments.train` does)::

    job = Job(config=to_plain_dict(cfg), stage_ranges=plan.stage_ranges, plan=plan.to_dict(),
              run_dir=str(run_dir), checkpoint_root=str(run_dir / "checkpoints"))
    results = engine.launch(run_worker, world_size(cfg), job)
"""

from __future__ import annotations

import math
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Job", "run_worker", "checkpoint_meta", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Job:
    """Everything a rank needs, picklable (plain data only).

    config: the resolved experiment config as plain dicts (`experiments.config.to_plain_dict`).
    stage_ranges: the plan's half-open layer ranges, one per model chunk.
    plan: `Plan.to_dict()` of the plan being run (predicted figures for the metrics).
    run_dir: the shared run directory (metrics.jsonl, W&B, pictures).
    checkpoint_root: where checkpoints go (`<run_dir>/checkpoints` by default).
    resume_from: a complete checkpoint directory to start from, or None for a fresh start.
    run_name: the W&B run name.
    """

    config: dict
    stage_ranges: list
    plan: dict
    run_dir: str
    checkpoint_root: str
    resume_from: str | None = None
    run_name: str = "run"
    notes: list = field(default_factory=list)


def checkpoint_meta(step: int, scalars: dict, cfg: dict, stage_ranges: list) -> dict:
    """The JSON run state stored with a checkpoint (rank 0's copy is kept in the manifest)."""
    return {"step": int(step), "data_position": int(step), "optimizer": scalars,
            "stage_ranges": [list(r) for r in stage_ranges],
            "pipeline": {k: cfg["pipeline"][k] for k in ("stages", "schedule", "microbatches",
                                                           "virtual_stages", "data_parallel")},
            "model": cfg["model"], "seed": cfg["train"]["seed"]}


class _StopFlag:
    """Set by SIGTERM / SIGINT; the training loop polls it between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _stage_lists(gathered: list[dict], p: int) -> list[dict]:
    """Per pipeline stage (replica 0's ranks), the figures that go into `stage_<key>` lists."""
    out = []
    for j in range(p):
        s = gathered[j]
        dt = s.get("step_time_s") or float("nan")
        out.append({
            "forward_s": s.get("forward_s"), "backward_s": s.get("backward_s"),
            "optimizer_s": s.get("optimizer_s"), "comm_wait_s": s.get("comm_wait_s"),
            "idle_s": s.get("idle_s"), "idle_fraction": (s.get("idle_s", 0.0) / dt) if dt > 0 else None,
            "peak_activation_bytes": s.get("peak_activation_bytes"),
            "optimizer_state_bytes": s.get("optimizer_state_bytes"),
            "bytes_sent": s.get("bytes_sent"),
        })
    return out


def _rank_predictions(plan: dict, p: int) -> tuple[list[int], list[float], list[float]]:
    """Predicted per-rank peak activation bytes, forward and backward seconds (chunks summed)."""
    ranges = plan["stage_ranges"]
    act = plan.get("stage_activation_bytes") or [0] * len(ranges)
    fwd = plan.get("stage_forward_s") or [0.0] * len(ranges)
    bwd = plan.get("stage_backward_s") or [0.0] * len(ranges)
    m = int(plan.get("microbatches", 1))
    from engine.schedules import chunk_ranks
    rank_of = chunk_ranks(plan.get("schedule", "1f1b"), p, len(ranges) // p)
    acts, fs, bs = [0] * p, [0.0] * p, [0.0] * p
    for c in range(len(ranges)):
        acts[rank_of[c]] += int(act[c])
        fs[rank_of[c]] += float(fwd[c]) * m
        bs[rank_of[c]] += float(bwd[c]) * m
    return acts, fs, bs


def _timeline_png(plan: dict, path: Path, title: str, forward: list[float] | None = None,
                  backward: list[float] | None = None) -> Path:
    """Simulate the plan's schedule (predicted costs, or the given per-chunk costs) to a PNG."""
    from engine.schedules import build_schedule
    from engine.simulate import simulate

    sched = build_schedule(plan["schedule"], plan["num_stages"], plan["microbatches"],
                           plan.get("virtual_stages", 1))
    f = forward if forward is not None else plan["stage_forward_s"]
    b = backward if backward is not None else plan["stage_backward_s"]
    w = [min(x, y) for x, y in zip(plan.get("stage_weight_s") or b, b)]
    comm = plan.get("boundary_comm_s") or 0.0
    res = simulate(sched, f, b, weight_s=w, comm_s=comm if len(f) > 1 else 0.0)
    res.to_png(path, title=title)
    return path


def run_worker(job: Job) -> dict:
    """Train on this rank (see the module docstring); returns this rank's summary."""
    import torch
    import torch.distributed as dist

    from engine import OptimizerConfig, Pipeline
    from engine import checkpoint as ck
    from experiments.data import make_dataset
    from experiments.models import build_model
    from experiments.tracking import ProgressBar, Tracker
    from experiments.train import engine_optimizer_kwargs, pipeline_kwargs

    torch.set_num_threads(1)
    stop = _StopFlag()
    stop.install()
    cfg = job.config
    tcfg, lcfg, ccfg = cfg["train"], cfg["logger"], cfg["checkpoint"]
    spec = build_model(cfg["model"])
    device = None if tcfg.get("device", "auto") == "auto" else tcfg["device"]
    kwargs = pipeline_kwargs(cfg, job.stage_ranges, ties=spec.ties, device=device)
    total_steps = int(tcfg["steps"])
    pipe = Pipeline(spec.layers, loss_fn=spec.loss_fn,
                    optimizer=OptimizerConfig(**engine_optimizer_kwargs(cfg)), **kwargs)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    p = pipe.num_stages
    owner = rank == p - 1  # last stage of replica 0 owns the loss
    barrier = dist.barrier if world > 1 else (lambda: None)
    num_layers = len(spec.layers)

    start = 0
    if job.resume_from:
        expected = {int(i): m.state_dict() for i, m in pipe.layer_module.items()}
        c = ck.load_checkpoint(job.resume_from, sorted(expected), expected=expected,
                               num_layers=num_layers, rank=rank, world=world)
        pipe.load_state_dict({"layers": c.layers, "step": c.meta["step"],
                              "optimizer": ck.merge_optimizer_state(c.optimizer, c.meta["optimizer"])})
        ck.restore_rng(c.rng)
        start = int(c.meta["data_position"])

    last = pipe.schedule.num_chunks - 1
    needs_data = 0 in pipe.chunks or last in pipe.chunks
    data = make_dataset(cfg) if needs_data else None
    batch = int(tcfg["batch_size"])

    def batch_of(step: int, evaluation: bool = False) -> tuple[Any, Any]:
        if data is None:
            return None, None
        x, y = data.eval_batch(step, batch) if evaluation else data.train_batch(step, batch)
        return (x if 0 in pipe.chunks else None), (y if last in pipe.chunks else None)

    def evaluate() -> float:
        n = max(1, int(tcfg.get("eval_batches", 1)))
        return sum(pipe.eval_step(*batch_of(i, True)) for i in range(n)) / n

    every = int(ccfg.get("every_steps") or 0)
    saved: list[str] = []

    def save(step: int) -> None:
        sd = pipe.state_dict()  # collective with ZeRO (gathers the sharded optimizer state)
        per_layer, scalars = ck.split_optimizer_state(sd["optimizer"])
        first = pipe.mesh.replica == 0
        path = ck.save_checkpoint(job.checkpoint_root, step, layers=sd["layers"] if first else {},
                                  optimizer=per_layer if first else {}, num_layers=num_layers,
                                  meta=checkpoint_meta(step, scalars, cfg, job.stage_ranges),
                                  rank=rank, world=world, barrier=barrier,
                                  keep_last=int(ccfg.get("keep_last") or 0) or None)
        saved.append(str(path))

    plan = job.plan
    pred_act, pred_f, pred_b = _rank_predictions(plan, p)
    run_dir = Path(job.run_dir)
    tracker = Tracker(run_dir, config={**cfg, "plan": {k: plan.get(k) for k in (
        "stage_ranges", "step_s", "bubble_fraction", "method", "predicted_by")}},
        mode=lcfg["mode"], project=lcfg["project"], name=job.run_name, entity=lcfg.get("entity"),
        group=lcfg.get("group"), tags=lcfg.get("tags") or (), enabled=owner)
    if owner:
        tracker.log_plan(_PlanView(plan), step=start)
        tracker.summary({"resumed_from_step": start} if start else {})
        if lcfg.get("timeline", True):
            png = _timeline_png(plan, run_dir / "timeline_predicted.png",
                                f"predicted ({plan['schedule']}, p={p}, m={plan['microbatches']})")
            tracker.log_image("timeline/predicted", png, caption="plan's predicted schedule", step=start)
    tokens = int(spec.tokens_per_sample)
    log_every = max(1, int(tcfg.get("log_every") or 1))
    eval_every = int(tcfg.get("eval_every") or 0)
    show_bar = owner and bool(lcfg.get("progress", True))
    bar = ProgressBar(total_steps, enabled=show_bar, description=job.run_name)
    bar.update(start)
    losses: list[float] = []
    times: list[float] = []
    measured_f = [0.0] * p
    measured_b = [0.0] * p
    n_gathered = 0
    peak_act = [0] * p
    stopped_at: int | None = None
    step = start
    t_start = time.perf_counter()
    try:
        while step < total_steps:
            x, y = batch_of(step)
            done = step + 1
            log_now = done % log_every == 0 or done == total_steps or done == start + 1
            res = pipe.train_step(x, y, diagnose=log_now)  # diagnostics only on logged steps
            stats = dict(res.stats, step_time_s=res.step_time_s)
            record_extra: dict[str, Any] = {"lr": res.lr, "grad_norm": res.grad_norm,
                                            "skipped": res.skipped,
                                            "predicted_step_s": plan.get("step_s")}
            if log_now:
                gathered: list[Any] = [None] * world
                if world > 1:
                    dist.all_gather_object(gathered, stats)
                else:
                    gathered = [stats]
                stages = _stage_lists(gathered, p)
                for j, s in enumerate(stages):
                    s["predicted_peak_activation_bytes"] = pred_act[j]
                    s["predicted_forward_s"] = pred_f[j]
                    s["predicted_backward_s"] = pred_b[j]
                    peak_act[j] = max(peak_act[j], int(s["peak_activation_bytes"] or 0))
                    if done > start + 1:  # the first step warms up
                        measured_f[j] += s["forward_s"] or 0.0
                        measured_b[j] += s["backward_s"] or 0.0
                n_gathered += done > start + 1
                record_extra["optimizer_state_bytes"] = [g.get("optimizer_state_bytes") for g in gathered]
                record_extra["bubble_fraction"] = statistics.fmean(
                    s["idle_fraction"] for s in stages if s["idle_fraction"] is not None)
            else:
                stages = None
            if (eval_every and done % eval_every == 0) or done == total_steps:
                record_extra["eval_loss"] = evaluate()
            losses.append(res.loss)
            times.append(res.step_time_s)
            tracker.log_step(done, loss=res.loss, step_time_s=res.step_time_s, batch_size=batch,
                             tokens_per_sample=tokens, stages=stages, **record_extra)
            if show_bar:
                bar.update(done, loss=res.loss, tokens_per_s=batch * tokens / res.step_time_s)
            elif owner and (done % log_every == 0 or done == total_steps):
                ev = f" eval {record_extra['eval_loss']:.4f}" if "eval_loss" in record_extra else ""
                print(f"step {done}/{total_steps} loss {res.loss:.4f}{ev} "
                      f"{batch * tokens / res.step_time_s:,.0f} tok/s", flush=True)
            step = done
            if every and done % every == 0:
                save(done)
            flag = torch.tensor([stop.signum or 0], dtype=torch.int64)
            if world > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if int(flag.item()):
                stopped_at = done
                break
        if every and step > start and (not saved or not saved[-1].endswith(f"{step:06d}")):
            save(step)  # the final (or interrupted) state
    finally:
        bar.close()
        stop.restore()

    wall = time.perf_counter() - t_start
    summary: dict[str, Any] = {"rank": rank, "start_step": start, "end_step": step,
                               "stopped_at": stopped_at, "checkpoints": saved}
    if owner:
        steady = times[1:] if len(times) > 1 else times
        med = statistics.median(steady) if steady else float("nan")
        pred = float(plan.get("step_s") or float("nan"))
        summary.update({
            "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
            "median_step_s": med, "predicted_step_s": pred,
            "step_s_error": (pred / med - 1) if med > 0 and math.isfinite(pred) else None,
            "train_wall_s": wall, "peak_activation_bytes": peak_act,
            "predicted_peak_activation_bytes": pred_act,
        })
        if lcfg.get("timeline", True) and n_gathered:
            v = int(plan.get("virtual_stages", 1))
            m = int(plan["microbatches"])
            chunks = len(job.stage_ranges)
            from engine.schedules import chunk_ranks
            rank_of = chunk_ranks(plan["schedule"], p, v)
            f_c = [measured_f[rank_of[c]] / n_gathered / (m * v) for c in range(chunks)]
            b_c = [measured_b[rank_of[c]] / n_gathered / (m * v) for c in range(chunks)]
            png = _timeline_png(plan, run_dir / "timeline_measured.png",
                                "re-simulated from measured per-stage compute times", f_c, b_c)
            tracker.log_image("timeline/measured", png,
                              caption="schedule simulated with the measured per-stage forward/backward times",
                              step=step)
        tracker.summary({k: summary[k] for k in ("first_loss", "final_loss", "median_step_s",
                                                 "predicted_step_s", "step_s_error", "train_wall_s")})
        offline = sorted(run_dir.glob("wandb/offline-run-*"))
        summary["wandb_run"] = str(offline[-1]) if offline else None
    tracker.finish()
    return summary


class _PlanView:
    """Attribute access to a `Plan.to_dict()` (for `Tracker.log_plan`)."""

    def __init__(self, d: dict) -> None:
        self.__dict__.update(d)
