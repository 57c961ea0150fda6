"""Tracking: metrics.jsonl, an offline W&B run read back, disabled ranks, plots and progress bar."""

from __future__ import annotations


import pytest

from experiments.tracking import ProgressBar, Tracker, plan_rows, read_metrics
from wandb_offline import plot_loss, read_offline_run


@pytest.fixture(autouse=True)
def _quiet_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


class _Plan:  # the attributes of partitioner.Plan that the tracker reads
    stage_ranges = [(0, 3), (3, 6)]
    stage_time_s = [0.25, 0.5]
    stage_memory_bytes = [1000, 2000]
    step_s = 1.5
    bubble_fraction = 0.2


def _log_steps(tracker: Tracker, n: int = 3) -> None:
    for step in range(n):
        tracker.log_step(step, loss=5.0 - step, step_time_s=0.5, batch_size=16, tokens_per_sample=128,
                         ranks=[{"forward_s": 0.1, "idle_fraction": 0.3}, {"forward_s": 0.2 + step}],
                         lr=0.01 * (step + 1))


def test_metrics_jsonl_fields(tmp_path):
    with Tracker(tmp_path, config={"a": 1}, mode="disabled") as tracker:
        _log_steps(tracker)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    first = records[0]
    assert first["loss"] == 5.0 and first["step_time_s"] == 0.5
    assert first["samples_per_s"] == pytest.approx(32.0) and first["tokens_per_s"] == pytest.approx(32.0 * 128)
    assert records[2]["rank_forward_s"] == [0.1, 2.2]
    assert first["rank_idle_fraction"] == [0.3, None]  # a figure one rank did not report
    assert records[1]["lr"] == pytest.approx(0.02)
    assert not (tmp_path / "wandb").exists()  # disabled: no W&B files


def test_non_loss_rank_writes_nothing(tmp_path):
    with Tracker(tmp_path / "run", mode="offline", enabled=False) as tracker:
        record = tracker.log_step(0, loss=1.0, step_time_s=1.0, batch_size=2)
        tracker.summary({"x": 1})
    assert record["samples_per_s"] == 2.0
    assert not (tmp_path / "run").exists()


def test_offline_run_is_written_and_reads_back(tmp_path):
    config = {"pipeline": {"stages": 2, "schedule": "1f1b"}, "optimizer": {"lr": 0.003}}
    with Tracker(tmp_path, config=config, mode="offline", project="pipeshard-test", name="t") as tracker:
        _log_steps(tracker)
        tracker.log_plan(_Plan())
        tracker.summary({"final_loss": 3.0})
    run = read_offline_run(tmp_path)
    assert run.path.suffix == ".wandb" and str(run.path).startswith(str(tmp_path))
    assert run.config["pipeline"] == {"stages": 2, "schedule": "1f1b"}
    assert run.config["optimizer"]["lr"] == 0.003
    steps = [row for row in run.history if "loss" in row]
    assert [row["loss"] for row in steps] == [5.0, 4.0, 3.0]
    assert [row["_step"] for row in steps] == [0, 1, 2]
    assert steps[2]["rank/forward_s/1"] == pytest.approx(2.2)
    assert steps[0]["tokens_per_s"] == pytest.approx(4096.0)
    assert run.summary["final_loss"] == 3.0
    assert run.summary["plan/step_s"] == 1.5
    assert run.summary["plan/_type"] == "table-file"  # the plan went in as a W&B table
    # metrics.jsonl sits beside the W&B run in the same directory
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


def test_log_image_goes_to_the_run(tmp_path):
    png = plot_loss([{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.0, "eval_loss": 1.2}], tmp_path / "loss.png")
    assert png.stat().st_size > 1000
    with Tracker(tmp_path / "run", mode="offline") as tracker:
        tracker.log_image("timeline", png, caption="predicted vs measured")
    run = read_offline_run(tmp_path / "run")
    assert run.summary["timeline/_type"] == "image-file"


def test_plan_rows():
    rows = plan_rows(_Plan())
    assert rows[1] == {"stage": 1, "rank": 1, "start": 3, "stop": 6, "layers": 3, "time_s": 0.5,
                       "memory_bytes": 2000}


def test_bad_mode_says_the_choices(tmp_path):
    with pytest.raises(ValueError, match="offline, online or disabled"):
        Tracker(tmp_path, mode="cloud")


def test_progress_bar_runs(capsys):
    with ProgressBar(total=3) as bar:
        for step in range(1, 4):
            bar.update(step, loss=1.0 / step, tokens_per_s=1000.0)
    with ProgressBar(total=3, enabled=False) as off:
        off.update(1, loss=1.0)
