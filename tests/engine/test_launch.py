"""The local launcher: results in rank order, fast failure with the root cause, no orphans."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_helpers import WorkerError, run_workers  # noqa: E402


def _rank_times(k):
    import torch.distributed as dist
    return (dist.get_rank(), dist.get_world_size(), k * dist.get_rank(),
            os.environ["OMP_NUM_THREADS"])


def _fail_on_one(pid_dir, mode):
    import torch
    import torch.distributed as dist
    from engine.launch import set_worker_info
    rank = dist.get_rank()
    open(os.path.join(pid_dir, str(rank)), "w").write(str(os.getpid()))
    set_worker_info(stage=rank + 10)
    if rank == 1:
        time.sleep(0.5)
        if mode == "raise":
            raise ValueError("boom from the test worker")
        os.kill(os.getpid(), signal.SIGKILL)
    # rank 0 blocks on a receive that never comes (its peer fails)
    t = torch.empty(3)
    dist.recv(t, src=1)
    time.sleep(120)


def _sleep():
    time.sleep(120)


def test_results_in_rank_order():
    out = run_workers(_rank_times, 3, 5)
    assert [o[:3] for o in out] == [(0, 3, 0), (1, 3, 5), (2, 3, 10)]
    assert all(o[3] == "1" for o in out)


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failure_names_rank_stage_and_cause_and_stops_others(tmp_path, mode):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_workers(_fail_on_one, 2, str(tmp_path), mode, timeout_s=60)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 1 and err.stage == 11, str(err)
    if mode == "raise":
        assert "ValueError: boom from the test worker" in str(err)
        assert "_fail_on_one" in err.traceback_text      # the worker's own traceback
    else:
        assert "signal 9" in str(err)
    assert elapsed < 30, f"took {elapsed:.1f}s to notice the failure"
    for f in tmp_path.iterdir():       # no orphans: every worker is gone
        pid = int(f.read_text())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"worker pid {pid} still alive")


def test_job_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="timed out after 2 s"):
        run_workers(_sleep, 2, timeout_s=2)
    assert time.monotonic() - t0 < 15


def _sleep_with_pid(pid_dir):
    import torch.distributed as dist
    open(os.path.join(pid_dir, str(dist.get_rank())), "w").write(str(os.getpid()))
    time.sleep(120)


_SCRIPT = """
import sys
sys.path[:0] = {paths!r}
from test_launch import _sleep_with_pid
from engine import launch
if __name__ == "__main__":
    launch(_sleep_with_pid, 2, {pid_dir!r})
"""


def test_sigterm_to_launcher_stops_workers(tmp_path):
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    script = tmp_path / "job.py"
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script.write_text(_SCRIPT.format(paths=[here, root], pid_dir=str(pid_dir)))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(list(pid_dir.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(pid_dir.iterdir())) == 2, "workers did not start"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and b"received signal 15" in err
    for f in pid_dir.iterdir():
        pid = int(f.read_text())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"worker pid {pid} still alive")
