"""Run-time failures end the whole job fast, name the rank, its stage and the cause, and leave no
worker behind; non-finite values are handled as configured on every stage consistently.

Each job is a 3-stage pipeline (6 tiny layers, 3 microbatches) on gloo; one rank fails mid-step
while its peers are blocked on receives from it (with a 300 s point-to-point timeout, so only
the launcher can end them in time).
"""
from __future__ import annotations

import functools
import os
import signal
import time

import pytest

from dist_helpers import WorkerError, run_workers

STAGES, LAYERS, MICRO, DIM = 3, 6, 3, 8
RANGES = [(0, 2), (2, 4), (4, 6)]
FAIL_LAYER = 3          # on stage 1 of 3
FAIL_STEP = 1           # 0-based training step
LIMIT_S = 60.0


_STEP = [0]  # the training step the worker runs (set by _train), read by the failing layer


def _make(i: int, fail: str | None, fail_step: int, fail_layer: int = FAIL_LAYER):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)
            self.step, self.calls = -1, 0

        def forward(self, x):
            y = torch.tanh(self.lin(x))
            if fail is not None and i == fail_layer and self.training:
                if self.step != _STEP[0]:
                    self.step, self.calls = _STEP[0], 0
                # a replay of the step's forward fails the same way, except with "nan-once"
                mb, replay = self.calls % MICRO, self.calls >= MICRO
                self.calls += 1
                if self.step == fail_step and mb == 1 and not (replay and fail == "nan-once"):
                    _inject(fail, y)   # mid-step: microbatch 1 of the step
                    if fail.startswith("nan"):
                        y = y * float("nan")
            return y

    return Block()


def _inject(fail: str, y) -> None:
    if fail == "exit":
        os._exit(7)
    if fail == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fail == "raise":
        raise RuntimeError("injected failure in layer 3")
    if fail == "oom":
        raise MemoryError("injected: cannot allocate 64 GiB")
    if fail == "hang":
        time.sleep(1000)


def _params(pipe) -> dict:
    return {(i, n): p.detach().clone() for i, ps in pipe.named_layer_parameters().items()
            for n, p in ps.items()}


def _train(pid_dir: str, fail: str | None, steps: int, kw: dict):
    import torch
    import torch.distributed as dist
    from engine import OptimizerConfig, Pipeline
    open(os.path.join(pid_dir, str(dist.get_rank())), "w").write(str(os.getpid()))
    step, layer = kw.pop("fail_step", FAIL_STEP), kw.pop("fail_layer", FAIL_LAYER)
    layers = [functools.partial(_make, i, fail, step, layer) for i in range(LAYERS)]
    pipe = Pipeline(layers, RANGES, loss_fn=torch.nn.functional.mse_loss, microbatches=MICRO,
                    optimizer=OptimizerConfig(name="sgd", lr=0.05), **kw)
    g = torch.Generator().manual_seed(0)
    history = []
    for step in range(steps):
        x = torch.randn(2 * MICRO, DIM, generator=g)
        y = torch.randn(2 * MICRO, DIM, generator=g) * 0.1
        before = _params(pipe)
        _STEP[0] = step
        r = pipe.train_step(x, y)
        after = _params(pipe)
        same = all(torch.equal(before[k], after[k]) for k in before)
        history.append((r.skipped, r.loss, same, r.stats.get("nonfinite_stage")))
    return history


# ---- no orphans: every process the job started is gone ------------------------------------
def _descendants(root: int) -> set[int]:
    try:
        import psutil
        return {c.pid for c in psutil.Process(root).children(recursive=True)}
    except ImportError:
        pass
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_no_orphans(pid_dir, before: set[int]) -> None:
    pids = [int(f.read_text()) for f in pid_dir.iterdir()]
    assert pids, "no worker wrote its pid"
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "worker processes survived the job"
    # Other new descendants may only be multiprocessing's long-lived helpers (fork server,
    # resource tracker), started once per test process, never a worker.
    for pid in _descendants(os.getpid()) - before:
        if not _alive(pid):
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        assert "forkserver" in cmd or "resource_tracker" in cmd, f"stray process {pid}: {cmd!r}"


def _run_failing(tmp_path, fail: str, **kw):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    before = _descendants(os.getpid())
    kw.setdefault("comm_timeout_s", 300.0)   # peers would wait 5 min: the launcher must act
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_workers(_train, STAGES, str(pid_dir), fail, 4, kw, timeout_s=120, pg_timeout_s=300)
    elapsed = time.monotonic() - t0
    _assert_no_orphans(pid_dir, before)
    return info.value, elapsed


