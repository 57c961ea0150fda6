"""``optimizer.step_sync="post_validate"``: the rank-local optimizer step with post-validation and
rollback (issue 40, after the Zero Bubble paper's "bypassing optimizer synchronizations").

Each rank steps as soon as its gradients are summed, assuming no clipping and no non-finite
gradient, and validates one step later against the global norm and flags, all-reduced while the
next step ran. Steps here are forced to fail validation: a small ``grad_clip`` makes some steps
clip and others not, and a parameter hook on the last stage makes one step's gradient non-finite
(its loss stays finite, so only the gradient check can catch it, and the first stage has already
stepped). The losses, gradients and parameters over several steps equal one process's (fp32, the
parity tests' tolerance) and, bit for bit, the same pipeline with ``step_sync="global"``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_helpers import run_workers
from engine.optim import OptimizerConfig, lr_at, make_torch_optimizer
from engine.stage import build_layers
from problems import batches, ranges

SEED, STEPS, P, M = 11, 6, 2, 4
RTOL, ATOL = 1e-5, 1e-6
CLIP = 0.3              # with these layers and data some steps clip and some do not (asserted)
POISON_STEP = 2         # the last layer's weight gradient is made non-finite at this step
_STEP = [-1]            # the data step being run (set by the worker and the reference)


def _poison(grad):
    return grad * float("inf") if _STEP[0] == POISON_STEP else grad


def _last(poison: bool) -> nn.Module:
    lin = nn.Linear(8, 3)
    if poison:
        lin.weight.register_hook(_poison)
    return lin


def _factories(poison: bool):
    return [lambda: nn.Linear(5, 8), lambda: nn.Tanh(), lambda: nn.Linear(8, 8),
            lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU()), lambda: nn.Linear(8, 8),
            lambda: _last(poison)]


def _data(step: int):
    _STEP[0] = step
    return batches(step, seed=300, batch=16, in_dim=5, out_dim=3, learnable=True)


def _config(name: str, sync: str) -> OptimizerConfig:
    return OptimizerConfig(name=name, lr=0.08, momentum=0.9, warmup_steps=2, grad_clip=CLIP,
                           step_sync=sync)


def _reference(name: str, poison: bool) -> dict:
    """One process: skip a step with a non-finite gradient, clip by the global norm, lr by the
    applied steps (as ``engine.optim``)."""
    model = nn.Sequential(*build_layers(_factories(poison), 0, 6, SEED))
    cfg = _config(name, "global")
    opt = make_torch_optimizer(cfg, list(model.parameters()))
    losses, grads, outcomes, applied, clipped = [], [], [], 0, {}
    for step in range(STEPS):
        x, y = _data(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if not all(torch.isfinite(p.grad).all() for p in model.parameters()):
            outcomes.append("skipped")
            continue
        norm = float(nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        outcomes.append("clipped" if norm > CLIP else "ok")
        clipped[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, applied)
        opt.step()
        applied += 1
    return {"losses": losses, "grads": grads, "outcomes": outcomes, "clipped": clipped,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _worker(cases):
    import torch.distributed as dist

    from engine import Pipeline

    torch.set_num_threads(1)
    out = []
    for case in cases:
        pipe = Pipeline(_factories(case["poison"]), ranges(6, P), loss_fn=nn.functional.mse_loss,
                        schedule=case["schedule"], microbatches=M, seed=SEED,
                        data_parallel=case.get("d", 1),
                        optimizer=_config(case["opt"], case["sync"]),
                        nonfinite="skip", comm_timeout_s=30, precision=case.get("precision", "fp32"))
        calls, real = [], dist.all_reduce

        def counting(*a, **k):   # the collectives a step issues, and whether it waits for them
            calls.append(bool(k.get("async_op", False)))
            return real(*a, **k)

        losses, grads, records, collectives, held = [], [], [], [], []
        for step in range(STEPS):
            x, y = _data(step)
            dist.all_reduce = counting
            try:
                r = pipe.train_step(x, y)
            finally:
                dist.all_reduce = real
            losses.append(r.loss)
            grads.append(pipe.optimizer.full_grads())
            records.append(r.stats.get("validated"))
            held.append(r.stats.get("rollback_bytes"))
            collectives.append(list(calls))
            calls.clear()
        records.append(pipe.settle())
        params = {f"{i}.{n}": t.detach().clone()
                  for i, ps in pipe.named_layer_parameters().items() for n, t in ps.items()}
        out.append({"losses": losses, "grads": grads, "params": params, "records": records[1:],
                    "collectives": collectives, "steps": pipe.optimizer.steps, "held": held,
                    "numel": sum(p.numel() for p in pipe.optimizer.params),
                    "scale": pipe.optimizer.loss_scale})
    return out


CASES = [dict(schedule=s, opt="sgd", poison=True, sync=y) for s in ("1f1b", "zb-h1")
         for y in ("post_validate", "global")]
CASES += [dict(schedule="zb-auto", opt="adamw", poison=False, sync=y)
          for y in ("post_validate", "global")]


@pytest.fixture(scope="module")
def results():
    per_rank = run_workers(_worker, P, CASES, timeout_s=240)
    return [[r[k] for r in per_rank] for k in range(len(CASES))]


@pytest.mark.parametrize("k", range(len(CASES)), ids=[f"{c['schedule']}-{c['opt']}-{c['sync']}"
                                                       for c in CASES])
def test_parity_with_one_process_through_rollbacks(results, k):
    case, per_rank = CASES[k], results[k]
    ref = _reference(case["opt"], case["poison"])
    # the scenario is what it claims: clipped and unclipped steps, and (poisoned) a skipped one
    want = {"ok", "clipped"} | ({"skipped"} if case["poison"] else set())
    assert set(ref["outcomes"]) == want, ref["outcomes"]
    for res in per_rank:
        assert res["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL), case
        for step, g in enumerate(res["grads"]):
            if ref["outcomes"][step] == "skipped":
                continue
            # the global step clips .grad in place; post_validate leaves it as summed
            want_g = ref["clipped" if case["sync"] == "global" else "grads"][step]
            for n, t in g.items():
                torch.testing.assert_close(t, want_g[n], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{case} grad {n} step {step}: {m}")
        for n, t in res["params"].items():
            torch.testing.assert_close(t, ref["params"][n], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{case} param {n}: {m}")
        assert res["steps"] == sum(o != "skipped" for o in ref["outcomes"])
    assert set().union(*(r["params"] for r in per_rank)) == set(ref["params"])
    if case["sync"] == "post_validate":
        for res in per_rank:    # every step validated, with the single process's verdict
            assert [r["outcome"] for r in res["records"]] == ref["outcomes"], case
            assert [r["step"] for r in res["records"]] == list(range(STEPS))
        # the first stage had stepped on the poisoned step (its own gradients were finite)
        if case["poison"]:
            assert per_rank[0]["records"][POISON_STEP]["rolled_back"]
            assert not per_rank[1]["records"][POISON_STEP]["rolled_back"]
            assert all(res["records"][POISON_STEP]["replay"] for res in per_rank)
        _check_held(case, per_rank)


def _check_held(case, per_rank):
    """The memory held for a rollback (``stats["rollback_bytes"]``) is engine.footprint's: the
    weights and optimizer state snapshotted, the gradients kept (clipping is on)."""
    from engine.footprint import optimizer_state_bytes_per_param

    state = optimizer_state_bytes_per_param(case["opt"], 0.9)
    for rank, res in enumerate(per_rank):
        n = res["numel"]
        for step, got in enumerate(res["held"]):
            if case["poison"] and step == POISON_STEP and rank == 1:
                assert got == 0            # its own gradients were non-finite: no update, nothing held
            elif step == 0:                # the optimizer's state is made by the first update
                assert got == (4 + 4) * n, (rank, got)
            else:   # adamw also snapshots its per-tensor step counters (4 bytes each)
                assert 0 <= got - (4 + state + 4) * n <= 4 * 16, (rank, step, got)


def test_parity_with_replicas():
    """p = 2 x dp = 2 (torch backend, the replicas' gradients averaged before the step): each
    replica's pipeline validates over its own group."""
    case = dict(schedule="1f1b", opt="sgd", poison=True, sync="post_validate", d=2)
    per_rank = run_workers(_worker, P * 2, [case], timeout_s=240)
    ref = _reference("sgd", True)
    for res in (r[0] for r in per_rank):
        assert res["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL)
        assert [r["outcome"] for r in res["records"]] == ref["outcomes"]
        for n, t in res["params"].items():
            torch.testing.assert_close(t, ref["params"][n], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("k", [0, 2, 4])
def test_post_validate_equals_the_global_step_bit_for_bit_and_waits_for_no_collective(results, k):
    post, glob = results[k], results[k + 1]
    assert CASES[k]["sync"] == "post_validate" and CASES[k + 1]["sync"] == "global"
    for a, b in zip(post, glob):
        assert a["losses"] == b["losses"]
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n
        # global: one all-reduce of the norm that every rank waits for, each step; post_validate:
        # one started and left running (waited one step later)
        assert all(c == [True] for c in a["collectives"]), a["collectives"]
        assert all(c == [False] for c in b["collectives"]), b["collectives"]


def _both(worker, *args):
    """``worker`` with ``step_sync`` post_validate then global, in one launch."""
    return {sync: worker(sync, *args) for sync in ("post_validate", "global")}


def _fp16_worker(sync: str):
    from engine import Pipeline

    torch.set_num_threads(1)
    pipe = Pipeline(_factories(True), ranges(6, P), loss_fn=nn.functional.mse_loss,
                    schedule="1f1b", microbatches=M, seed=SEED, precision="fp16-autocast",
                    optimizer=OptimizerConfig(name="adamw", lr=0.01, step_sync=sync),
                    comm_timeout_s=30)
    losses, scales = [], []
    for step in range(STEPS):
        losses.append(pipe.train_step(*_data(step)).loss)
        scales.append(pipe.optimizer.loss_scale)
    pipe.settle()
    scales.append(pipe.optimizer.loss_scale)
    params = {f"{i}.{n}": t.detach().clone()
              for i, ps in pipe.named_layer_parameters().items() for n, t in ps.items()}
    return {"losses": losses, "scales": scales, "params": params, "steps": pipe.optimizer.steps}


def test_fp16_overflow_rolls_back_like_the_global_step():
    """fp16 loss scaling: the poisoned step overflows; post-validation rolls the first stage's
    update back and halves the scale, exactly as the synchronous step skips it."""
    out = run_workers(_both, P, _fp16_worker, timeout_s=180)
    for a, b in ((r["post_validate"], r["global"]) for r in out):
        assert a["losses"] == b["losses"]
        assert a["scales"][-1] == b["scales"][-1] == 2.0**15   # halved once
        assert a["steps"] == b["steps"] == STEPS - 1
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n


@pytest.mark.parametrize("kw", [dict(zero_stage=1), dict(zero_stage=3)])
def test_a_backend_that_cannot_roll_back_is_refused_before_launch(kw):
    from engine import Pipeline

    with pytest.raises(ValueError, match="step_sync='post_validate' needs the torch optimizer"):
        Pipeline.check_arguments(6, ranges(6, P), microbatches=M, data_parallel=2,
                                 optimizer=OptimizerConfig(step_sync="post_validate", **kw))
    with pytest.raises(ValueError, match="step_sync must be one of"):
        Pipeline.check_arguments(6, ranges(6, P), microbatches=M,
                                 optimizer=OptimizerConfig(step_sync="lazy"))


def _raise_worker():
    from engine import NonFiniteError, Pipeline

    torch.set_num_threads(1)
    pipe = Pipeline(_factories(True), ranges(6, P), loss_fn=nn.functional.mse_loss,
                    schedule="1f1b", microbatches=M, seed=SEED, nonfinite="raise",
                    optimizer=_config("sgd", "post_validate"), comm_timeout_s=30)
    for step in range(STEPS):
        try:
            pipe.train_step(*_data(step))
        except NonFiniteError as e:
            return step, str(e)
    return None


def test_nonfinite_raise_is_raised_by_every_rank_at_validation():
    out = run_workers(_raise_worker, P, timeout_s=120)
    for step, msg in out:
        # validated while step POISON_STEP + 1 ran: every rank raises there, naming the step
        assert step == POISON_STEP + 1
        assert f"optimizer step {POISON_STEP} on pipeline stage(s) [1]" in msg


def _nan_loss_worker(sync: str):
    """A NaN in the inputs of step 2: the loss and every gradient are non-finite, on every rank."""
    from engine import Pipeline

    torch.set_num_threads(1)
    pipe = Pipeline(_factories(False), ranges(6, P), loss_fn=nn.functional.mse_loss,
                    schedule="zb-h1", microbatches=M, seed=SEED, nonfinite="skip",
                    optimizer=_config("sgd", sync), comm_timeout_s=30)
    stats = []
    for step in range(4):
        x, y = _data(step)
        if step == 2:
            x = x.clone()
            x[0, 0] = float("nan")
        stats.append(pipe.train_step(x, y).stats)
    pipe.settle()
    params = {f"{i}.{n}": t.detach().clone()
              for i, ps in pipe.named_layer_parameters().items() for n, t in ps.items()}
    return {"stats": stats, "params": params, "steps": pipe.optimizer.steps}


def test_a_skip_no_rank_stepped_for_voids_nothing():
    """No rank updated on a step whose gradients are non-finite everywhere (a NaN loss): the
    skip is validated with no rollback and the next step is not run again."""
    out = run_workers(_both, P, _nan_loss_worker, timeout_s=180)
    for a, b in ((r["post_validate"], r["global"]) for r in out):
        rec = a["stats"][3]["validated"]
        assert (rec["step"], rec["outcome"], rec["rolled_back"], rec["replay"]) == (2, "skipped", False, False)
        assert "void_run_s" not in a["stats"][3]
        assert a["steps"] == b["steps"] == 3
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n

