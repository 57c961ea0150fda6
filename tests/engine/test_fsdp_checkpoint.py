"""ZeRO-3 (FSDP2) checkpoints on DCP (``engine.checkpoint``): the layers and the optimizer state
are saved whole (gathered over each stage's data-parallel group), so a run resumes exactly in the
same layout (pp2 x fsdp2, 4 ranks) and in others (pp2 x 1 replica: the torch backend, and
FSDP2 over a one-rank data-parallel group).

Layers with odd row counts shard unevenly. A 4-rank job trains 2 AdamW steps, saves, trains
step 3 (equal to one process, rtol 1e-5); a second 4-rank job and two 2-rank jobs load the
checkpoint and train step 3: the same loss and parameters (fp32, rtol 1e-6).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_helpers import run_workers
from engine.optim import OptimizerConfig
from problems import batches, ranges, reference

pytestmark = pytest.mark.slow

SEED, M, BATCH = 3, 4, 16
ADAMW = dict(name="adamw", lr=0.01, weight_decay=0.01)


def _factories():
    # odd row counts (15, 7, 3): FSDP2's dim-0 shards are uneven over 2 replicas
    return [lambda: nn.Linear(8, 15), lambda: nn.Sequential(nn.Linear(15, 16), nn.GELU()),
            lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh()), lambda: nn.Linear(16, 7),
            lambda: nn.GELU(), lambda: nn.Sequential(nn.Linear(7, 3), nn.Linear(3, 4))]


def _data(step: int):
    return batches(step, seed=500, batch=BATCH, in_dim=8, out_dim=4, learnable=True)


def _pipe(replicas: int, zero: int):
    from engine import Pipeline

    return Pipeline(_factories(), ranges(6, 2), loss_fn=nn.functional.mse_loss, schedule="zb-h1",
                    microbatches=M, data_parallel=replicas, seed=SEED, comm_timeout_s=60,
                    optimizer=OptimizerConfig(**ADAMW, zero_stage=zero))


def _params(pipe) -> dict:
    whole = getattr(pipe.optimizer, "full_parameters", None)
    if whole is not None:
        return whole()
    return {f"{i}.{n}": t.detach().clone() for i, ps in pipe.named_layer_parameters().items()
            for n, t in ps.items()}


def _save_then_continue(root: str):
    from engine.checkpoint import save_checkpoint, split_optimizer_state

    torch.set_num_threads(1)
    pipe = _pipe(2, 3)
    for step in range(2):
        pipe.train_step(*_data(step))
    sd = pipe.state_dict()
    per_layer, scalars = split_optimizer_state(sd["optimizer"])
    save_checkpoint(root, 2, layers=sd["layers"], num_layers=6, optimizer=per_layer,
                    meta={"optimizer": scalars, "step": sd["step"]})
    loss = pipe.train_step(*_data(2)).loss
    return loss, _params(pipe)


def _resume(root: str, replicas: int, zero: int):
    from engine.checkpoint import latest_checkpoint, load_checkpoint, merge_optimizer_state

    torch.set_num_threads(1)
    pipe = _pipe(replicas, zero)
    mine = [int(k) for k in pipe.layer_module]
    ckpt = load_checkpoint(latest_checkpoint(root), mine, expected=pipe.checkpoint_template(),
                           num_layers=6)
    pipe.load_state_dict({"layers": ckpt.layers, "step": ckpt.meta["step"],
                          "optimizer": merge_optimizer_state(ckpt.optimizer,
                                                             ckpt.meta["optimizer"])})
    loss = pipe.train_step(*_data(2)).loss
    return loss, _params(pipe)


def test_fsdp_checkpoint_resumes_exactly(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_workers(_save_then_continue, 4, root, timeout_s=300)
    ref = reference(_factories(), _data, OptimizerConfig(**ADAMW), 3, seed=SEED)
    for loss, params in first:   # uneven shards train as one process does
        assert loss == pytest.approx(ref["losses"][2], rel=1e-5)
        for name, t in params.items():
            torch.testing.assert_close(t, ref["params"][name], rtol=1e-5, atol=1e-7)
    for replicas, zero in ((2, 3), (1, 0), (1, 3)):
        again = run_workers(_resume, 2 * replicas, root, replicas, zero, timeout_s=300)
        for rank, (loss, params) in enumerate(again):
            ref_loss, ref_params = first[rank % 2]   # the same pipeline rank, replica 0
            assert loss == pytest.approx(ref_loss, rel=1e-6)
            assert set(params) == set(ref_params)
            for name, t in params.items():
                torch.testing.assert_close(t, ref_params[name], rtol=1e-6, atol=1e-8,
                                           msg=f"{replicas} replicas, zero {zero}: {name}")
