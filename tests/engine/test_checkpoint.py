"""engine.checkpoint: layer-keyed, atomic, verified, re-splittable checkpoints."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.checkpoint import (CheckpointError, capture_rng, latest_checkpoint, list_checkpoints,
                               load_checkpoint, merge_optimizer_state, restore_rng, save_checkpoint,
                               split_optimizer_state)

ROOT = Path(__file__).resolve().parents[2]
N = 6


def make_layers(n: int = N, width: int = 4, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    out = {}
    for i in range(n):
        mod = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
        out[i] = {k: v.detach().clone() for k, v in mod.state_dict().items()}
    return out


def make_optim(layers: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    return {i: {name: {"exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
                for name, t in params.items()} for i, params in layers.items()}


def run_ranks(world: int, fn) -> list:
    """Run fn(rank, barrier) on `world` threads with a shared barrier (ranks of one job)."""
    bar = threading.Barrier(world, timeout=60)
    results: list = [None] * world
    errors: list = []

    def target(r: int) -> None:
        try:
            results[r] = fn(r, bar.wait)
        except BaseException as exc:  # noqa: BLE001
            errors.append((r, exc))
            bar.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0][1]
    return results


def assert_nested_equal(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_nested_equal(a[k], b[k])
        else:
            assert a[k].dtype == b[k].dtype
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_round_trip_single_rank(tmp_path):
    layers = make_layers()
    optim = make_optim(layers)
    meta = {"step": 7, "schedule": "1f1b", "data_position": 56, "optimizer": {"steps": 7}}
    path = save_checkpoint(tmp_path, 7, layers=layers, optimizer=optim, meta=meta, num_layers=N)
    assert path == tmp_path / "step_000007"
    assert latest_checkpoint(tmp_path) == path
    assert (tmp_path / "latest").read_text() == "step_000007"
    ck = load_checkpoint(path, range(N), expected=layers, num_layers=N, rank=0, world=1)
    assert ck.step == 7 and ck.meta == meta
    assert_nested_equal(ck.layers, layers)
    assert_nested_equal(ck.optimizer, optim)
    assert ck.rng is not None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")], "no debris left"


def test_rng_states_round_trip(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    state = capture_rng()
    first = (torch.rand(3), random.random(), np.random.rand())
    save_checkpoint(tmp_path, 1, layers=make_layers(1), num_layers=1, rng=state)
    torch.rand(5), random.random(), np.random.rand()  # move every generator on
    ck = load_checkpoint(latest_checkpoint(tmp_path), [0], rank=0)
    restore_rng(ck.rng)
    again = (torch.rand(3), random.random(), np.random.rand())
    torch.testing.assert_close(first[0], again[0])
    assert first[1:] == again[1:]


def test_resplit_two_ranks_to_three_with_replicas(tmp_path):
    layers, full_optim = make_layers(), None
    full_optim = make_optim(layers)
    # world 4 = 2 stages x 2 replicas: stage 0 holds layers 0-2, stage 1 holds 3-5; the second
    # replica passes nothing (its copies are identical).
    owned = {0: [0, 1, 2], 1: [3, 4, 5], 2: [], 3: []}

    def writer(rank, barrier):
        mine = {i: layers[i] for i in owned[rank]}
        return save_checkpoint(tmp_path, 10, layers=mine, optimizer={i: full_optim[i] for i in mine},
                               meta={"step": 10}, rank=rank, world=4, num_layers=N, barrier=barrier)

    paths = run_ranks(4, writer)
    assert len(set(paths)) == 1
    for subset in ([0, 1], [2, 3], [4, 5]):  # three stages now
        ck = load_checkpoint(paths[0], subset, expected={i: layers[i] for i in subset}, num_layers=N)
        assert sorted(ck.layers) == subset
        assert_nested_equal(ck.layers, {i: layers[i] for i in subset})
        assert_nested_equal(ck.optimizer, {i: full_optim[i] for i in subset})
        assert ck.rng is None  # RNG states are per rank of the writing job


def test_rank_without_its_layers_is_an_error_that_does_not_hang(tmp_path):
    layers = make_layers()

    def writer(rank, barrier):
        mine = {i: layers[i] for i in ([0, 1] if rank == 0 else [2, 3])}  # 4, 5 never given
        return save_checkpoint(tmp_path, 1, layers=mine, rank=rank, world=2, num_layers=N,
                               barrier=barrier)

    with pytest.raises(CheckpointError, match=r"no rank saved layers \[4, 5\]|failed to finalise"):
        run_ranks(2, writer)
    assert latest_checkpoint(tmp_path) is None


def test_optimizer_state_split_merge_round_trip():
    sd = {"state": {"0.weight": {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)},
                    "12.bias": {"momentum_buffer": torch.zeros(3)}},
          "steps": 3, "loss_scale": 1.0}
    per_layer, scalars = split_optimizer_state(sd)
    assert sorted(per_layer) == [0, 12] and scalars == {"steps": 3, "loss_scale": 1.0}
    back = merge_optimizer_state(per_layer, scalars)
    assert back.keys() == sd.keys() and back["steps"] == 3
    assert_nested_equal(back["state"], sd["state"])
    with pytest.raises(ValueError, match="not '<layer index>.<param name>'"):
        split_optimizer_state({"state": {"weight": {}}})


def test_model_mismatch_is_named(tmp_path):
    layers = make_layers(12)
    path = save_checkpoint(tmp_path, 1, layers=layers, num_layers=12)
    with pytest.raises(CheckpointError, match="checkpoint is for a model with 12 layers, this model has 10"):
        load_checkpoint(path, range(10), num_layers=10)
    other = make_layers(12, width=5)
    with pytest.raises(CheckpointError, match=r"layer 0: '0.weight' has shape \(4, 4\) in the checkpoint, \(5, 5\)"):
        load_checkpoint(path, [0, 1], expected=other, num_layers=12)
    half = {0: {k: v.half() for k, v in layers[0].items()}}
    with pytest.raises(CheckpointError, match="layer 0: '0.bias' is torch.float32 in the checkpoint, torch.float16"):
        load_checkpoint(path, [0], expected=half)
    renamed = {0: {"weight": layers[0]["0.weight"]}}
    with pytest.raises(CheckpointError, match="layer 0: this model has 'weight', the checkpoint does not"):
        load_checkpoint(path, [0], expected=renamed)
    with pytest.raises(CheckpointError, match=r"has no layers \[12\]"):
        load_checkpoint(path, [11, 12])


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('PIPESHARD_EVIL_MARK', '/nonexistent/x')}",))


def test_loading_never_executes_code(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path, 1, layers=make_layers(2), num_layers=2)
    mark = tmp_path / "pwned"
    monkeypatch.setenv("PIPESHARD_EVIL_MARK", str(mark))
    target = path / "rank_00000.pt"
    with open(target, "wb") as f:
        pickle.dump({"layers": _Evil()}, f)
    # A forged file is caught by the checksum; with checksums off, by weights_only loading.
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path, [0])
    torch.save({"layers": _Evil()}, target)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint(path, [0], verify_checksums=False)
    assert not mark.exists()


def test_keep_last_and_resave(tmp_path):
    layers = make_layers(2)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, layers=layers, num_layers=2, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    changed = {i: {k: v + 1 for k, v in p.items()} for i, p in layers.items()}
    save_checkpoint(tmp_path, 4, layers=changed, num_layers=2, keep_last=2)
    ck = load_checkpoint(latest_checkpoint(tmp_path), [0, 1])
    assert_nested_equal(ck.layers, changed)
    # a dangling pointer falls back to the newest complete checkpoint
    (tmp_path / "latest").write_text("step_000099")
    assert latest_checkpoint(tmp_path).name == "step_000004"


WRITER = textwrap.dedent("""
    import os, sys, time
    import torch
    import engine.checkpoint as ck
    root, kill_at = sys.argv[1], int(sys.argv[2])
    layers = {{i: {{"w": torch.full((64, 64), float(i))}} for i in range(4)}}
    ck.save_checkpoint(root, 1, layers=layers, num_layers=4)
    calls = []
    def hook(path):
        calls.append(path.name)
        if len(calls) == kill_at:
            with open(os.path.join(root, "..", "signal"), "w") as f:
                f.write(path.name)
            time.sleep(120)
    ck._after_file_hook = hook
    ck.save_checkpoint(root, 2, layers={{i: {{"w": t["w"] + 100}} for i, t in layers.items()}},
                       num_layers=4)
