"""A training job that survives its own death: the worker of the recovery tests.

Every start (attempt) builds the pipeline, resumes from the newest loadable checkpoint under
``root`` (skipping torn ones), trains to ``steps`` on data that is a pure function of the step,
checkpoints every ``every`` steps (async), and returns what it saw. ``PIPESHARD_FAULT`` (set by
the test) kills a rank at a chosen point of the first attempt; ``engine.launch(max_restarts=1)``
starts all ranks again.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

LAYERS = 4


def _layer(i: int) -> nn.Module:
    torch.manual_seed(500 + i)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh())


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def recovery_job(p: int, d: int, zero: int, steps: int, every: int, root: str) -> dict:
    """One rank of a p-stage x d-replica SGD (momentum, fp32) job; see the module docstring."""
    import torch.distributed as dist

    from engine import OptimizerConfig, Pipeline
    from engine import checkpoint as ck
    from engine.cluster import restart_count
    from engine.faults import inject

    k = LAYERS // p
    pipe = Pipeline([functools.partial(_layer, i) for i in range(LAYERS)],
                    [(c * k, (c + 1) * k) for c in range(p)], loss_fn=nn.functional.mse_loss,
                    schedule="1f1b", microbatches=2, data_parallel=d,
                    optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, zero_stage=zero))
    rank = dist.get_rank()
    saver = ck.Checkpointer(root, num_layers=LAYERS, keep_last=2, async_save=True)
    path, skipped = ck.find_resumable(root)
    start = 0
    if path is not None:
        expected = {int(i): m.state_dict() for i, m in pipe.layer_module.items()}
        c = ck.load_checkpoint(path, sorted(expected), expected=expected, num_layers=LAYERS)
        pipe.load_state_dict({"layers": c.layers, "step": c.meta["step"], "optimizer":
                              ck.merge_optimizer_state(c.optimizer, c.meta["optimizer"])})
        start = int(c.meta["step"])
    losses = {}
    for s in range(start, steps):
        inject("step", s + 1, rank=rank)
        losses[s + 1] = pipe.train_step(*_data(s)).loss
        if (s + 1) % every == 0:
            sd = pipe.state_dict()
            per_layer, scalars = ck.split_optimizer_state(sd["optimizer"])
            saver.save(s + 1, layers=sd["layers"], optimizer=per_layer,
                       meta={"step": s + 1, "optimizer": scalars})
    saver.close()
    params = {f"{i}.{n}": t.detach().clone()
              for i, ps in pipe.named_layer_parameters().items() for n, t in ps.items()}
    return {"attempt": restart_count(), "start": start, "losses": losses, "params": params,
            "skipped": [(p.name, why) for p, why in skipped]}
