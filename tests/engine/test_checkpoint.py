"""engine.checkpoint: layer-keyed, atomic, verified, re-splittable checkpoints on DCP."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.checkpoint import (CheckpointError, Checkpointer, capture_rng, checkpoint_problem,
                               find_resumable, latest_checkpoint, list_checkpoints, load_checkpoint,
                               merge_optimizer_state, restore_rng, save_checkpoint,
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
    layers[2] = {}  # a parameter-free layer is still "given"
    optim = make_optim(layers)
    meta = {"step": 7, "schedule": "1f1b", "data_position": 56, "optimizer": {"steps": 7}}
    path = save_checkpoint(tmp_path, 7, layers=layers, optimizer=optim, meta=meta, num_layers=N)
    assert path == tmp_path / "step_000007"
    assert latest_checkpoint(tmp_path) == path
    assert (tmp_path / "latest").read_text() == "step_000007"
    assert {".metadata", "manifest.json"} <= {p.name for p in path.iterdir()}  # DCP + manifest
    ck = load_checkpoint(path, range(N), expected=layers, num_layers=N, rank=0, world=1)
    assert ck.step == 7 and ck.meta == meta
    assert_nested_equal(ck.layers, layers)
    assert_nested_equal(ck.optimizer, {i: v for i, v in optim.items() if v})
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


def test_async_save_writes_the_state_at_save_time(tmp_path):
    saver = Checkpointer(tmp_path, num_layers=2, async_save=True, keep_last=1)
    w = torch.zeros(256, 256)
    stall = saver.save(3, layers={0: {"w": w}, 1: {"b": torch.ones(2)}}, meta={"step": 3})
    w.add_(1.0)  # the step loop goes on and changes the weights while the save is in flight
    done = saver.close()
    assert [d.step for d in done] == [3] and done[0].asynchronous
    assert stall <= done[0].total_s and done[0].bytes > 256 * 256 * 4
    ck = load_checkpoint(latest_checkpoint(tmp_path), [0, 1])
    assert torch.count_nonzero(ck.layers[0]["w"]) == 0


def _writer_job(root: str) -> dict:
    """4 ranks = 2 stages x 2 replicas. Stage 0 holds layers 0-2, stage 1 holds 3-5; replica 1
    of stage 0 passes nothing, replica 1 of stage 1 passes its (identical) copy."""
    import torch.distributed as dist

    rank = dist.get_rank()
    layers, optim = make_layers(), None
    optim = make_optim(layers)
    owned = {0: [0, 1, 2], 1: [3, 4, 5], 2: [], 3: [3, 4, 5]}[rank]
    mine = {i: layers[i] for i in owned}
    path = save_checkpoint(root, 10, layers=mine, optimizer={i: optim[i] for i in mine},
                           meta={"step": 10}, num_layers=N)
    saver = Checkpointer(root, num_layers=N, async_save=True)
    changed = {i: {k: v + 1 for k, v in p.items()} for i, p in mine.items()}
    saver.save(12, layers=changed, meta={"step": 12})
    for p in changed.values():  # in-place change while the async save is in flight
        for v in p.values():
            v.mul_(0)
    done = saver.close()
    try:  # layers 4 and 5 never given: an error on every rank, no hang
        save_checkpoint(root, 14, layers={i: layers[i] for i in owned if i < 4}, num_layers=N)
        missing = "no error"
    except CheckpointError as exc:
        missing = str(exc)
    return {"path": str(path), "async": [str(d.path) for d in done], "missing": missing}


@pytest.mark.slow
def test_four_ranks_write_in_parallel_and_any_split_loads(tmp_path):
    from dist_helpers import run_workers

    out = run_workers(_writer_job, 4, str(tmp_path), timeout_s=180)
    layers, optim = make_layers(), None
    optim = make_optim(layers)
    path = Path(out[0]["path"])
    assert {o["path"] for o in out} == {str(path)} and {o["async"][0] for o in out} == {str(tmp_path / "step_000012")}
    assert sorted(p.name for p in path.glob("__*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    for subset in ([0, 1], [2, 3], [4, 5]):  # three stages now
        ck = load_checkpoint(path, subset, expected={i: layers[i] for i in subset}, num_layers=N)
        assert sorted(ck.layers) == subset
        assert_nested_equal(ck.layers, {i: layers[i] for i in subset})
        assert_nested_equal(ck.optimizer, {i: optim[i] for i in subset})
        assert ck.rng is None  # RNG states are per rank of the writing job
    assert load_checkpoint(path, [1], rank=2, world=4).rng is not None
    assert load_checkpoint(path, [1], rank=2, world=3).rng is None
    ck = load_checkpoint(tmp_path / "step_000012", range(N))
    assert_nested_equal(ck.layers, {i: {k: v + 1 for k, v in p.items()} for i, p in layers.items()})
    for o in out:
        assert "no rank saved layers [4, 5]" in o["missing"]
    assert not (tmp_path / "step_000014").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000012"


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
    with pytest.raises(ValueError, match="not a tensor"):
        save_checkpoint(tmp_path, 2, layers={0: {"w": 3}}, num_layers=1)


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('PIPESHARD_EVIL_MARK', '/nonexistent/x')}",))


def test_loading_never_executes_code(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path, 1, layers=make_layers(2), num_layers=2)
    mark = tmp_path / "pwned"
    monkeypatch.setenv("PIPESHARD_EVIL_MARK", str(mark))
    # DCP's index is a pickle: a forged one is caught by the checksum, and with checksums off
    # by the restricted unpickler (DCP's own reader would run it).
    with open(path / ".metadata", "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path, [0])
    with pytest.raises(CheckpointError, match="refusing to load .metadata: it references posix.system"):
        load_checkpoint(path, [0], verify_checksums=False)
    # forged tensor data: the checksum, else weights_only loading
    path = save_checkpoint(tmp_path, 2, layers=make_layers(2), num_layers=2)
    data = path / "__0_0.distcp"
    blob = data.read_bytes()
    torch.save(_Evil(), data)
    with open(data, "ab") as f:
        f.write(b"\0" * max(0, len(blob) - data.stat().st_size))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path, [0])
    with pytest.raises(CheckpointError, match="reading .* failed"):
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
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_torn_checkpoints_are_skipped_with_the_reason(tmp_path):
    layers = make_layers(2)
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step, layers=layers, num_layers=2)
    data = tmp_path / "step_000008" / "__0_0.distcp"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:100])                       # truncated
    (tmp_path / "step_000006" / "__0_0.distcp").unlink()            # a file lost
    (tmp_path / "step_000004" / "manifest.json").unlink()           # never finished
    os.replace(tmp_path / "step_000004", tmp_path / ".tmp_step_000010")
    found, skipped = find_resumable(tmp_path)
    assert found == tmp_path / "step_000002" == latest_checkpoint(tmp_path)
    why = {p.name: reason for p, reason in skipped}
    assert list(why) == [".tmp_step_000010", "step_000008", "step_000006"]  # newest first
    assert why[".tmp_step_000010"].startswith("incomplete: it was being written when the job stopped")
    assert why["step_000008"] == f"torn: __0_0.distcp has 100 bytes, the manifest says {size}"
    assert why["step_000006"] == "torn: __0_0.distcp is missing"
    assert checkpoint_problem(tmp_path / "step_000002") is None
    with pytest.raises(CheckpointError, match="is missing: the checkpoint is incomplete"):
        load_checkpoint(tmp_path / "step_000006", [0])


WRITER = textwrap.dedent("""
    import sys
    import torch
    import engine.checkpoint as ck
    root = sys.argv[1]
    layers = {i: {"w": torch.full((64, 64), float(i))} for i in range(4)}
    ck.save_checkpoint(root, 1, layers=layers, num_layers=4)
    ck.save_checkpoint(root, 2, layers={i: {"w": t["w"] + 100} for i, t in layers.items()},
                       num_layers=4)
