"""The benchmark's systems at tiny size: rows, same math as a single process, failures, reports.

No speed assertions: the machine is shared. Multi-process runs are few and tiny (one DeepSpeed job).
"""

from __future__ import annotations

import functools
import json
import os
import time

import pytest
import torch

from engine.launch import WorkerError
from experiments import bench
from experiments.bench import (BenchSpec, add_ideal, bar_chart, format_table, ideal_step_s, json_rows,
                               launch_fresh, run_deepspeed, run_peers, run_pipeshard, run_single,
                               run_torch_pipelining, tiny_spec)
from experiments.bench.spec import ResidualMLPBlock, uniform_ranges
from experiments.bench.torch_pp import chunk_to_rank
from faults import FailingLayer, hang_worker

ROW_KEYS = {"system", "schedule", "stages", "microbatches", "step_s", "step_s_all", "samples_per_s",
            "peak_rss_bytes", "loss"}


def _spec(**kw) -> BenchSpec:
    args = dict(layers=8, width=32, batch=16, stages=2, microbatches=4, steps=2, warmup=0, lr=0.5)
    args.update(kw)
    return tiny_spec(**args)


def _check_row(row: dict, system: str, stages: int, steps: int = 2) -> None:
    assert ROW_KEYS <= set(row), sorted(ROW_KEYS - set(row))
    assert "error" not in row, row.get("traceback")
    assert row["system"] == system and row["stages"] == stages
    assert len(row["step_s_all"]) == steps and row["step_s"] > 0
    assert len(row["peak_rss_bytes"]) == stages and min(row["peak_rss_bytes"]) > 10 * 2**20
    assert row["threads"] == [1] * stages
    json.dumps(json_rows([row]))


