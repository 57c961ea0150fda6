"""The training loop of one worker (`python -m experiments.train` starts one per rank).

`run_worker(job)` runs on every rank (started by `engine.launch`, or in-process under
`torchrun`) and drives a `Trainer` through its phases:

- `build`: this rank's layers as an `engine.Pipeline` on the plan's stage ranges, the dataset
  (on the ranks with the first or last chunk), the tracker and the progress bar;
- `resume`: layers, optimizer state, RNG and data position from the job's checkpoint;
- `step`: one `Pipeline.train_step` on the step's global batch (a pure function of seed, step);
- `record`: every `train.log_every` steps the per-pipeline-rank figures are gathered and written
  as `rank_<name>` lists beside the plan's predictions; the loss-owning rank (last stage of
  replica 0) writes `metrics.jsonl`, logs to W&B and shows progress; an MoE model adds
  `aux_loss` (the router auxiliary loss, mean over the microbatches: every step where the
  writer holds the last chunk, on the gathered steps under the V placement, where rank 0 does);
- `checkpoint`: every `checkpoint.every_steps` steps, and at the end or when stopped;
- `finish`: the summary (loss, median step beside the predicted one) and the timeline
  re-simulated with the measured compute times.

SIGTERM (and SIGINT where this process handles it: `engine.launch` has its workers ignore
Ctrl-C and forwards SIGTERM) sets a flag; the flag is combined across all ranks after every
step, so every rank stops after the same step, writes a checkpoint when checkpointing is on,
and returns normally.

Example (what `experiments.train` does)::

    job = experiments.job.prepare_job(cfg, run_dir)
    results = engine.launch(run_worker, world_size(cfg), job)
"""

from __future__ import annotations

import math
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from experiments.job import Job

