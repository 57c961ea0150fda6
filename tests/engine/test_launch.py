"""The local launcher: results in rank order, fast failure with the root cause, no orphans."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from dist_helpers import WorkerError, run_workers


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
        assert "killed by SIGKILL (signal 9, exit code -9)" in str(err)
        assert "possibly out of memory" in str(err)
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


def test_job_timeout_reports_where_each_rank_is_stuck():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="timed out after 2 s") as info:
        run_workers(_sleep, 2, timeout_s=2)
    assert time.monotonic() - t0 < 15
    stacks = info.value.traceback_text          # from faulthandler in each hung worker
    assert "rank 0:" in stacks and "rank 1:" in stacks, stacks
    assert "_sleep" in stacks and "test_launch.py" in stacks, stacks


def _graceful(pid_dir):
    """Sleeps; on SIGTERM takes 1 s to 'save' (writes a marker) and exits."""
    import torch.distributed as dist
    rank = dist.get_rank()

    def on_term(signum, frame):
        time.sleep(1.0)
        open(os.path.join(pid_dir, f"saved_{rank}"), "w").write("ok")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(pid_dir, str(rank)), "w").write(str(os.getpid()))
    time.sleep(120)


_SCRIPT = """
from test_launch import _graceful
from engine import launch
if __name__ == "__main__":
    launch(_graceful, 2, {pid_dir!r})
"""


def _wait_gone(pids, within_s=5.0):
    deadline = time.monotonic() + within_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"worker pid {pid} still alive")


@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True),
                                        (signal.SIGKILL, False)],
                         ids=["SIGTERM", "ctrl-c", "SIGKILL"])
def test_signal_to_launcher_stops_workers(tmp_path, sig, group):
    """SIGTERM to the launcher, or Ctrl-C (SIGINT to the whole process group), reaches the
    workers as SIGTERM and they get their grace period (here they 'save' for 1 s, longer than
    the hard-kill grace); a killed launcher's workers leave too."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    script = tmp_path / "job.py"
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script.write_text(_SCRIPT.format(pid_dir=str(pid_dir)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), root]))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE,
                            start_new_session=True, env=env)
    deadline = time.monotonic() + 60
    pid_files = lambda: [f for f in pid_dir.iterdir() if f.name.isdigit()]  # noqa: E731
    while len(pid_files()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(pid_files()) == 2, "workers did not start"
    pids = [int(f.read_text()) for f in pid_files()]
    t0 = time.monotonic()
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    if sig != signal.SIGKILL:
        assert f"received signal {int(sig)} ({sig.name})".encode() in err, err[-2000:]
        assert sorted(f.name for f in pid_dir.iterdir() if f.name.startswith("saved")) == \
            ["saved_0", "saved_1"], "workers were not given their grace period"
        assert time.monotonic() - t0 < 20
    _wait_gone(pids)


def _big_result_or_torn_message():
    import struct
    import torch.distributed as dist
    if dist.get_rank() == 1:
        # Die in the middle of a message to the launcher: its length says 1 MB, 10 bytes came.
        conn = sys.modules["engine.launch"]._WORKER_QUEUE.conn
        os.write(conn.fileno(), struct.pack("!i", 10**6) + b"x" * 10)
        os._exit(5)
    time.sleep(120)


def _big_result():
    return b"x" * (4 * 2**20)       # far beyond a pipe's buffer


def test_large_results_and_torn_messages():
    assert [len(r) for r in run_workers(_big_result, 2)] == [4 * 2**20] * 2
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="exited with code 5") as info:
        run_workers(_big_result_or_torn_message, 2, timeout_s=60)
    assert info.value.rank == 1 and time.monotonic() - t0 < 20


def _die_until(last_failing_attempt, log_dir):
    """Rank 1 dies (SIGKILL) while the attempt number is <= last_failing_attempt."""
    import torch.distributed as dist
    from engine.cluster import restart_count
    rank, attempt = dist.get_rank(), restart_count()
    with open(os.path.join(log_dir, f"{attempt}_{rank}"), "w") as f:
        f.write(os.environ.get("PIPESHARD_LAST_FAILURE", ""))
    dist.barrier()
    if rank == 1 and attempt <= last_failing_attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return attempt


def test_restart_stops_and_starts_every_rank_with_the_attempt_number(tmp_path, capfd):
    from engine import launch
    out = launch(_die_until, 2, 1, str(tmp_path), max_restarts=2, timeout_s=120)
    assert out == [2, 2]                    # the third start (restart 2) finished
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0_0", "0_1", "1_0", "1_1", "2_0", "2_1"]
    assert (tmp_path / "0_0").read_text() == ""
    assert "rank 1 failed: the process was killed by SIGKILL" in (tmp_path / "2_0").read_text()
    err = capfd.readouterr().err
    assert "restarting all 2 ranks (restart 1 of 2)" in err and "(restart 2 of 2)" in err


def test_restarts_exhausted_raise_the_last_failure(tmp_path):
    from engine import launch
    with pytest.raises(WorkerError, match="rank 1 failed: the process was killed by SIGKILL"):
        launch(_die_until, 2, 5, str(tmp_path), max_restarts=1, timeout_s=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0_0", "0_1", "1_0", "1_1"]
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        launch(_die_until, 2, 0, str(tmp_path), max_restarts=-1)


def _parent_and_dynamo():
    return os.getppid(), "torch._dynamo" in sys.modules


def _forkservers() -> set[int]:
    """This process's children that run multiprocessing's fork server."""
    found = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        for pid in open(f"/proc/{os.getpid()}/task/{task}/children").read().split():
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except FileNotFoundError:
                continue
            if b"multiprocessing.forkserver" in cmd:
                found.add(int(pid))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_prestart_starts_the_fork_server_that_launch_forks_from_with_torch_imported():
    """`prestart` starts the server once (planning runs beside its import); the workers are its
    children and find torch._dynamo imported (an optimizer's constructor would import it), while
    a spawned worker starts without it."""
    from engine.launch import launch, prestart

    prestart(start_method="forkserver")
    servers = _forkservers()
    assert len(servers) == 1
    prestart(start_method="forkserver")
    assert _forkservers() == servers
    out = launch(_parent_and_dynamo, 2, start_method="forkserver")
    assert out == [(next(iter(servers)), True)] * 2
    assert launch(_parent_and_dynamo, 1, start_method="spawn")[0][1] is False
