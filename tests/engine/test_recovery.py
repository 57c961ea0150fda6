"""Automatic restart: a rank killed mid-run, all ranks restarted, resumed from the newest
complete checkpoint; the result equals an uninterrupted run's exactly (SGD, fp32)."""

from __future__ import annotations

import pytest
import torch

from engine import launch

from _recovery import recovery_job

STEPS, EVERY = 8, 2


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("p, d, zero", [(2, 1, 0), pytest.param(2, 2, 1, marks=pytest.mark.long)],
                         ids=["2x1", "2x2-zero1"])
def test_rank_killed_at_step_5_restarts_and_equals_uninterrupted(tmp_path, monkeypatch, p, d, zero):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = (p, d, zero, STEPS, EVERY)
    full = launch(recovery_job, p * d, *args, str(tmp_path / "full"), backend="gloo", timeout_s=300)
    monkeypatch.setenv("PIPESHARD_FAULT", "step@5:rank=1")
    got = launch(recovery_job, p * d, *args, str(tmp_path / "killed"), backend="gloo",
                 timeout_s=300, max_restarts=1)
    # Rank 1 died before step 5 on the first start; the second start finished every step from
    # the newest complete checkpoint: step 4, or step 2 when step 4's async save was still in
    # flight (then step 4's directory is skipped as incomplete).
    start = got[0]["start"]
    assert all(r["attempt"] == 1 and r["start"] == start for r in got) and start in (2, 4)
    if start == 2:
        assert [name for name, _ in got[0]["skipped"]] == [".tmp_step_000004"]
    for mine, ref in zip(got, full):
        assert sorted(mine["losses"]) == list(range(start + 1, STEPS + 1))
        for s, loss in mine["losses"].items():
            assert loss == pytest.approx(ref["losses"][s], abs=1e-6, rel=0)
        assert mine["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            torch.testing.assert_close(mine["params"][k], v, rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