__all__ = ["Trainer", "memory_warning", "run_worker", "checkpoint_meta", "StopFlag", "STOP_SIGNALS", "RANK_FIGURES"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# StepResult.stats figures written per pipeline rank (metrics.jsonl `rank_<name>`); data_time_s
# (the wait for the step's batch) is added by the loop.
RANK_FIGURES = ("forward_s", "backward_s", "optimizer_s", "comm_wait_s", "comm_issue_s", "idle_s",
                "peak_activation_bytes", "optimizer_state_bytes", "bytes_sent", "data_time_s")


def run_worker(job: Job) -> dict:
    """Train on this rank (see the module docstring); returns this rank's summary."""
    return Trainer(job).run()


_META_LAYOUT = ("stages", "schedule", "microbatches", "virtual_stages", "data_parallel")


def checkpoint_meta(step: int, scalars: dict, cfg: Any, stage_ranges: list,
                    data_state: dict | None = None) -> dict:
    """The JSON run state stored with a checkpoint (rank 0's copy is kept in the manifest).

    `data_position` is the step whose batch comes next; `data` (data=hf) the readers' place
    behind it: the shard count and, when streaming, each shard's position in the files."""
    from experiments.config import as_config, to_plain_dict

    cfg = as_config(cfg)
    meta = {"step": int(step), "data_position": int(step), "optimizer": scalars,
            "stage_ranges": [list(r) for r in stage_ranges],
            "pipeline": {k: v for k, v in to_plain_dict(cfg.pipeline).items() if k in _META_LAYOUT},
            "model": to_plain_dict(cfg.model), "seed": int(cfg.train.seed)}
    if data_state is not None:
        meta["data"] = data_state
    return meta


class StopFlag:
    """Set by a stop signal; the training loop polls it between steps.

    A signal this process ignores stays ignored (`engine.launch` makes its workers ignore
    SIGINT: Ctrl-C reaches the whole process group, and the launcher alone turns it into one
    SIGTERM per worker).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            try:
                if signal.getsignal(sig) is signal.SIG_IGN:
                    continue
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def _stage_ranks(gathered: list[Any], p: int, tp: int = 1) -> list[Any]:
    """Replica 0's entry per pipeline rank, at tp rank 0 (global ranks 0, tp, 2 tp, ...).

    >>> _stage_ranks(["s0t0", "s0t1", "s1t0", "s1t1"], 2, 2)
    ['s0t0', 's1t0']
    """
    return gathered[:p * tp:tp]


def _rank_figures(gathered: list[dict], p: int, tp: int = 1) -> list[dict]:
    """Per pipeline rank (replica 0's processes, tp rank 0), the figures of `RANK_FIGURES` and the
    idle share."""
    out = []
    for s in _stage_ranks(gathered, p, tp):
        dt = s.get("step_time_s") or float("nan")
        row = {k: s.get(k) for k in RANK_FIGURES}
        row["idle_fraction"] = (s.get("idle_s", 0.0) / dt) if dt > 0 else None
        out.append(row)
    return out


def memory_warning(step: int, rank: int, measured: dict[str, Any], predicted: float | None
                   ) -> str | None:
    """The warning for a measured peak (``engine.memtrack.MemoryReport.to_dict()``) over the
    plan's ``predicted`` bytes, or None. The plan models what the pipeline holds; tensors alive
    before the step that are neither parameters, gradients nor optimizer state ("other": the
    data the process keeps, e.g. the default experiment's byte corpus) are outside it, so the
    peak less those is compared, and they are named in the message.

    >>> mem = {"peak_bytes": 30 << 20, "breakdown": {"activations": 20 << 20, "other": 8 << 20}}
    >>> memory_warning(1, 0, mem, 24 << 20) is None         # 22 MiB modelled: within 10%
    True
    >>> memory_warning(1, 0, mem, 19 << 20)[:59]
    'warning: step 1, pipeline rank 0: measured peak memory 30.0'
    """
    if not predicted:
        return None
    from engine.memtrack import modelled_peak

    breakdown = measured.get("breakdown", {})
    peak, modelled = int(measured["peak_bytes"]), modelled_peak(measured)
    other = peak - modelled
    if modelled <= 1.1 * predicted:
        return None
    kinds = {k: round(v / 2**20, 1) for k, v in breakdown.items()}
    return (f"warning: step {step}, pipeline rank {rank}: measured peak memory {peak / 2**20:.1f} "
            f"MiB, {modelled / 2**20:.1f} MiB without the {other / 2**20:.1f} MiB of other tensors "
            f"alive before the step (data, buffers the plan does not know), is "
            f"{modelled / predicted - 1:.0%} above the plan's prediction {predicted / 2**20:.1f} MiB "
            f"(measured by kind: {kinds} MiB)")


class Trainer:
    """One rank's training job, phase by phase (see the module docstring)."""

    def __init__(self, job: Job) -> None:
        self.job, self.cfg = job, job.config
        self.plan = job.plan
        self.tcfg, self.lcfg, self.ccfg = self.cfg.train, self.cfg.logger, self.cfg.checkpoint
        self.total_steps = int(self.tcfg.steps)
        self.batch = int(self.tcfg.batch_size)
        self.log_every = max(1, int(self.tcfg.log_every or 1))
        self.every = int(self.ccfg.every_steps or 0)
        self.start = 0
        self.losses: list[float] = []
        self.times: list[float] = []
        self.saved: list[str] = []
        self.stopped_at: int | None = None

    # ---------------------------------------------------------------------------------- build
    def build(self) -> None:
        """This rank's pipeline, data, tracker and progress bar."""
        import torch
        import torch.distributed as dist

        from engine import OptimizerConfig, Pipeline
        from experiments.data import make_dataset
        from experiments.models import build_model
        from experiments.wiring import engine_optimizer_kwargs, pipeline_kwargs

        torch.set_num_threads(1)
        self.spec = build_model(self.cfg.model)
        device = None if self.tcfg.device == "auto" else str(self.tcfg.device)
        kwargs = pipeline_kwargs(self.cfg, self.job.stage_ranges, ties=self.spec.ties, device=device,
                                 recompute=self.plan.stage_recompute or None)
        if kwargs["schedule"] == "zb-auto":   # built from the plan's per-chunk costs
            kwargs["schedule"] = self.plan.build_schedule()
        self.pipe = Pipeline(self.spec.layers, loss_fn=self.spec.loss_fn,
                             optimizer=OptimizerConfig(**engine_optimizer_kwargs(self.cfg, self.plan)), **kwargs)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.p, self.tp = self.pipe.num_stages, self.pipe.tensor_parallel
        self.owner = self.rank == (self.p - 1) * self.tp  # last stage of replica 0 (tp rank 0) owns the loss
        self.last = self.pipe.schedule.num_chunks - 1
        needs_data = 0 in self.pipe.chunks or self.last in self.pipe.chunks
        self.data = (make_dataset(self.cfg, replica=self.pipe.mesh.replica, prepared=self.job.data)
                     if needs_data else None)
        self.data_time = 0.0
        self.measured_f = [0.0] * self.p
        self.measured_b = [0.0] * self.p
        self.peak_act = [0] * self.p
        self.n_gathered = 0
        self._predictions()
        from experiments.recovery import make_checkpointer  # collective: every rank, same point
        self.saver = make_checkpointer(self.ccfg, self.job.checkpoint_root, len(self.spec.layers))

    def _predictions(self) -> None:
        """The plan's per-rank predictions (chunks summed) that the metrics are set beside."""
        plan, m = self.plan, self.plan.microbatches
        n = plan.num_chunks
        self.pred_act = [int(x) for x in plan.per_rank(plan.stage_activation_bytes or [0] * n)]
        self.pred_f = plan.per_rank([x * m for x in plan.stage_forward_s or [0.0] * n])
        self.pred_b = plan.per_rank([x * m for x in plan.stage_backward_s or [0.0] * n])

    def _open_tracker(self) -> None:
        from experiments.tracking import ProgressBar, Tracker

        lcfg, plan = self.lcfg, self.plan
        run_dir = Path(self.job.run_dir)
        self.tracker = Tracker(
            run_dir, config={**self.job.plain_config(), "plan": {k: getattr(plan, k) for k in (
                "stage_ranges", "step_s", "bubble_fraction", "method", "predicted_by", "stage_recompute")}},
            mode=lcfg.mode, project=lcfg.project, name=self.job.run_name, entity=lcfg.entity,
            group=lcfg.group, tags=lcfg.tags or (), enabled=self.owner)
        self.show_bar = self.owner and bool(lcfg.progress)
        self.bar = ProgressBar(self.total_steps, enabled=self.show_bar, description=self.job.run_name)
        self.bar.update(self.start)
        if not self.owner:
            return
        self.tracker.log_plan(plan, step=self.start)
        self.tracker.summary({"resumed_from_step": self.start} if self.start else {})
        if lcfg.timeline:
            png = run_dir / "timeline_predicted.png"
            plan.simulate().to_png(png, title=f"predicted ({plan.schedule}, p={self.p}, m={plan.microbatches})")
            self.tracker.log_image("timeline/predicted", png, caption="plan's predicted schedule", step=self.start)

    # --------------------------------------------------------------------------------- resume
    def resume(self) -> None:
        """Layers, optimizer state, RNG and data position from the job's checkpoint (if any);
        after a restart, from the newest loadable checkpoint of this run (`experiments.recovery`)."""
        from engine import checkpoint as ck
        from engine.cluster import restart_count
        from experiments import recovery

        attempt = restart_count()
        resume_from, skipped = recovery.resume_point(self.job.resume_from, self.job.checkpoint_root, attempt)
        if resume_from:
            pipe = self.pipe
            expected = pipe.checkpoint_template()   # fp32 (the masters, with 16-bit weights)
            c = ck.load_checkpoint(resume_from, sorted(expected), expected=expected,
                                   num_layers=len(self.spec.layers), rank=self.rank, world=self.world)
            pipe.load_state_dict({"layers": c.layers, "step": c.meta["step"],
                                  "optimizer": ck.merge_optimizer_state(c.optimizer, c.meta["optimizer"])})
            ck.restore_rng(c.rng)
            self.start = int(c.meta["data_position"])
            if self.data is not None and hasattr(self.data, "restore"):
                self.data.restore(self.start, c.meta.get("data"))
        self._open_tracker()
        if self.owner and attempt > 0:
            event = recovery.restart_event(self.job.run_dir, attempt, self.start, resume_from, skipped)
            recovery.announce(event)
            self.tracker.log_event("restart", self.start, **event)

    # ----------------------------------------------------------------------------------- step
    def _batch_of(self, step: int, evaluation: bool = False) -> tuple[Any, Any]:
        if self.data is None:
            return None, None
        get = self.data.eval_batch if evaluation else self.data.train_batch
        x, y = get(step, self.batch)
        return (x if 0 in self.pipe.chunks else None), (y if self.last in self.pipe.chunks else None)

    def _logged(self, done: int) -> bool:
        """Whether step `done` gathers the per-rank figures: the first, every `log_every`, the last."""
        return done % self.log_every == 0 or done == self.total_steps or done == self.start + 1

    def _measured(self, step: int) -> bool:
        """Whether step `step` (0-based) measures each rank's peak memory: the first two steps
        of the run (or of a resumed run) and every `train.memory_every` steps."""
        every = int(self.tcfg.memory_every or 0)
        return every > 0 and (step - self.start < 2 or step % every == 0)

    def step(self, step: int) -> Any:
        """One optimizer step on the global batch of `step`; returns the `StepResult`. The
        engine's costly diagnostics (activation bytes, grad norm) run on logged steps only, the
        memory measurement (MemTracker) on the steps of `_measured`."""
        t0 = time.perf_counter()
        batch = self._batch_of(step)
        self.data_time = time.perf_counter() - t0
        router_loss = self.spec.loss_fn if hasattr(self.spec.loss_fn, "pop") else None
        if router_loss is not None:
            router_loss.clear()   # what an evaluation left
        res = self.pipe.train_step(*batch, diagnose=self._logged(step + 1),
                                   measure_memory=self._measured(step))
        res.stats["data_time_s"] = self.data_time
        if router_loss is not None:  # an MoE model: the router auxiliary loss, on the loss's rank
            res.stats["aux_loss"] = router_loss.pop()
        self.losses.append(res.loss)
        self.times.append(res.step_time_s)
        return res

    def evaluate(self) -> float:
        """The held-out loss over `train.eval_batches` batches (every rank joins)."""
        n = max(1, int(self.tcfg.eval_batches))
        return sum(self.pipe.eval_step(*self._batch_of(i, True)) for i in range(n)) / n

    # --------------------------------------------------------------------------------- record
    def _gather(self, res: Any, done: int) -> tuple[list[dict], dict[str, Any]]:
        """Every rank's figures of this step; per pipeline rank beside the predictions."""
        import torch.distributed as dist

        stats = dict(res.stats, step_time_s=res.step_time_s)
        gathered: list[Any] = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(gathered, stats)
        else:
            gathered = [stats]
        ranks = _rank_figures(gathered, self.p, self.tp)
        stages = _stage_ranks(gathered, self.p, self.tp)
        warm = done > self.start + 1  # the first step warms up
        for j, s in enumerate(ranks):
            s.update(predicted_peak_activation_bytes=self.pred_act[j], predicted_forward_s=self.pred_f[j],
                     predicted_backward_s=self.pred_b[j])
            self.peak_act[j] = max(self.peak_act[j], int(s["peak_activation_bytes"] or 0))
            if warm:
                self.measured_f[j] += s["forward_s"] or 0.0
                self.measured_b[j] += s["backward_s"] or 0.0
        self.n_gathered += warm
        if all("memory_measured" in g for g in stages):
            self._memory_figures(ranks, stages, done)
        aux = [g["aux_loss"] for g in stages if g.get("aux_loss") is not None]
        extra = {"optimizer_state_bytes": [g.get("optimizer_state_bytes") for g in gathered],
                 **({"aux_loss": aux[0]} if aux else {}),
                 "bubble_fraction": statistics.fmean(
                     s["idle_fraction"] for s in ranks if s["idle_fraction"] is not None)}
        return ranks, extra

    def _memory_figures(self, ranks: list[dict], stages: list[dict], done: int) -> None:
        """Measured beside predicted peak memory per pipeline rank (replica 0, tp rank 0); a
        warning (:func:`memory_warning`) when a rank's modelled memory exceeds the plan's by 10%."""
        pred = list(self.plan.rank_memory_bytes or [None] * self.p)
        for j, (row, g) in enumerate(zip(ranks, stages)):
            mem = g["memory_measured"]
            row.update(peak_bytes_measured=mem["peak_bytes"], peak_bytes_predicted=pred[j],
                       memory_measured=mem["breakdown"])
            if mem.get("device_peak_bytes") is not None:
                row["device_peak_bytes_measured"] = mem["device_peak_bytes"]
            warning = memory_warning(done, j, mem, pred[j]) if self.owner else None
            if warning:
                print(warning, flush=True)

    def record(self, done: int, res: Any) -> None:
        """Gather (every `log_every` steps), evaluate, write metrics, show progress."""
        extra: dict[str, Any] = {"lr": res.lr, "grad_norm": res.grad_norm, "skipped": res.skipped,
                                 "data_time_s": self.data_time, "predicted_step_s": self.plan.step_s}
        validated = res.stats.get("validated")
        if validated is not None:   # optimizer.step_sync=post_validate: the previous step's verdict
            extra.update(validated_grad_norm=validated["grad_norm"],
                         validated_outcome=validated["outcome"])
        if res.stats.get("aux_loss") is not None:   # this rank holds the loss (else the gather brings it)
            extra["aux_loss"] = res.stats["aux_loss"]
        ranks = None
        if self._logged(done) or "memory_measured" in res.stats:
            ranks, more = self._gather(res, done)
            extra.update(more)
        eval_every = int(self.tcfg.eval_every or 0)
        if (eval_every and done % eval_every == 0) or done == self.total_steps:
            extra["eval_loss"] = self.evaluate()
        tokens = int(self.spec.tokens_per_sample)
        self.tracker.log_step(done, loss=res.loss, step_time_s=res.step_time_s, batch_size=self.batch,
                              tokens_per_sample=tokens, ranks=ranks, **extra)
        rate = self.batch * tokens / res.step_time_s
        if self.show_bar:
            self.bar.update(done, loss=res.loss, tokens_per_s=rate)
        elif self.owner and (done % self.log_every == 0 or done == self.total_steps):
            ev = f" eval {extra['eval_loss']:.4f}" if "eval_loss" in extra else ""
            print(f"step {done}/{self.total_steps} loss {res.loss:.4f}{ev} {rate:,.0f} tok/s", flush=True)

    # ----------------------------------------------------------------------------- checkpoint
    def checkpoint(self, step: int) -> None:
        """Start saving a checkpoint of `step` (collective: every rank calls it); with
        `checkpoint.async_save` the files are written while the next steps run."""
        from engine import checkpoint as ck

        t0 = time.perf_counter()  # the stall counts the state gather too
        sd = self.pipe.state_dict()  # collective with ZeRO (gathers the sharded optimizer state)
        per_layer, scalars = ck.split_optimizer_state(sd["optimizer"])
        # every replica offers its copy: DCP writes each key once, spread over the ranks
        self.saver.save(step, layers=sd["layers"], optimizer=per_layer, started=t0,
                        meta=checkpoint_meta(step, scalars, self.cfg, self.job.stage_ranges,
                                             self._data_state()))
        self.saved.append(str(Path(self.job.checkpoint_root) / f"step_{step:06d}"))

    def record_saves(self, finished: list) -> None:
        """A `checkpoint` event (stall, write time) per finished save."""
        from experiments.recovery import checkpoint_event

        for s in finished:
            self.tracker.log_event("checkpoint", s.step, **checkpoint_event(s))

    def _data_state(self) -> dict | None:
        """data=hf: every replica's reader position, merged (collective: every rank calls it)."""
        import torch.distributed as dist

        if self.job.data is None:  # data=hf alone has reader positions
            return None
        from experiments.hfdata import merge_states

        mine = self.data.state() if self.data is not None else None
        states: list[Any] = [mine]
        if self.world > 1:
            states = [None] * self.world
            dist.all_gather_object(states, mine)
        return merge_states(states)

    def _stop_requested(self, stop: StopFlag) -> bool:
        """Whether any rank got a stop signal (every rank decides the same)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([stop.signum or 0], dtype=torch.int64)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(int(flag.item()))

    # ---------------------------------------------------------------------------------- run
    def run(self) -> dict:
        """build, resume, then step / record / checkpoint until done or stopped; finish."""
        from engine.faults import inject

        stop = StopFlag()
        stop.install()
        try:
            self.build()
            self.resume()
            step, t0 = self.start, time.perf_counter()
            try:
                while step < self.total_steps:
                    inject("step", step + 1, rank=self.rank)  # PIPESHARD_FAULT (tests, soak), else nothing
                    res = self.step(step)
                    step += 1
                    self.record(step, res)
                    if self.every and step % self.every == 0:
                        self.checkpoint(step)
                    if self.saver is not None:
                        self.record_saves(self.saver.poll())
                    if self._stop_requested(stop):
                        self.stopped_at = step
                        break
                self.pipe.settle()   # optimizer.step_sync=post_validate: the last step's verdict
                if self.every and step > self.start and (not self.saved or not self.saved[-1].endswith(f"{step:06d}")):
                    self.checkpoint(step)  # the final (or interrupted) state
                if self.saver is not None:
                    self.record_saves(self.saver.close())
            finally:
                self.bar.close()
                if getattr(self, "data", None) is not None and hasattr(self.data, "close"):
                    self.data.close()
            return self.finish(step, time.perf_counter() - t0)
        finally:
            stop.restore()

    # ---------------------------------------------------------------------------------- finish
    def finish(self, step: int, wall_s: float) -> dict:
        """This rank's summary; the owner adds the loss, timing and the measured timeline."""
        summary: dict[str, Any] = {"rank": self.rank, "start_step": self.start, "end_step": step,
                                   "stopped_at": self.stopped_at, "checkpoints": self.saved}
        if self.owner:
            steady = self.times[1:] if len(self.times) > 1 else self.times
            med = statistics.median(steady) if steady else float("nan")
            pred = float(self.plan.step_s or float("nan"))
            summary.update({
                "first_loss": self.losses[0] if self.losses else None,
                "final_loss": self.losses[-1] if self.losses else None,
                "median_step_s": med, "predicted_step_s": pred,
                "step_s_error": (pred / med - 1) if med > 0 and math.isfinite(pred) else None,
                "train_wall_s": wall_s, "rank_peak_activation_bytes": self.peak_act,
                "rank_predicted_peak_activation_bytes": self.pred_act,
            })
            self._measured_timeline(step)
            self.tracker.summary({k: summary[k] for k in ("first_loss", "final_loss", "median_step_s",
                                                          "predicted_step_s", "step_s_error", "train_wall_s")})
            offline = sorted(Path(self.job.run_dir).glob("wandb/offline-run-*"))
            summary["wandb_run"] = str(offline[-1]) if offline else None
        self.tracker.finish()
        return summary

    def _measured_timeline(self, step: int) -> None:
        """The plan's schedule re-simulated with the measured per-chunk compute times."""
        if not (self.lcfg.timeline and self.n_gathered):
            return
        plan = self.plan
        per = self.n_gathered * plan.microbatches * plan.virtual_stages
        f_c = [self.measured_f[plan.rank_of(c)] / per for c in range(plan.num_chunks)]
        b_c = [self.measured_b[plan.rank_of(c)] / per for c in range(plan.num_chunks)]
        png = Path(self.job.run_dir) / "timeline_measured.png"
        plan.simulate(forward_s=f_c, backward_s=b_c).to_png(
            png, title="re-simulated from measured per-stage compute times")
        self.tracker.log_image("timeline/measured", png, step=step,
                               caption="schedule simulated with the measured per-stage forward/backward times")