@pytest.mark.parametrize("fail, cause", [
    ("exit", "exited with code 7"),
    ("sigkill", "killed by SIGKILL"),
    ("raise", "RuntimeError: injected failure in layer 3"),
    ("oom", "MemoryError: injected"),
])
def test_dead_or_failing_rank_ends_job_fast(tmp_path, fail, cause):
    err, elapsed = _run_failing(tmp_path, fail)
    assert elapsed < LIMIT_S, f"took {elapsed:.1f} s"
    assert err.rank == 1 and err.stage == 1, str(err)
    assert str(err).startswith("rank 1 (stage 1, replica 0) failed"), str(err)
    assert cause in str(err), str(err)
    if fail == "sigkill":
        assert "out of memory" in str(err) and err.exitcode == -9
    if fail == "oom":
        assert "smaller microbatch" in str(err)      # the remedy
    if fail == "raise":
        assert "_inject" in err.traceback_text       # the worker's own traceback


def test_hung_rank_is_found_by_peers_comm_timeout(tmp_path):
    # Rank 1 hangs (alive, silent) mid-step: its peers' receives time out after comm_timeout_s
    # (or their sends, waited before the next compute on gloo) and the error names the rank they
    # were waiting for.
    err, elapsed = _run_failing(tmp_path, "hang", comm_timeout_s=3.0)
    assert elapsed < LIMIT_S
    assert err.rank in (0, 2) and "CommError" in str(err), str(err)
    assert "timed out after 3 s" in str(err), str(err)
    assert "from rank 1" in str(err) or "to rank 1" in str(err), str(err)


def _collective_hang():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(1000)
    dist.all_reduce(torch.ones(1))


def test_collective_uses_process_group_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_workers(_collective_hang, 2, timeout_s=120, pg_timeout_s=3)
    assert time.monotonic() - t0 < LIMIT_S
    assert info.value.rank == 0, str(info.value)
    assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower()


def test_nan_on_middle_stage_raises_with_step_and_stage(tmp_path):
    err, elapsed = _run_failing(tmp_path, "nan", nonfinite="raise")
    assert "NonFiniteError" in str(err), str(err)
    assert f"at step {FAIL_STEP} on pipeline stage 1 " in str(err), str(err)
    assert "nonfinite='skip'" in str(err)                 # the remedy


@pytest.mark.parametrize("kw", [{"nonfinite": "skip"},
                                {"precision": "fp16-autocast", "nonfinite": "raise"}],
                         ids=["skip", "fp16"])
def test_nan_on_middle_stage_skips_step_on_every_rank(kw):
    out = run_workers(_train, STAGES, _tmp_pids(), "nan", 4, dict(kw), timeout_s=120)
    for rank, hist in enumerate(out):
        skipped, loss, same, stage = hist[FAIL_STEP]
        assert skipped and same, f"rank {rank} step {FAIL_STEP}: {hist[FAIL_STEP]}"
        assert stage == 1 and loss != loss                 # reported stage, NaN loss
        assert [h[0] for h in hist] == [h[0] for h in out[0]]   # same decisions everywhere
        later = hist[FAIL_STEP + 1:]
        assert any(not s and not same_ for s, _, same_, _ in later), \
            f"rank {rank}: no step after the NaN changed the parameters: {hist}"
        assert all(lo == lo for _, lo, _, _ in later)      # finite again


def _tmp_pids() -> str:
    import tempfile
    return tempfile.mkdtemp(prefix="pipeshard-pids-")


@pytest.mark.parametrize("diagnose_every,stage", [(1, 1), (100, 2)], ids=["checked", "unchecked"])
def test_the_stage_is_named_by_the_check_or_by_a_replay(diagnose_every, stage):
    # A NaN that a replay of the step's forward does not reproduce: a checked (diagnostic)
    # step names its stage from the verdict; an unchecked one can only name the loss's.
    out = run_workers(_train, STAGES, _tmp_pids(), "nan-once", 3,
                      {"nonfinite": "skip", "diagnose_every": diagnose_every}, timeout_s=120)
    for rank, hist in enumerate(out):
        skipped, loss, same, named = hist[FAIL_STEP]
        assert skipped and same and named == stage and loss != loss, f"rank {rank}: {hist}"


def test_nan_on_last_stage_is_named_from_the_loss():
    # The last chunk's output is the loss: its flag comes from the step's loss, not a reduction.
    out = run_workers(_train, STAGES, _tmp_pids(), "nan", 3, {"nonfinite": "skip", "fail_layer": 5},
                      timeout_s=120)
    for rank, hist in enumerate(out):
        skipped, loss, same, stage = hist[FAIL_STEP]
        assert skipped and same and stage == 2 and loss != loss, f"rank {rank}: {hist}"
        assert all(h[3] is None and not h[0] for k, h in enumerate(hist) if k != FAIL_STEP), hist
