"""`python -m experiments.bench` end to end at tiny size: every expected row, with its fields.

No speed assertions (the machine is shared); one subprocess run with the smallest set of
schedules that still produces a row of every kind (single, pipeshard, torch-pipelining,
deepspeed, partition-quality rows, predictions, pipeshard zbv beside torch's zbv, the planner's
`auto` choice and a `sweep` of the layouts it considered).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.bench.__main__ import _default_experiment

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.layers=2", "model.dim=16", "model.heads=2", "model.vocab=32", "model.seq_len=8",
        "train.batch_size=8", "pipeline.microbatches=4", "bench.steps=1", "bench.warmup_steps=0",
        "partitioner.repeats=1", "partitioner.sweeps=1", "partitioner.warmup=0", "bench.schedules=[1f1b,zbv]",
        "bench.sweep=true", "bench.sweep_max=2", "bench.sweep_confirm=1", "partitioner.search.schedules=[1f1b,zb-h2,zbv]",
        "partitioner.search.max_microbatches=4",
        "bench.methods=[optimal,uniform]", "bench.timeout_s=120",
        "partitioner.link_bytes_per_s=1e9"]  # given, to save a measuring job
ROW_FIELDS = {"system", "schedule", "stages", "microbatches", "step_s", "samples_per_s",
              "ideal_step_s", "peak_rss_bytes", "section"}


def test_default_experiment_is_bench_unless_given() -> None:
    assert _default_experiment(["x", "a=1"]) == ["x", "experiment=bench", "a=1"]
    assert _default_experiment(["x", "experiment=smoke"]) == ["x", "experiment=smoke"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "experiments.bench", f"hydra.run.dir={out}", *TINY],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "bench.png").stat().st_size > 0
    result = json.loads((out / "bench.json").read_text())
    result["_stdout"] = proc.stdout
    return result


def test_every_expected_row_with_its_fields(bench: dict) -> None:
    rows = bench["rows"]
    for r in rows:
        assert ROW_FIELDS <= set(r), (r["system"], r["schedule"], sorted(ROW_FIELDS - set(r)))
        assert "error" not in r, r.get("traceback")
        assert r["step_s"] > 0 and r["samples_per_s"] > 0
        assert (r["ideal_step_s"] or 0) > 0 or r["schedule"] == "full-batch" or (  # no m-microbatch reference
            r["section"] in ("auto", "sweep") and r["microbatches"] != 4)
        assert len(r["peak_rss_bytes"]) == r.get("copies", r["stages"])
    got = {(r["section"], r["system"], r["schedule"], r.get("method")) for r in rows
           if r["section"] not in ("auto", "sweep")}
    want = {("systems", "single", "microbatched", None), ("systems", "single", "full-batch", None),
            ("systems", "single", "loaded", None), ("systems", "single", "loaded-split", None),
            ("systems", "pipeshard", "1f1b", "optimal"), ("systems", "torch-pipelining", "1f1b", None),
            ("systems", "deepspeed", "1f1b", None), ("systems", "pipeshard", "zbv", "optimal"),
            ("systems", "torch-pipelining", "zbv", None),
            ("partition", "pipeshard", "1f1b", "optimal"), ("partition", "pipeshard", "1f1b", "uniform")}
    assert got == want
    assert [r["section"] for r in rows if r["section"] in ("auto", "sweep")] == ["auto", "sweep", "sweep"]
    single = next(r for r in rows if r["schedule"] == "microbatched")
    ps = next(r for r in rows if r["system"] == "pipeshard")
    assert ps["ideal_step_s"] == pytest.approx(single["step_s"] / 2 * (4 + 1) / 4)
    assert ps["stages"] == 2 and ps["microbatches"] == 4


def test_predictions_and_ratios(bench: dict) -> None:
    for r in (r for r in bench["rows"] if r["system"] == "pipeshard" and r["section"] in ("systems", "partition")):
        assert r["predicted_step_s"] > 0
        assert r["step_error"] == pytest.approx(r["predicted_step_s"] / r["step_s"] - 1)
        assert len(r["predicted_activation_bytes"]) == 2 and len(r["measured_activation_bytes"]) == 2
        assert min(r["measured_activation_bytes"]) > 0
        assert len(r["stats"]) == 2 and r["stats"][0]["forward_s"] > 0
    assert {p["method"] for p in bench["prediction"] if p["section"] != "auto" and p["section"] != "sweep"} == {
        "optimal", "uniform"}
    assert set(bench["ratios"]) == {"pipeshard_1f1b_over_torch_1f1b", "deepspeed_over_pipeshard_1f1b",
                                    "best_pipeshard_schedule", "best_pipeshard_over_ideal", "best_torch_schedule",
                                    "best_pipeshard_over_best_torch", "pipeshard_zbv_over_torch_zbv"}
    assert bench["ratios"]["pipeshard_zbv_over_torch_zbv"] > 0
    assert bench["ratios"]["pipeshard_1f1b_over_torch_1f1b"] > 0
    assert bench["meta"]["calibration_factor"] > 0 and bench["meta"]["link_bytes_per_s"] > 0
    step = {r["schedule"]: r["step_s"] for r in bench["rows"] if r["system"] == "single"}
    assert bench["meta"]["calibrated_on"] == "single loaded"  # the compute as busy as in the pipeline
    assert bench["meta"]["load_slowdown"] == pytest.approx(step["loaded"] / step["microbatched"])
    assert bench["meta"]["split_calibration_factor"] is None or bench["meta"]["split_calibration_factor"] > 0
    assert bench["plans"]["1f1b"]["stage_ranges"] == next(
        r["stage_ranges"] for r in bench["rows"] if r["system"] == "pipeshard")
    assert "predicted vs measured" in bench["_stdout"] and "ratios" in bench["_stdout"]


def test_auto_and_sweep_rows(bench: dict) -> None:
    """The planner's choice runs as the `auto` row; the sweep runs its best-predicted layouts;
    bench.json sets the choice beside the fastest of the sweep."""
    rows = {r["section"]: [] for r in bench["rows"]}
    for r in bench["rows"]:
        rows[r["section"]].append(r)
    search, (auto,), sweep = bench["search"], rows["auto"], rows["sweep"]
    chosen = search["chosen"]
    assert auto["layout"] == chosen["label"] and auto["chosen"] and auto["search_rank"] == 1
    assert (auto["schedule"], auto["microbatches"], auto["virtual_stages"]) == (
        chosen["schedule"], chosen["microbatches"], chosen["virtual_stages"])
    assert auto["stage_ranges"] == auto["plan_stage_ranges"] == chosen["stage_ranges"]  # the run is the plan
    assert auto["predicted_step_s"] == chosen["step_s"] and auto["step_s"] > 0
    solved = [c for c in search["candidates"] if c["status"] == "ok"]
    assert search["pruned"] == 0 and len(solved) == search["considered"] > 2  # the sweep solves every layout
    assert {c["schedule"] for c in search["candidates"]} == {"1f1b", "zb-h2", "zbv"}
    assert {c["microbatches"] for c in search["candidates"]} == {2, 4}
    assert [r["layout"] for r in sweep] == [c["label"] for c in solved[:2]]
    cmp = bench["auto"]
    assert cmp["auto_layout"] == chosen["label"] and cmp["sweep_runs"] == 2 and cmp["sweep_failed"] == 0
    fastest = min(sweep, key=lambda r: r["step_s"])
    assert cmp["best_sweep_layout"] == fastest["layout"]
    assert cmp["auto_over_best_sweep"] == auto["step_s"] / fastest["step_s"]
    conf = cmp["confirmation"]  # the choice and the sweep's fastest, run again head to head
    assert conf["rounds"] == 1 and conf["auto_layout"] == chosen["label"]
    assert {x["layout"] for x in conf["layouts"]} == {chosen["label"], fastest["layout"]}
    assert all(x["step_s"] > 0 and x["first_step_s"] > 0 for x in conf["layouts"])
    assert conf["auto_over_best"] == conf["auto_step_s"] / min(x["step_s"] for x in conf["layouts"])
    out = bench["_stdout"]
    assert "confirmation (1 fresh round, head to head): auto (" in out
    assert "auto and sweep: predicted vs measured" in out and "auto's choice (" in out and "search:" in out