""")


@pytest.mark.parametrize("kill_at, after", [(1, "rank_00000.pt"), (3, "manifest.json")])
def test_writer_killed_mid_checkpoint_leaves_previous_loadable(tmp_path, kill_at, after):
    root = tmp_path / "ckpt"
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format())  # (the template escapes its braces)
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(kill_at)],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    signal_file = tmp_path / "signal"
    deadline = time.time() + 120
    while not signal_file.exists():
        assert proc.poll() is None, "the writer exited before reaching the kill point"
        assert time.time() < deadline, "the writer never reached the kill point"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert signal_file.read_text() == after
    latest = latest_checkpoint(root)
    assert latest is not None and latest.name == "step_000001"
    ck = load_checkpoint(latest, range(4), num_layers=4)
    for i in range(4):
        torch.testing.assert_close(ck.layers[i]["w"], torch.full((64, 64), float(i)))
    if after != "manifest.json":  # the uncommitted directory is unusable, and never listed
        with pytest.raises(CheckpointError, match="not a complete checkpoint"):
            load_checkpoint(root / ".tmp_step_000002", [0])
    assert [p.name for p in list_checkpoints(root)] == ["step_000001"]
    # the next save cleans the debris and succeeds
    save_checkpoint(root, 2, layers={i: {"w": torch.zeros(1)} for i in range(4)}, num_layers=4)
    assert latest_checkpoint(root).name == "step_000002"
    assert not (root / ".tmp_step_000002").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("zero_before, zero_after, precision", [(1, 1, "fp32"), (2, 0, "fp32"),
                                                                  (1, 2, "bf16")])
def test_zero_run_resumes_resplit_and_equals_uninterrupted(tmp_path, zero_before, zero_after,
                                                           precision):
    """2 stages x 2 replicas with ZeRO, checkpoint after 2 steps, resume as 3 stages x 1 replica
    (and with another backend): the third step equals the uninterrupted run's. With bf16 weights
    the checkpoint holds the fp32 masters, which the resumed run continues from (compared as
    masters; the microbatch size stays 2, so every 16-bit gradient is the same)."""
    from _zero_harness import runtime_resume_job
    from dist_helpers import run_workers

    kw = dict(timeout_s=300)
    full = run_workers(runtime_resume_job, 4, 2, 2, zero_before, 3, None, None, "1f1b", 1,
                       precision, **kw)
    run_workers(runtime_resume_job, 4, 2, 2, zero_before, 2, str(tmp_path), None, "1f1b", 1,
                precision, **kw)
    resumed = run_workers(runtime_resume_job, 3, 3, 1, zero_after, 1, None, str(tmp_path), "1f1b",
                          1, precision, 2 if precision == "fp32" else 4, **kw)
    want = {k: v for _, params in full for k, v in params.items()}
    got = {k: v for _, params in resumed for k, v in params.items()}
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert resumed[-1][0] == pytest.approx(full[-1][0][-1:], rel=1e-5)


@pytest.mark.slow
def test_resume_into_zbv_and_zb_h2_with_another_split(tmp_path):
    """A 1F1B run (2 stages) checkpointed after 2 steps resumes as zbv (a V of 4 chunks on 2
    ranks, rank 0 holding the first and last) and as zb-h2 on 3 stages: the third step's loss
    and the parameters after it equal the uninterrupted run's."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_helpers import run_workers
    from _zero_harness import runtime_resume_job

    full = run_workers(runtime_resume_job, 2, 2, 1, 0, 3, None, None, timeout_s=120)
    run_workers(runtime_resume_job, 2, 2, 1, 0, 2, str(tmp_path), None, timeout_s=120)
    want = {k: v for _, params in full for k, v in params.items()}
    for world, schedule, virtual in ((2, "zbv", 2), (3, "zb-h2", 1)):
        resumed = run_workers(runtime_resume_job, world, world, 1, 0, 1, None, str(tmp_path),
                              schedule, virtual, timeout_s=120)
        got = {k: v for _, params in resumed for k, v in params.items()}
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{schedule} {k}: {m}")
        for losses, _ in resumed:
            assert losses == pytest.approx(full[-1][0][-1:], rel=1e-5)
