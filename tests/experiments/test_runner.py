"""The worker's stop signals and the entry point's signal windows.

`engine.launch` owns SIGINT / SIGTERM in the launching process while workers run, and makes its
workers ignore SIGINT (Ctrl-C reaches the whole process group; the launcher turns it into one
SIGTERM per worker). So `experiments.train.run` must not install handlers of its own around
the launch, and a worker's `StopFlag` must leave an ignored SIGINT ignored.
"""

from __future__ import annotations

import os
import signal
import time

import engine
from experiments import train
from experiments.job import Job
from experiments.runner import StopFlag, checkpoint_meta, memory_warning


def _wait_for(flag: StopFlag) -> None:
    deadline = time.monotonic() + 5
    while flag.signum is None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_stop_flag_leaves_an_ignored_sigint_ignored():
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)   # as engine.launch sets it in a worker
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        flag = StopFlag()
        flag.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)                  # ignored: nothing happens
        time.sleep(0.05)
        assert flag.signum is None
        os.kill(os.getpid(), signal.SIGTERM)                 # the launcher's forwarded stop
        _wait_for(flag)
        assert flag.signum == signal.SIGTERM
        flag.restore()
        assert signal.getsignal(signal.SIGTERM) is old_term
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def test_stop_flag_catches_sigint_where_the_process_handles_it():
    # handled, whatever this test process inherited (a background shell job starts with SIGINT ignored)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    flag = StopFlag()
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)                 # e.g. a torchrun worker
        _wait_for(flag)
        assert flag.signum == signal.SIGINT
    finally:
        flag.restore()
        restored = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, outer)
    assert restored is signal.default_int_handler


def test_train_run_leaves_the_signals_to_launch(monkeypatch, tmp_path, compose_cfg):
    """No handler of train's own around engine.launch: Ctrl-C before, during or after the
    launch is never turned into a SIGTERM that would kill the launcher without its cleanup."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen = {}

    def fake_launch(fn, nprocs, job, timeout_s=None, max_restarts=0):
        seen.update({s: signal.getsignal(s) for s in before}, nprocs=nprocs, job=job, restarts=max_restarts)
        return [{"rank": 0}, {"rank": 1, "start_step": 0, "end_step": 5, "first_loss": None}]

    job = Job(config={}, plan=None, run_dir=str(tmp_path), checkpoint_root=str(tmp_path / "checkpoints"))
    monkeypatch.setattr(engine, "launch", fake_launch)
    monkeypatch.setattr(train, "prepare_job", lambda cfg, run_dir: job)
    summary = train.run(compose_cfg("experiment=smoke"), tmp_path)
    assert seen["nprocs"] == 2 and seen["job"] is job and summary["rank"] == 1 and seen["restarts"] == 0
    assert {s: seen[s] for s in before} == before
    assert {s: signal.getsignal(s) for s in before} == before


def test_checkpoint_meta_records_the_layout():
    cfg = {"pipeline": {"stages": 2, "schedule": "1f1b", "microbatches": 4, "virtual_stages": 1,
                        "data_parallel": 1, "nonfinite": "raise"},
           "model": {"name": "gpt"}, "train": {"seed": 3}}
    meta = checkpoint_meta(6, {"steps": 6}, cfg, [(0, 2), (2, 4)])
    assert meta["step"] == meta["data_position"] == 6
    assert meta["stage_ranges"] == [[0, 2], [2, 4]] and meta["seed"] == 3
    assert "nonfinite" not in meta["pipeline"]


def test_memory_warning_compares_what_the_plan_models():
    """The plan models the pipeline's memory; tensors alive before the step that are not model
    state ("other": the data a rank keeps) are left out of the comparison and named."""
    mib = 2**20
    mem = {"peak_bytes": 30 * mib, "breakdown": {"parameters": 2 * mib, "activations": 20 * mib,
                                                  "other": 8 * mib}}
    assert memory_warning(1, 0, mem, 21 * mib) is None                 # 22 MiB modelled: +4.8%
    text = memory_warning(2, 1, mem, 19 * mib)                         # +15.8%
    assert text.startswith("warning: step 2, pipeline rank 1:") and "16% above" in text
    assert "22.0 MiB without the 8.0 MiB" in text
    no_other = {"peak_bytes": 30 * mib, "breakdown": {"activations": 30 * mib}}
    assert "above" in memory_warning(1, 0, no_other, 21 * mib)          # nothing to leave out
    assert memory_warning(1, 0, mem, None) is None                     # no prediction