def _assert_same_math(row: dict, ref: dict) -> None:
    """Same losses at every step and same parameters after the last SGD step (fp32)."""
    assert row["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert row["losses"][0] != pytest.approx(row["losses"][-1], rel=1e-3)  # training did move
    assert set(row["params"]) == set(ref["params"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(row["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def spec() -> BenchSpec:
    return _spec()


@pytest.fixture(scope="module")
def single_ref(spec: BenchSpec) -> dict:
    return run_single(spec, mode="microbatched", return_params=True)


# ---- pure helpers --------------------------------------------------------------------------

def test_ideal_step_s_formula_and_add_ideal() -> None:
    assert ideal_step_s(1.0, 2, 8) == pytest.approx(0.5 * 9 / 8)
    assert ideal_step_s(3.0, 1, 5) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        ideal_step_s(1.0, 0, 8)
    rows = [{"system": "single", "schedule": "microbatched", "stages": 1, "microbatches": 8, "step_s": 2.0},
            {"system": "x", "schedule": "1f1b", "stages": 4, "microbatches": 8, "step_s": 1.0},
            {"system": "y", "schedule": "1f1b", "stages": 2, "microbatches": 3, "step_s": 1.0}]
    add_ideal(rows)
    assert rows[1]["ideal_step_s"] == pytest.approx(2.0 / 4 * 11 / 8)
    assert rows[2]["ideal_step_s"] is None  # no single row with 3 microbatches


def test_spec_rejects_bad_ranges_and_splits_uniformly() -> None:
    assert uniform_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]  # the partitioner's uniform rule
    with pytest.raises(ValueError, match="cover"):
        BenchSpec(layers=[ResidualMLPBlock] * 4, loss_fn=torch.nn.functional.mse_loss,
                  batches=lambda s: (None, None), stage_ranges=[(0, 2), (2, 3)], microbatches=2)
    with pytest.raises(ValueError, match="contiguous"):
        BenchSpec(layers=[ResidualMLPBlock] * 4, loss_fn=torch.nn.functional.mse_loss,
                  batches=lambda s: (None, None), stage_ranges=[(0, 2), (3, 4)], microbatches=2)
    assert _spec().ranges_for(2) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_chunk_placement() -> None:
    assert chunk_to_rank(2, 4, "loop") == [0, 1, 0, 1]
    assert chunk_to_rank(3, 6, "v") == [0, 1, 2, 2, 1, 0]


def test_table_and_chart_show_rows_and_errors(tmp_path) -> None:
    rows = [{"system": "single", "schedule": "microbatched", "stages": 1, "microbatches": 8,
             "step_s": 0.2, "samples_per_s": 320.0, "peak_rss_bytes": [300 * 2**20], "loss": 1.5},
            {"system": "torch-pipelining", "schedule": "1f1b", "stages": 2, "microbatches": 8,
             "step_s": 0.125, "samples_per_s": 512.0, "peak_rss_bytes": [2**28, 2**29], "loss": 1.5},
            {"system": "deepspeed", "schedule": "1f1b", "stages": 2, "microbatches": 8, "step_s": None,
             "samples_per_s": None, "peak_rss_bytes": [], "loss": None, "error": "rank 1: boom"}]
    add_ideal(rows)
    text = format_table(rows)
    assert "torch-pipelining" in text and "rank 1: boom" in text
    assert "125.0" in text and "1.11" in text  # 0.125 s vs ideal 0.1125 s
    assert "512" in text  # max RSS over ranks, MiB
    path = tmp_path / "bench.png"
    bar_chart(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- start ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_hung_run_times_out() -> None:
    with pytest.raises(WorkerError, match="timed out"):
        launch_fresh(hang_worker, 1, 60.0, timeout_s=3)


# ---- runners -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_single_modes_agree(spec: BenchSpec, single_ref: dict) -> None:
    _check_row(single_ref, "single", 1)
    assert single_ref["schedule"] == "microbatched" and single_ref["microbatches"] == 4
    full = run_single(spec, mode="full-batch", return_params=True)
    _check_row(full, "single", 1)
    assert full["microbatches"] == 1
    _assert_same_math(full, single_ref)  # microbatched accumulation = full-batch mean gradient
    loaded = run_single(spec, mode="loaded", return_params=True)   # p = 2 copies at once
    assert loaded["copies"] == min(2, os.cpu_count() or 1) and len(loaded["peak_rss_bytes"]) == loaded["copies"]
    assert loaded["microbatches"] == 4 and loaded["step_s"] > 0
    _assert_same_math(loaded, single_ref)
    split = run_single(spec, mode="loaded-split", return_params=True)  # the engine's I then W
    assert split["copies"] == loaded["copies"] and split["step_s"] > 0
    _assert_same_math(split, single_ref)


@pytest.mark.slow
def test_torch_1f1b_matches_single_process(spec: BenchSpec, single_ref: dict) -> None:
    row = run_torch_pipelining(spec, "1f1b", return_params=True)
    _check_row(row, "torch-pipelining", 2)
    _assert_same_math(row, single_ref)


@pytest.mark.slow
def test_other_torch_schedules_give_rows(spec: BenchSpec, single_ref: dict) -> None:
    names = ("gpipe", "interleaved-1f1b", "zbv")  # interleaved-zb: same code path as zbv, left out for time
    rows = run_peers(spec, systems=("torch-pipelining",), torch_schedules=names, log=None)
    assert [r["schedule"] for r in rows] == list(names)
    by_name = {r["schedule"]: r for r in rows}
    for name in ("gpipe", "interleaved-1f1b"):  # these must run; zero-bubble may be an error row
        assert "error" not in by_name[name], by_name[name].get("traceback")
    for row in rows:
        if "error" not in row:
            _check_row(row, "torch-pipelining", 2)
            assert row["losses"] == pytest.approx(single_ref["losses"], rel=1e-5), row["schedule"]
    assert by_name["zbv"]["virtual_stages"] == 2


@pytest.mark.slow
def test_deepspeed_matches_single_process(spec: BenchSpec, single_ref: dict) -> None:
    row = run_deepspeed(spec, return_params=True)
    _check_row(row, "deepspeed", 2)
    _assert_same_math(row, single_ref)


@pytest.mark.slow
def test_pipeshard_runner_matches_single_process(spec: BenchSpec, single_ref: dict) -> None:
    row = run_pipeshard(spec, "zb-h1", return_params=True)
    _check_row(row, "pipeshard", 2)
    _assert_same_math(row, single_ref)


@pytest.mark.slow
def test_a_failing_run_becomes_an_error_row() -> None:
    base = _spec(layers=4)
    layers = list(base.layers[:3]) + [functools.partial(FailingLayer, "boom in the last layer")]
    bad = BenchSpec(layers=layers, loss_fn=base.loss_fn, batches=base.batches,
                    stage_ranges=base.stage_ranges, microbatches=base.microbatches, steps=1, warmup=0)
    t0 = time.monotonic()
    rows = run_peers(bad, systems=("torch-pipelining",), torch_schedules=("1f1b", "no-such-schedule"),
                     log=None, timeout_s=120)
    # rank 0, blocked on a receive from the failed rank 1, was killed rather than waited for
    assert time.monotonic() - t0 < 60
    assert len(rows) == 2
    assert rows[0]["error"].startswith("rank 1:") and "boom in the last layer" in rows[0]["error"]
    assert "unknown torch schedule" in rows[1]["error"]
    assert rows[0]["step_s"] is None and "Traceback" in rows[0]["traceback"]
    assert rows[0]["error"] in format_table(rows)
    assert bench.json_rows(rows)[0]["error"] == rows[0]["error"]


# ---- bench app helpers (pure) ---------------------------------------------------------------

def _row(step_s: float, times: list[float], rss: list[int], **kw) -> dict:
    return dict(system="pipeshard", schedule="1f1b", stages=2, microbatches=4, step_s=step_s,
                step_s_all=times, samples_per_s=16 / step_s, peak_rss_bytes=rss, **kw)


def test_combine_rounds_pools_steps_and_keeps_failures() -> None:
    a = _row(1.0, [0.9, 1.0, 1.1], [10, 20], tag="a")
    b = _row(3.0, [3.0, 3.0, 3.0], [30, 5], tag="b")
    c = _row(2.0, [2.0, 2.0, 2.0], [1, 1], tag="c")
    row = bench.combine_rounds([a, b, c])
    assert row["step_s"] == 2.0 and row["step_s_rounds"] == [1.0, 3.0, 2.0] and row["rounds"] == 3
    assert row["tag"] == "c" and row["peak_rss_bytes"] == [30, 20]
    assert row["samples_per_s"] == pytest.approx(16 / 2.0)
    failed = {"system": "pipeshard", "schedule": "1f1b", "step_s": None, "error": "boom"}
    assert bench.combine_rounds([failed, a])["failed_rounds"] == ["boom"]
    assert bench.combine_rounds([failed])["error"] == "boom"


def test_ratios_and_markdown() -> None:
    rows = [dict(_row(2.0, [2.0], [1, 1]), section="systems", ideal_step_s=1.0),
            dict(_row(1.5, [1.5], [1, 1]), schedule="zb-h1", section="systems", ideal_step_s=1.0),
            dict(_row(4.0, [4.0], [1, 1]), system="torch-pipelining", section="systems"),
            dict(_row(8.0, [8.0], [1, 1]), system="deepspeed", section="systems"),
            dict(_row(9.0, [9.0], [1, 1]), section="partition", method="uniform", predicted_step_s=9.9,
                 step_error=0.1)]
    r = bench.ratios(rows)
    assert r["pipeshard_1f1b_over_torch_1f1b"] == pytest.approx(0.5)
    assert r["deepspeed_over_pipeshard_1f1b"] == pytest.approx(4.0)
    assert r["best_pipeshard_schedule"] == "zb-h1" and r["best_pipeshard_over_ideal"] == pytest.approx(1.5)
    rows[0]["stats"] = [dict(forward_s=0.5, backward_s=1.0, comm_wait_s=0.2, comm_issue_s=0.1, optimizer_s=0.1)]
    md = bench.format_markdown({"rows": rows, "ratios": r})
    # where rank 0's 2 s step went: the parts, and the rest (2.0 - 1.9 s)
    assert "| 1f1b | 0 | 2000.0 | 500.0 | 1000.0 | 200.0 | 100.0 | 100.0 | 100.0 |" in md
    assert "| uniform |" in md and "+10.0%" in md and "`deepspeed_over_pipeshard_1f1b`: 4.000" in md
    assert bench.ratios([])["pipeshard_1f1b_over_torch_1f1b"] is None
    assert r["best_torch_schedule"] == "1f1b" and r["best_pipeshard_over_best_torch"] == pytest.approx(1.5 / 4.0)
    assert r["pipeshard_zbv_over_torch_zbv"] is None  # no zbv rows
    zbv = rows + [dict(_row(1.2, [1.2], [1, 1]), schedule="zbv", section="systems", ideal_step_s=1.0),
                  dict(_row(3.0, [3.0], [1, 1]), system="torch-pipelining", schedule="zbv", section="systems")]
    rz = bench.ratios(zbv)
    assert rz["pipeshard_zbv_over_torch_zbv"] == pytest.approx(0.4) and rz["best_pipeshard_schedule"] == "zbv"
    assert rz["best_torch_schedule"] == "zbv" and rz["best_pipeshard_over_best_torch"] == pytest.approx(0.4)


def _searched(p: int = 2, batch: int = 16):
    """A search over a synthetic profile (no processes): layouts of several schedules and chunks."""
    import numpy as np

    from partitioner import LayerCost, Profile, search

    rng = np.random.default_rng(3)
    layers = [LayerCost(float(x), float(2 * x), 10**5, 10**5, 10**3) for x in rng.uniform(1e-3, 2e-3, 8)]
    return search(Profile(layers), p, batch, profile_microbatch=2, prune=False, scaling="linear")


def test_layout_runs_turn_the_choice_and_the_sweep_into_pipeshard_jobs() -> None:
    from experiments.bench.auto import layout_runs
    from experiments.bench.jobs import job_table

    res, spec = _searched(), _spec()  # 8 layers, batch 16, like the profile
    runs, entries = layout_runs(res, spec)
    assert len(runs) == len(entries) == 1 and entries[0][0]["section"] == "auto" and entries[0][0]["chosen"]
    solved = [c for c in res.candidates if c.status == "ok"]
    runs, entries = layout_runs(res, spec, sweep=True, sweep_max=6)
    assert [e[0]["section"] for e in entries] == ["auto"] + ["sweep"] * 6
    assert [e[0]["layout"] for e in entries[1:]] == [c.label for c in solved[:6]]
    assert [e[0]["search_rank"] for e in entries[1:]] == list(range(1, 7))
    for (name, s, layout), (extra, key, plan_key), cand in zip(runs[1:], entries[1:], solved):
        assert name == cand.schedule and s.microbatches == cand.microbatches and plan_key is None
        assert [list(r) for r in s.ranges_for(cand.virtual_stages)] == extra["plan_stage_ranges"]
        assert layout.get("virtual_stages") == cand.virtual_stages and layout.get("max_inflight") == cand.max_inflight
        assert extra["predicted_step_s"] == cand.step_s
    jobs = job_table(spec, pipeshard=runs)
    assert len(jobs) == 6  # the choice is the sweep's first layout: one job for both rows
    every, _ = layout_runs(res, spec, sweep=True)
    assert len(every) == 1 + len(solved) and len({c.label for c in solved}) == len(solved)


def test_sweep_comparison_and_its_line() -> None:
    from experiments.bench.auto import comparison_line, format_sweep, rank_correlation, sweep_comparison

    def row(section, layout, pred, meas, **kw):
        return dict(system="pipeshard", schedule=layout.split()[0], microbatches=4, section=section, layout=layout,
                    predicted_step_s=pred, step_s=meas, **kw)

    rows = [row("systems", "1f1b", 1.0, 2.0), row("auto", "zbv m=8", 1.0, 1.05, search_rank=1),
            row("sweep", "zbv m=8", 1.0, 1.05, search_rank=1), row("sweep", "1f1b m=4", 1.1, 1.0, search_rank=2),
            row("sweep", "gpipe m=4", 1.3, 1.4, search_rank=3), row("sweep", "gpipe m=8", 1.5, None, error="boom")]
    cmp = sweep_comparison(rows)
    assert cmp["auto_over_best_sweep"] == pytest.approx(1.05) and cmp["best_sweep_layout"] == "1f1b m=4"
    assert cmp["sweep_runs"] == 4 and cmp["sweep_failed"] == 1
    assert cmp["auto_over_best_schedule_row"] == pytest.approx(1.05 / 2.0)
    assert cmp["sweep_rank_correlation"] == pytest.approx(rank_correlation([1.0, 1.1, 1.3], [1.05, 1.0, 1.4]))
    assert rank_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0) and rank_correlation([1, 2], [1, 2]) is None
    line = comparison_line(cmp)
    assert "measured 1050.0 ms" in line and "fastest of the sweep 1000.0 ms (1f1b m=4), ratio 1.050" in line
    table = format_sweep(rows)
    assert table.index("zbv m=8") < table.index("1f1b m=4") < table.index("gpipe m=4") and "boom" in table
    assert "did not run" in comparison_line(sweep_comparison([row("auto", "zbv m=8", 1.0, None, error="x")]))


def test_confirmation_reruns_the_choice_and_the_fastest_sweep_layouts_head_to_head() -> None:
    """The sweep selects, fresh rounds measure: only the new medians enter the ratio."""
    from experiments.bench.auto import confirm_layouts, confirmation_line
    from experiments.bench.jobs import Job

    second = {"a": [1.10, 1.08], "b": [1.00, 1.02], "c": [1.30, 1.31], "d": [9.0, 9.0]}
    calls: list[str] = []

    def job(name: str) -> Job:
        def run() -> dict:
            k = sum(1 for c in calls if c == name)
            calls.append(name)
            t = second[name][k]
            return dict(system="pipeshard", schedule="1f1b", step_s=t, step_s_all=[t], samples_per_s=1 / t,
                        peak_rss_bytes=[1, 1])
        return Job(("pipeshard", name), "pipeshard", "1f1b", 2, 1, run)

    jobs = {("pipeshard", n): job(n) for n in second}
    entries = [({"section": "auto", "layout": "A"}, ("pipeshard", "a"), None)] + [
        ({"section": "sweep", "layout": n.upper()}, ("pipeshard", n), None) for n in "abcd"]
    first = {("pipeshard", "a"): {"step_s": 1.2}, ("pipeshard", "b"): {"step_s": 0.90},  # b was lucky
             ("pipeshard", "c"): {"step_s": 1.25}, ("pipeshard", "d"): {"step_s": None, "error": "x"}}
    conf = confirm_layouts(entries, first, jobs, _spec(), top=2, rounds=2, log=None)
    assert sorted(calls) == ["a", "a", "b", "b"]  # the choice and the 2 fastest (b, then a itself)
    assert [x["layout"] for x in conf["layouts"]] == ["A", "B"]
    assert conf["auto_step_s"] == pytest.approx(1.09) and conf["best_layout"] == "B"
    assert conf["auto_over_best"] == pytest.approx(1.09 / 1.01)
    assert conf["layouts"][1]["first_step_s"] == 0.90 and conf["layouts"][1]["step_s_rounds"] == [1.00, 1.02]
    line = confirmation_line(conf)
    assert "auto (A) 1090.0 ms" in line and "B 1010.0" in line and "auto / fastest = 1.079" in line


@pytest.mark.long   # 29 s; the paired overhead bench below runs the same engines in the default suite
@pytest.mark.slow
def test_overhead_bench_gives_a_cost_per_action_for_each_engine() -> None:
    from experiments.bench.overhead import format_overhead, overhead_spec, run_overhead

    spec = overhead_spec(2, 4)
    assert len(spec.layers) == 4 and spec.microbatches == 4 and tuple(spec.stage_ranges) == ((0, 2), (2, 4))
    rows = run_overhead(stages=(2,), microbatches=4, rounds=1, steps=2, warmup=1,
                        systems=("pipeshard", "torch-pipelining"), timeout_s=300, log=None)
    by = {r["system"]: r for r in rows}
    assert set(by) == {"pipeshard", "torch-pipelining"}
    for r in rows:
        assert r["section"] == "overhead" and r["stages"] == 2
        assert r["per_action_us"] == pytest.approx(r["step_s"] / 8 * 1e6)
    assert by["pipeshard"]["fitted_action_us"] > 0 and "fitted_action_us" not in by["torch-pipelining"]
    table = format_overhead(rows)
    assert "| 2 | pipeshard |" in table and "| 2 | torch-pipelining |" in table and "1.00 |" in table


@pytest.mark.slow
def test_paired_overhead_times_both_engines_in_the_same_processes() -> None:
    from experiments.bench.overhead import format_overhead, run_paired_overhead

    (row,) = run_paired_overhead(stages=(2,), microbatches=4, blocks=3, block_steps=2, warmup=1, timeout_s=300)
    per = row["per_block_s"]
    assert set(per) == {"pipeshard", "torch-pipelining"} and all(len(v) == 3 for v in per.values())
    ratios = sorted(a / b for a, b in zip(per["pipeshard"], per["torch-pipelining"]))
    assert row["paired_ratio"] == pytest.approx(ratios[1]) and ratios[0] <= row["paired_ratio_p25"] <= ratios[1]
    assert row["step_s"] == pytest.approx(sorted(per["pipeshard"])[1]) and row["section"] == "overhead-paired"
    assert row["per_action_us"] == pytest.approx(row["step_s"] / 8 * 1e6)
    assert "| 2 | " in format_overhead([row]) and f"{row['paired_ratio']:.3f}" in format_overhead([row])


def test_paired_summary_is_the_median_of_per_block_ratios() -> None:
    from experiments.bench.overhead import paired_summary

    # a slow spell that hits both engines in block 3 does not move the paired figure
    s = paired_summary([1.1, 1.2, 3.3, 1.0], [1.0, 1.0, 3.0, 1.0])
    assert s["paired_ratio"] == pytest.approx(1.1) and s["step_s"] == pytest.approx(1.15)
    assert s["paired_ratio_p25"] <= s["paired_ratio"] <= s["paired_ratio_p75"] == pytest.approx(1.125)
