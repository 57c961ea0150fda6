"""`python -m experiments.train` end to end, as users run it: subprocesses with Hydra overrides.

Covers: a default-like job (metrics.jsonl fields, plan.json, a falling loss, the offline W&B run
read back), a bad config refused before any worker starts, a Hydra multirun, and a two-node
torchrun job on loopback whose losses equal the local launcher's.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.tracking import read_metrics
from wandb_offline import read_offline_run

ROOT = Path(__file__).resolve().parents[2]
# Tiny, deterministic layout (the uniform split does not depend on timings).
SMOKE = ["experiment=smoke", "partitioner.method=uniform", "logger.progress=false", "logger.timeline=false"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true", HYDRA_FULL_ERROR="1",
               WANDB_DIR=str(tmp_path / "wandb_dir"), WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), PYTHONPATH=str(ROOT))
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_MODE", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_module(module: str, tmp_path: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m <module> overrides...` in the repository root; output captured as text."""
    return subprocess.run([sys.executable, "-m", module, *overrides], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_default_like_job_writes_metrics_plan_and_offline_wandb(tmp_path):
    run_dir = tmp_path / "run"
    out = _ok(run_module("experiments.train", tmp_path, "train.steps=8", "train.log_every=4",
                         "optimizer.warmup_steps=0", "partitioner.repeats=1", "partitioner.sweeps=1", "partitioner.warmup=1",
                         "data.max_bytes=1000000", "logger.mode=offline", "logger.progress=false",
                         f"hydra.run.dir={run_dir}"))
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["schedule"] == "1f1b" and plan["num_stages"] == 2 and plan["stage_ranges"][-1][1] == 6
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        for key in ("step", "loss", "step_time_s", "samples_per_s", "tokens_per_s", "lr", "grad_norm",
                    "skipped", "predicted_step_s"):
            assert key in r, key
        assert math.isfinite(r["loss"]) and r["step_time_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 128)
    gathered = [r for r in records if "rank_forward_s" in r]
    # first step, every log_every, last; and step 2: train.memory_every measures the first two
    assert [r["step"] for r in gathered if r["step"] != 2] == [1, 4, 8]
    measured = [r for r in records if "rank_peak_bytes_measured" in r]
    assert [r["step"] for r in measured] == [1, 2]
    for r in measured:   # MemTracker's peak per pipeline rank beside the plan's
        assert len(r["rank_peak_bytes_measured"]) == len(r["rank_peak_bytes_predicted"]) == 2
        assert all(0.5 < m / p < 1.5 for m, p in zip(r["rank_peak_bytes_measured"],
                                                     r["rank_peak_bytes_predicted"]))
    for r in gathered:
        for key in ("forward_s", "backward_s", "comm_wait_s", "comm_issue_s", "idle_fraction",
                    "peak_activation_bytes", "optimizer_state_bytes", "predicted_peak_activation_bytes"):
            assert len(r[f"rank_{key}"]) == 2, key
        assert all(b > 0 for b in r["rank_peak_activation_bytes"])
        assert len(r["optimizer_state_bytes"]) == 2  # per rank
    assert "eval_loss" in records[-1] and math.isfinite(records[-1]["eval_loss"])
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.3, losses  # byte-level text: the loss falls within steps
    assert (run_dir / "timeline_predicted.png").stat().st_size > 0
    assert (run_dir / "timeline_measured.png").stat().st_size > 0
    assert "wandb sync" in out and str(run_dir) in out

    wb = read_offline_run(run_dir)
    assert wb.config["pipeline"]["schedule"] == "1f1b" and wb.config["train"]["steps"] == 8
    logged = [h for h in wb.history if "loss" in h]
    assert [h["loss"] for h in logged] == pytest.approx(losses)
    assert any("rank/predicted_peak_activation_bytes/1" in h for h in wb.history)
    assert wb.summary["final_loss"] == pytest.approx(losses[-1])


def test_bad_config_is_refused_before_any_worker_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_module("experiments.train", tmp_path, *SMOKE, "train.batch_size=5", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: train.batch_size=5" in proc.stderr and "multiple of 2" in proc.stderr
    assert "Traceback" not in proc.stderr  # the message and its fix, not a stack
    assert not (run_dir / "plan.json").exists() and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_multirun_sweeps_schedules(tmp_path):
    sweep = tmp_path / "sweep"
    _ok(run_module("experiments.train", tmp_path, "-m", "pipeline.schedule=1f1b,zb-h1", *SMOKE,
                   "train.steps=3", f"hydra.sweep.dir={sweep}", timeout=180))
    schedules = []
    for job in ("0", "1"):
        plan = json.loads((sweep / job / "plan.json").read_text())
        schedules.append(plan["schedule"])
        records = read_metrics(sweep / job)
        assert [r["step"] for r in records] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in records)
    assert schedules == ["1f1b", "zb-h1"]
    # same model, data and seed: the schedules compute the same losses
    a, b = ([r["loss"] for r in read_metrics(sweep / j)] for j in ("0", "1"))
    assert a == pytest.approx(b, rel=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Every process's output, each waited for up to ``timeout_s`` in turn. On a timeout all are
    killed and the test fails with every process's output, so a hang shows where each one was."""
    outs: list[str] = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
        return outs
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        rest = [p.communicate()[0] for p in procs[len(outs):]]  # retrying loses no output
        tails = [f"--- process {k} (exit {p.wait()}) ---\n{out[-3000:]}"
                 for k, (p, out) in enumerate(zip(procs, outs + rest))]
        pytest.fail(f"a process was not done after {timeout_s:g} s:\n" + "\n".join(tails))


@pytest.mark.slow
def test_two_node_torchrun_on_loopback_matches_local_launcher(tmp_path):
    local = tmp_path / "local"
    _ok(run_module("experiments.train", tmp_path, *SMOKE, f"hydra.run.dir={local}"))
    shared = tmp_path / "shared"
    port = _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    agents = [subprocess.Popen([*torchrun, "--node-rank", str(n), "-m", "experiments.train", *SMOKE,
                                f"hydra.run.dir={shared}"], cwd=ROOT, env=_env(tmp_path),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for n in (0, 1)]
    outs = _collect(agents, timeout_s=150)
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-4000:]
    assert "uniform split" in outs[0]  # rank 0 partitioned and printed the plan
    assert "trained steps 1..5" in outs[1]  # the loss-owning rank (last stage) reported
    want = [r["loss"] for r in read_metrics(local)]
    got = [r["loss"] for r in read_metrics(shared)]
    assert len(got) == 5 and got == pytest.approx(want, rel=1e-6)
    assert json.loads((shared / "plan.json").read_text())["stage_ranges"] == \
        json.loads((local / "plan.json").read_text())["stage_ranges"]


def _auto_limit(overrides: list[str]) -> tuple[int, object]:
    """A memory limit (bytes) under which the planner picks a schedule other than the default
    1f1b and recomputes some chunks but not all, with the plan it gives (analytic costs:
    deterministic, so the run's own search makes the same choice)."""
    from experiments.config import compose_config
    from experiments.models import build_model
    from experiments.wiring import search_layout

    spec = build_model(compose_config(*overrides).model)
    free = search_layout(compose_config(*overrides), spec)
    limit = free.chosen.peak_memory_bytes
    for _ in range(30):
        limit = int(limit * 0.93)
        plan = search_layout(compose_config(*overrides, f"partitioner.memory_limit={limit}"), spec).plan
        if plan.schedule != "1f1b" and any(plan.stage_recompute) and not all(plan.stage_recompute):
            return limit, plan
    pytest.fail("no limit made the planner recompute part of a non-default layout")


def test_auto_layout_is_chosen_by_the_planner_and_run(tmp_path):
    auto = [*SMOKE[:1], "logger.progress=false", "logger.timeline=false", "pipeline.schedule=auto",
            "pipeline.microbatches=auto", "pipeline.activation_checkpointing=auto", "partitioner.profile=analytic",
            "partitioner.device_spec=h100", "model.layers=4", "train.batch_size=8"]
    limit, want = _auto_limit(auto)
    run_dir = tmp_path / "run"
    out = _ok(run_module("experiments.train", tmp_path, *auto, f"partitioner.memory_limit={limit}", "train.steps=2",
                         "logger.mode=offline", f"hydra.run.dir={run_dir}", timeout=180))
    plan = json.loads((run_dir / "plan.json").read_text())
    for key in ("schedule", "microbatches", "virtual_stages", "max_inflight", "stage_recompute"):
        assert plan[key] == getattr(want, key), key
    assert [list(r) for r in want.stage_ranges] == plan["stage_ranges"]
    assert plan["search"]["chosen"]["schedule"] == want.schedule and plan["search"]["considered"] > 5
    assert max(plan["rank_memory_bytes"]) <= limit
    assert "search:" in out and f"the planner chose {want.schedule}, {want.microbatches} microbatches" in out
    assert "recompute on chunks" in out
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["loss"]) for r in records)
    wb = read_offline_run(run_dir)  # what the workers ran: the chosen layout, written into the config
    run = wb.config["pipeline"]
    assert (run["schedule"], run["microbatches"], run["virtual_stages"]) == (want.schedule, want.microbatches,
                                                                             want.virtual_stages)
    assert wb.config["plan"]["stage_recompute"] == want.stage_recompute


@pytest.mark.slow
def test_post_validated_run_records_each_steps_verdict_and_matches_the_global_step(tmp_path):
    """`optimizer.step_sync=post_validate` through the entry point: the plan says so, every step
    after the first records the previous step's verdict (a small `grad_clip` makes steps clip,
    so rollbacks happen), and the losses are the synchronous step's."""
    common = [*SMOKE, "pipeline.schedule=zb-h1", "train.steps=5", "optimizer.grad_clip=0.3",
              "optimizer.warmup_steps=0", "partitioner.repeats=1", "partitioner.sweeps=1",
              "partitioner.warmup=1", "partitioner.fixed_costs=false", "train.memory_every=0"]
    runs = {}
    for sync in ("post_validate", "global"):
        run_dir = tmp_path / sync
        _ok(run_module("experiments.train", tmp_path, *common, f"optimizer.step_sync={sync}",
                       f"hydra.run.dir={run_dir}", timeout=180))
        runs[sync] = (json.loads((run_dir / "plan.json").read_text()), read_metrics(run_dir))
    plan, records = runs["post_validate"]
    assert plan["step_sync"] == "post_validate" and runs["global"][0]["step_sync"] == "global"
    outcomes = [r.get("validated_outcome") for r in records]
    assert outcomes[0] is None and None not in outcomes[1:], outcomes
    assert "clipped" in outcomes, outcomes
    assert all(r["grad_norm"] is None for r in records)
    glob = runs["global"][1]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in glob], rel=1e-6)
    # the verdict's norm is the norm the synchronous step reported for that step
    assert [r["validated_grad_norm"] for r in records[1:]] == pytest.approx(
        [r["grad_norm"] for r in glob[:-1]], rel=1e-6)
