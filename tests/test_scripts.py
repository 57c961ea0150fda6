"""The measurement scripts run (tiny sizes: the figures themselves are taken on an idle machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PIPESHARD_FAULT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_checkpoint_stall_benchmark_tiny(tmp_path):
    out = tmp_path / "stall.json"
    _run("scripts/checkpoint_stall.py", "--tiny", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["checkpoint_bytes"] > 0
    for mode in ("sync", "async"):
        assert len(report[mode]["stall_per_checkpoint_s"]) == 2 == len(report[mode]["write_per_checkpoint_s"])
    assert report["none"]["stall_per_checkpoint_s"] == [] and report["none"]["iter_ratio_to_none"] == 1.0


@pytest.mark.slow
def test_failure_recovery_soak_tiny(tmp_path):
    out = tmp_path / "soak.json"
    proc = _run("scripts/soak.py", "--kills", "1", "--steps", "24", "--every", "3", "--layouts", "2x1",
                "--run-dir", str(tmp_path / "run"), "--json", str(out), "--allow-unmeasured")
    report = json.loads(out.read_text())
    assert report["ok"] and report["exit"] == 0 and report["missing_steps"] == [], proc.stdout
    assert len(report["kills"]) == len(report["restarts"]) == 1
    assert "steps with a loss: 24 of 24" in proc.stdout


def _soak_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_soak_memory_growth_measure():
    """A worker life's growth: its start-up ramp is excluded, a steady climb after it is not."""
    soak, mib = _soak_module(), 2**20
    # (time, RSS, loss records so far): 10 samples of start-up before the life's first step at
    # record 100, then 60 samples over 120 records
    startup = [(t, (150 + 13 * t) * mib, 100) for t in range(10)]
    flat = startup + [(10 + i, 280 * mib + (i % 3) * mib // 4, 100 + 2 * i) for i in range(60)]
    leak = startup + [(10 + i, 280 * mib + i * mib // 2, 100 + 2 * i) for i in range(60)]
    assert abs(soak._growth_mib(flat, warm=10)) < 1
    assert soak._growth_mib(leak, warm=10) > 20       # 0.5 MiB per sample over the steady part
    assert soak._growth_mib(flat[:25], warm=10) is None   # too few steady samples
    dead = flat + [(80, 0, 220)]                          # the killed process reads as 0 bytes
    assert abs(soak._growth_mib(dead, warm=10)) < 1


def test_gpu_check_runs_its_parity_cases_on_cpu(tmp_path):
    """scripts/gpu_check.py (run on a lent GPU over NCCL) checks the same cases on gloo / CPU."""
    out = tmp_path / "gpu_check.json"
    _run("scripts/gpu_check.py", "--backend", "gloo", "--device", "cpu", "--json", str(out))
    report = json.loads(out.read_text())
    assert "two_rank_error" not in report, report.get("two_rank_error")
    assert len(report["results"]) == 10 and report["all_ran_agree"]


def test_planner_speed_script_tiny(tmp_path):
    out = tmp_path / "speed.json"
    _run("scripts/planner_speed.py", "--tiny", "--json", str(out))
    rows = json.loads(out.read_text())
    assert rows and rows[0]["layers"] == 60 and rows[0]["cpu_s"] > 0 and rows[0]["split_search"] == "local search"


def test_llama405_plan_script_tiny(tmp_path):
    """scripts/llama405_plan.py on a tiny Llama (pp2 x dp2 x tp2): per schedule, the plans as the engine
    runs them (chunk and per-layer recompute, each without and with sequence parallelism) and
    per-block checkpointing on the sequence-parallel profile (torchtitan's, blocks only: the
    embedding and head not recomputed), and the 3-D search's choice."""
    out = tmp_path / "l405.json"
    proc = _run("scripts/llama405_plan.py", "--tiny", "--auto", "--limit", "none", "--json", str(out))
    got = json.loads(out.read_text())
    rows = got["rows"]
    assert [r["schedule"] for r in rows] == ["1F1B"] * 5 + ["Interleaved 1F1B"] * 5
    for k in (0, 5):
        chunk, layer, chunk_sp, layer_sp, block = rows[k:k + 5]
        assert layer["step_s"] == chunk["step_s"]   # both run each forward twice
        for whole, split in ((chunk, chunk_sp), (layer, layer_sp)):   # SP: less memory, no slower
            assert split["peak_gib"] < whole["peak_gib"] and split["step_s"] <= whole["step_s"]
        assert block["step_s"] <= layer_sp["step_s"]   # the embedding and head not recomputed
        assert "gathered_parameters" in chunk["breakdown_rank0"]
    assert got["auto"][0]["tokens_per_s_per_gpu"] > 0 and "schedule=auto under none chose dp" in proc.stdout
    assert got["auto"][0]["sequence_parallel"] in (True, False)


def _script(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mlp_search_check_reads_the_head_to_head_medians_and_judges_the_choice():
    """scripts/mlp_search_check.py's table from a bench result: the measured figure is the
    confirmation's median, the rank is by it, and both checks can fail."""
    mod = _script("mlp_search_check")
    sweep = [{"section": "sweep", "layout": name, "chosen": rank == 1, "search_rank": rank, "predicted_step_s": pred,
              "step_s": first, "plan_stage_ranges": [[0, 7], [7, 14]]}
             for rank, (name, pred, first) in enumerate([("zb-h2 m=4", 0.100, 0.300), ("1f1b m=4", 0.105, 0.100),
                                                         ("zb-h1 m=8", 0.110, 0.120)], start=1)]
    conf = {"layouts": [{"layout": "zb-h2 m=4", "step_s": 0.104, "step_s_rounds": [0.104]},
                        {"layout": "1f1b m=4", "step_s": 0.101, "step_s_rounds": [0.101]}]}
    result = {"rows": [{"section": "auto", "layout": "zb-h2 m=4"}, *sweep], "auto": {"confirmation": conf}}
    rows = mod.table_rows(result)
    assert [(x["layout"], x["measured_s"], x["measured_rank"]) for x in rows] == [
        ("zb-h2 m=4", 0.104, 2), ("1f1b m=4", 0.101, 1), ("zb-h1 m=8", 0.120, 3)]
    verdict = mod.check(rows)
    assert verdict["within_tolerance"] and not verdict["no_slower_than_best"]
    assert verdict["fastest"] == "1f1b m=4" and verdict["chosen_over_fastest"] == 0.104 / 0.101
    conf["layouts"][0]["step_s"] = 0.0995   # now the fastest, and still within 10%
    assert mod.check(mod.table_rows(result))["no_slower_than_best"]
    conf["layouts"][0]["step_s"] = 0.0899   # 10.1% under its prediction
    assert not mod.check(mod.table_rows(result))["within_tolerance"]
    assert "bench.sweep_max=5" in mod.overrides() and "model.depth=12" in mod.overrides()
    assert verdict["chosen_over_fastest_95"] is None   # no per-round steps: no interval


def test_mlp_search_check_ratio_interval_is_paired_over_rounds():
    """The paired bootstrap: constant steps give the exact ratio; two layouts whose rounds share a
    slow spell (round 2 is 30% slower for both) but differ by 5% within every round (1% spread)
    are told apart, though their step ranges overlap; equal layouts are not; unpaired rounds are
    left out, and none paired gives None."""
    mod = _script("mlp_search_check")
    assert mod.ratio_interval([[3.0, 3.0]], [[2.0], [5.0]]) == (1.5, 1.5, 1.5)
    assert mod.ratio_interval([None, [1.0]], [[1.0], None]) is None
    base = [[1.00, 1.01, 0.99, 1.00], [1.30, 1.31, 1.29, 1.30], [1.05, 1.04, 1.06, 1.05]]
    slower = [[x * 1.05 for x in r] for r in base]
    assert max(map(max, base)) > min(map(min, slower))
    ratio, lo, hi = mod.ratio_interval(slower, base)
    assert ratio == pytest.approx(1.05) and 1.0 < lo <= ratio <= hi
    ratio, lo, hi = mod.ratio_interval(base, [r[::-1] for r in base])
    assert ratio == 1.0 and lo <= 1.0 <= hi
    noisy = [[1.00, 1.10, 0.90, 1.05], [0.95, 1.08, 1.02, 0.97], [1.04, 0.93, 1.06, 1.00]]
    ratio, lo, hi = mod.ratio_interval([[x * 1.01 for x in r] for r in noisy], noisy[::-1])
    assert lo < 1.0 < hi   # 1% within 10% noise, rounds not aligned: not distinguishable


def test_mlp_search_check_states_both_verdicts():
    """check(): the strict verdict on the medians and the one at the measurement's resolution."""
    mod = _script("mlp_search_check")
    noisy = [[1.00, 1.10, 0.90, 1.05], [0.95, 1.08, 1.02, 0.97], [1.04, 0.93, 1.06, 1.00]]
    rows = [{"layout": "a", "chosen": True, "measured_s": 1.02, "predicted_s": 1.0, "error": 0.02,
             "measured_steps_by_round": [[x * 1.02 for x in r] for r in noisy]},
            {"layout": "b", "chosen": False, "measured_s": 1.0, "predicted_s": 1.0, "error": 0.0,
             "measured_steps_by_round": noisy}]
    v = mod.check(rows)
    assert not v["no_slower_than_best"] and v["not_distinguishable_from_best"]
    text = mod._verdict(v)
    assert "SLOWER than the fastest" in text and "not distinguishable from the fastest" in text
    rows[0]["measured_steps_by_round"] = [[x * 1.5 for x in r] for r in noisy]
    v = mod.check(rows)
    assert v["not_distinguishable_from_best"] is False and v["chosen_over_fastest_95"][0] > 1.0
    rows[0]["measured_s"] = 0.9   # the fastest: the interval is against the next one (b)
    v = mod.check(rows)
    assert v["no_slower_than_best"] and v["interval_against"] == "b" and "next fastest (b)" in mod._verdict(v)


def test_mlp_search_check_separates_the_machines_drift_from_the_plans_error():
    """drift(): the probe's after / before, and the error had the prediction moved by as much;
    the verdict itself (check) is not touched by it."""
    mod = _script("mlp_search_check")
    d = mod.drift(-0.24, 0.150, 0.114)   # the machine sped up 24% between the profile and the runs
    assert abs(d["drift"] + 0.24) < 1e-9 and abs(d["error_drift_scaled"]) < 1e-9
    assert mod.drift(None, 1.0, 1.0)["error_drift_scaled"] is None


def test_gen_bench_model_builds_the_generation_workload(tmp_path):
    """scripts/gen_bench_model.py (docs/performance.md, "Generation"): a Llama checkpoint that
    transformers loads, and 32 prompts of 16-32 in-vocabulary ids beside it (tiny sizes here)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("gen_bench_model", ROOT / "scripts" / "gen_bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.build(tmp_path / "m", layers=2, hidden=32, intermediate=64, heads=2, vocab=128)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and not model.config.tie_word_embeddings
    prompts = json.loads((out / "prompts.json").read_text())
    assert len(prompts) == 32 and all(16 <= len(p) <= 32 and max(p) < 128 for p in prompts)