""")


@pytest.mark.parametrize("point", ["save", "manifest"])
def test_writer_killed_mid_checkpoint_leaves_previous_loadable(tmp_path, point):
    """SIGKILL after the data of step 2 is written (DCP's own index included) but before the
    manifest, and after the manifest but before the rename: step 1 stays the one loaded."""
    root = tmp_path / "ckpt"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PIPESHARD_FAULT=f"{point}@2")
    proc = subprocess.run([sys.executable, str(script), str(root)], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    torn = root / ".tmp_step_000002"
    assert (torn / ".metadata").is_file() and (torn / "manifest.json").is_file() == (point == "manifest")
    latest, skipped = find_resumable(root)
    assert latest is not None and latest.name == "step_000001"
    assert [(p.name, why.split(":")[0]) for p, why in skipped] == [(".tmp_step_000002", "incomplete")]
    ck = load_checkpoint(latest, range(4), num_layers=4)
    for i in range(4):
        torch.testing.assert_close(ck.layers[i]["w"], torch.full((64, 64), float(i)))
    if point == "save":  # the uncommitted directory is unusable, and never listed
        with pytest.raises(CheckpointError, match="not a complete checkpoint"):
            load_checkpoint(torn, [0])
    assert [p.name for p in list_checkpoints(root)] == ["step_000001"]
    # the next save cleans the debris and succeeds
    save_checkpoint(root, 2, layers={i: {"w": torch.zeros(1)} for i in range(4)}, num_layers=4)
    assert latest_checkpoint(root).name == "step_000002"
    assert not torn.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("zero_before, zero_after, precision", [
    (1, 1, "fp32"), pytest.param(2, 0, "fp32", marks=pytest.mark.long),
    pytest.param(1, 2, "bf16", marks=pytest.mark.long)])
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


@pytest.mark.slow
def test_resume_into_dualpipev_and_zb_auto_with_another_split(tmp_path):
    """The same 1F1B checkpoint resumes as dualpipev (a V of 4 chunks on 2 ranks, 4 microbatches:
    it needs 2p) and as zb-auto on 3 stages: the third step equals the uninterrupted run's."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_helpers import run_workers
    from _zero_harness import runtime_resume_job

    full = run_workers(runtime_resume_job, 2, 2, 1, 0, 3, None, None, timeout_s=120)
    run_workers(runtime_resume_job, 2, 2, 1, 0, 2, str(tmp_path), None, timeout_s=120)
    want = {k: v for _, params in full for k, v in params.items()}
    for world, schedule, virtual, m in ((2, "dualpipev", 2, 4), (3, "zb-auto", 1, 2)):
        resumed = run_workers(runtime_resume_job, world, world, 1, 0, 1, None, str(tmp_path),
                              schedule, virtual, "fp32", m, timeout_s=120)
        got = {k: v for _, params in resumed for k, v in params.items()}
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda msg: f"{schedule} {k}: {msg}")
        for losses, _ in resumed:
            assert losses == pytest.approx(full[-1][0][-1:], rel=1e-5)
