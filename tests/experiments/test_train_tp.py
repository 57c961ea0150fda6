"""`python -m experiments.train pipeline.tensor_parallel=2 model.sequence_parallel=true` on a Hugging
Face Llama (4 processes: 2 stages x 2 tp ranks, the decoder layers sharded by transformers'
base_model_tp_plan, norms and residual stream split on the sequence), then `python -m
experiments.export_hf`: the checkpoint of the tp run holds whole tensors, and the exported model
equals the one exported from the same run without tensor parallelism. And a tp run whose layout
keys are all `auto` trains the layout its search chose.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.tracking import read_metrics
from wandb_offline import read_offline_run

ROOT = Path(__file__).resolve().parents[2]
BASE = ["experiment=smoke", "partitioner.method=uniform", "logger.progress=false", "logger.timeline=false",
        "checkpoint.every_steps=2", "train.steps=2", "model=hf_llama", "model.tie_embeddings=false",
        "model.layers=2", "model.dim=32", "model.heads=4", "model.kv_heads=2", "model.intermediate=64",
        "model.seq_len=32", "optimizer.name=sgd", "optimizer.lr=0.5",
        "partitioner.profile=analytic", "partitioner.device_spec=h100"]  # the plan is not under test


def _run(module: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_tensor_parallel_llama_trains_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    exported = {}
    # (tp2 without sequence parallelism trains and resumes across layouts in test_resume.py)
    layouts = {"tp2-sp": ["pipeline.tensor_parallel=2", "model.sequence_parallel=true"],
               "tp1": ["pipeline.tensor_parallel=1"]}
    for key, layout in layouts.items():
        run = tmp_path / key
        _run("experiments.train", *BASE, *layout, f"hydra.run.dir={run}")
        _run("experiments.export_hf", f"checkpoint={run}", f"out={tmp_path / f'out-{key}'}")
        exported[key] = (AutoModelForCausalLM.from_pretrained(tmp_path / f"out-{key}").state_dict(),
                         [r["loss"] for r in read_metrics(run)])
    want, want_losses = exported["tp1"]
    for key in ("tp2-sp",):
        got, got_losses = exported[key]
        assert got_losses == pytest.approx(want_losses, rel=1e-5), key
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-7, msg=lambda m, n=name, k=key: f"{k} {n}: {m}")


AUTO = [*(a for a in BASE if a != "partitioner.method=uniform" and not a.startswith("model.layers=")),
        "model.layers=4", "pipeline.tensor_parallel=2", "pipeline.schedule=auto", "pipeline.microbatches=auto",
        "pipeline.activation_checkpointing=auto", "pipeline.recompute_granularity=auto", "model.sequence_parallel=auto"]


@pytest.mark.slow
def test_a_tensor_parallel_run_trains_the_layout_its_search_chose(tmp_path):
    """`schedule`, `microbatches`, checkpointing, its granularity and sequence parallelism all
    `auto` under tp = 2, with a memory limit at the sequence-parallel plan's peak: the run's
    plan is the search's (analytic costs: deterministic), it is sequence parallel, the workers
    ran that layout and trained."""
    from experiments.config import compose_config
    from experiments.wiring import search_layout

    sp = search_layout(compose_config(*[a for a in AUTO if "sequence_parallel" not in a],
                                      "model.sequence_parallel=true"), None).chosen.peak_memory_bytes
    limit = [f"partitioner.memory_limit={sp}"]
    want = search_layout(compose_config(*AUTO, *limit), None).plan
    assert want.sequence_parallel and max(want.rank_memory_bytes) <= sp
    run = tmp_path / "run"
    out = _run("experiments.train", *AUTO, *limit, f"hydra.run.dir={run}", "logger.mode=offline")
    plan = json.loads((run / "plan.json").read_text())
    for key in ("schedule", "microbatches", "virtual_stages", "stage_recompute", "sequence_parallel",
                "recompute_granularity"):
        assert plan[key] == getattr(want, key), key
    assert f"the planner chose {want.schedule}, {want.microbatches} microbatches" in out
    wb = read_offline_run(run)  # what the workers ran: the chosen layout, written into the config
    assert wb.config["pipeline"]["schedule"] == want.schedule and wb.config["model"]["sequence_parallel"] is True
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["loss"]) for r in records)
