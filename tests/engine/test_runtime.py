"""Parity of the multi-process pipeline runtime with a single process (fp32, gloo).

For every schedule and several layouts, the losses, every parameter's gradient and the parameters
after 3 SGD(momentum) steps equal a single-process run of the same layers on the same global
batches. The batch size changes between steps (the shape handshake is per step) and one stage
boundary carries a tuple holding a float tensor, a skip tensor and an int64 mask.
Several layouts share one spawned job to keep the suite fast.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from dist_helpers import run_workers
from engine.optim import OptimizerConfig
from problems import batches, ranges, reference

SEED = 7
LR, MOMENTUM = 0.05, 0.9
BATCHES = (24, 48, 24)      # global batch per step: shapes change between steps
RTOL, ATOL = 1e-5, 1e-6


class Fork(nn.Module):
    """Returns a tuple: (projection, skip, int64 row mask) - crosses a stage boundary."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x), x, (x.sum(1) > 0).long()


class Join(nn.Module):
    def __init__(self, d: int, out: int):
        super().__init__()
        self.lin = nn.Linear(d, out)

    def forward(self, t):
        a, skip, mask = t
        return self.lin(torch.tanh(a) + skip * (1 + mask[:, None].float()))


def _factories():
    return [
        lambda: nn.Linear(6, 10),
        lambda: nn.Sequential(nn.Linear(10, 12), nn.Tanh()),
        lambda: Fork(12),
        lambda: Join(12, 9),
        lambda: nn.Sequential(nn.Linear(9, 9), nn.GELU()),
        lambda: nn.Tanh(),                     # a layer without parameters
        lambda: nn.Linear(9, 11),
        lambda: nn.Sequential(nn.Tanh(), nn.Linear(11, 7)),
        lambda: nn.Linear(7, 3),
    ]


N_LAYERS = 9
TIES = [("3.lin.bias", "4.0.bias")]   # both (9,)


def _data(step: int):
    return batches(step, seed=1000, batch=BATCHES, in_dim=6, out_dim=3)


def _worker(cases):
    """Run each case on this rank; return per case: losses, grads per step, final params."""
    from engine import OptimizerConfig, Pipeline
    from engine.transport import transport_threads

    torch.set_num_threads(1)
    out = []
    for case in cases:
        v = case.get("v", 1)
        pipe = Pipeline(_factories(), case.get("ranges") or ranges(N_LAYERS, case["p"] * v),
                        loss_fn=nn.functional.mse_loss, schedule=case["schedule"],
                        microbatches=case["m"], virtual_stages=v,
                        data_parallel=case.get("d", 1), seed=SEED,
                        optimizer=OptimizerConfig(name="sgd", lr=LR, momentum=MOMENTUM,
                                                  overlap_grad_reduce=case.get("overlap", True),
                                                  grad_bucket_mb=case.get("bucket_mb", 25.0)),
                        activation_checkpointing=case.get("ckpt", False), comm_timeout_s=30,
                        recompute_granularity=case.get("granularity", "chunk"),
                        ties=TIES if case.get("tie") else (), max_inflight=case.get("cap"),
                        recv_lookahead=case.get("lookahead"), device=case.get("device"),
                        transport_threads=case.get("transport"), send_wait=case.get("send_wait"))
        policies = {os.sched_getscheduler(t) for t in transport_threads()}
        if case.get("batched"):  # NCCL's path (batch_isend_irecv per flush), run on gloo
            pipe.p2p.nccl = True
        losses, grads, stats = [], [], []
        for step in range(len(BATCHES)):
            x, y = _data(step)
            r = pipe.train_step(x, y)
            losses.append(r.loss)
            grads.append(pipe.optimizer.full_grads())
            stats.append(dict(r.stats, early_buckets=getattr(getattr(pipe.optimizer, "reducer", None),
                                                             "launched_early", None)))
        params = {f"{i}.{n}": t.detach().clone()
                  for i, ps in pipe.named_layer_parameters().items() for n, t in ps.items()}
        out.append({"losses": losses, "grads": grads, "params": params, "stats": stats,
                    "eval": pipe.eval_step(*_data(0)), "send_wait": pipe.send_wait,
                    "policies": policies})
    return out


def _reference(tie=False):
    ref = reference(_factories(), _data, OptimizerConfig(name="sgd", lr=LR, momentum=MOMENTUM),
                    len(BATCHES), seed=SEED, ties=TIES if tie else ())
    with torch.no_grad():
        ref["eval"] = nn.functional.mse_loss(ref["model"](_data(0)[0]), _data(0)[1]).item()
    return ref


REF: dict = {}


def _ref(tie=False):
    if tie not in REF:
        REF[tie] = _reference(tie)
    return REF[tie]


def _check(case, per_rank):
    tie = isinstance(case, dict) and case.get("tie", False)
    ref = _ref(tie)
    alias = {"4.0.bias": "3.lin.bias"} if tie else {}
    name = str(case)
    for res in per_rank:
        assert res["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=ATOL), name
        assert res["eval"] == pytest.approx(ref["eval"], rel=RTOL, abs=ATOL), name
    if isinstance(case, dict) and case.get("bucket_mb", 25.0) < 1e-3:   # buckets started in backward
        assert all(s["early_buckets"] > 0 for res in per_rank for s in res["stats"]), name
    if isinstance(case, dict) and not case.get("overlap", True):
        assert all(s["early_buckets"] is None for res in per_rank for s in res["stats"]), name
    seen_params = set()
    for res in per_rank:
        for step, g in enumerate(res["grads"]):
            for n, t in g.items():
                torch.testing.assert_close(t, ref["grads"][step][alias.get(n, n)], rtol=RTOL,
                                           atol=ATOL,
                                           msg=lambda m: f"{name} grad {n} step {step}: {m}")
        for n, t in res["params"].items():
            torch.testing.assert_close(t, ref["params"][alias.get(n, n)], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name} param {n}: {m}")
            seen_params.add(alias.get(n, n))
    assert seen_params == set(ref["params"]), f"{name}: parameters missing from the pipeline"


def _run_and_check(world, cases):
    results = run_workers(_worker, world, cases, timeout_s=180)
    for k, case in enumerate(cases):
        _check(case, [r[k] for r in results])
    return results


SCHEDS = ("gpipe", "1f1b", "zb-h1")   # and zbv / zb-h2 below (issue 12)


def test_parity_two_stages_every_schedule_and_checkpointing():
    cases = [dict(schedule=s, p=2, m=4) for s in SCHEDS]
    cases += [dict(schedule="interleaved-1f1b", p=2, v=2, m=4)]
    cases += [dict(schedule="1f1b", p=2, m=4, ckpt=True),
              dict(schedule="zb-h1", p=2, m=4, ckpt=True)]
    # zbv: a V of 4 chunks (rank 0 holds chunks 0 and 3, so the loss); the tie crosses ranks
    cases += [dict(schedule="zbv", p=2, v=2, m=4), dict(schedule="zb-h2", p=2, m=4),
              dict(schedule="zbv", p=2, v=2, m=3, tie=True, ranges=[(0, 4), (4, 5), (5, 7), (7, 9)])]
    # per-chunk recomputation (a plan's stage_recompute): chunk 0 only; zbv: rank 0's chunks
    cases += [dict(schedule="1f1b", p=2, m=4, ckpt=[True, False]),
              dict(schedule="zbv", p=2, v=2, m=4, ckpt=[True, False, False, True])]
    # interleaved and zbv post receives 2 ahead on gloo by default: also run them posting when needed
    cases += [dict(schedule="interleaved-1f1b", p=2, v=2, m=4, lookahead=0),
              dict(schedule="zbv", p=2, v=2, m=4, lookahead=0)]
    # sends waited at the end of the step with gloo's default thread policy (the others on gloo
    # wait them before each compute where the schedule allows it: engine.policy.default_send_wait)
    cases += [dict(schedule=s, p=2, m=4, transport="normal") for s in SCHEDS]
    cases += [dict(schedule="interleaved-1f1b", p=2, v=2, m=4, transport="normal")]
    cases += [dict(schedule="zb-h1", p=2, m=4, send_wait="compute")]   # allowed, not the default
    # yielding to sends in flight (interleaved's default on gloo) forced on schedules without it
    cases += [dict(schedule=s, p=2, v=v, m=4, send_wait="yield")
              for s, v in (("1f1b", 1), ("zb-h2", 1), ("zbv", 2))]
    # the NCCL code path (held transfers issued as batch_isend_irecv batches), on gloo
    cases += [dict(schedule=s, p=2, v=v, m=4, batched=True)
              for s, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2))]
    results = _run_and_check(2, cases)
    waits = [(c["schedule"], c.get("transport"), results[0][k]["send_wait"])
             for k, c in enumerate(cases)]
    assert ("1f1b", None, "compute") in waits and ("1f1b", "normal", "step") in waits
    assert ("zb-h1", None, "step") in waits and ("zb-h1", None, "compute") in waits
    assert {w for s, t, w in waits if s in ("zbv", "zb-h2") and t is None} == {"step", "yield"}
    assert {w for s, t, w in waits if s == "interleaved-1f1b" and t is None} == {"yield"}
    assert ("interleaved-1f1b", "normal", "step") in waits
    # gloo's transport thread runs under SCHED_BATCH where sends are waited or yielded to before
    # each compute (engine/transport.py, engine.policy.default_transport_threads), else the
    # kernel's default
    for k, c in enumerate(cases):
        batch = c.get("transport") is None and c["schedule"] in ("gpipe", "1f1b", "interleaved-1f1b")
        want = os.SCHED_BATCH if batch else os.SCHED_OTHER
        assert results[0][k]["policies"] == {want}, c
    stats = results[0][0]["stats"][0]  # rank 0, gpipe, step 0
    for key in ("forward_s", "backward_s", "comm_wait_s", "comm_issue_s", "idle_s",
                "peak_activation_bytes", "optimizer_state_bytes"):
        assert key in stats
    # rank 0 sends activations and posts gradient receives; both clocks sit inside idle_s
    assert stats["comm_issue_s"] > 0
    assert stats["comm_wait_s"] + stats["comm_issue_s"] <= stats["idle_s"] + 1e-6
    assert stats["peak_activation_bytes"] > 0
    # GPipe holds all m microbatches on stage 0, 1F1B at most p: fewer saved activations
    peaks = {name: results[0][k]["stats"][0]["peak_activation_bytes"]
             for k, name in enumerate(("gpipe", "1f1b", "zb-h1"))}
    print("stage-0 peak activation bytes", peaks)
    assert peaks["1f1b"] < peaks["gpipe"]
    assert peaks["zb-h1"] <= peaks["gpipe"]
    # checkpointing keeps fewer saved activations than the plain 1F1B run
    plain = results[0][1]["stats"][0]["peak_activation_bytes"]
    ckpt = results[0][4]["stats"][0]["peak_activation_bytes"]
    assert 0 < ckpt < plain
    # per chunk: the recomputing rank keeps what checkpointing keeps, the other what plain keeps
    peak = lambda r, k: results[r][k]["stats"][0]["peak_activation_bytes"]  # noqa: E731
    assert (peak(0, 9), peak(1, 9)) == (peak(0, 4), peak(1, 1)) and peak(1, 4) < peak(1, 1)
    assert peak(0, 10) <= peak(0, 6) and peak(1, 10) == peak(1, 6)  # zbv: rank 1 does not recompute


def test_parity_per_layer_recompute():
    """Each layer its own checkpoint (``recompute_granularity="layer"``) on 1f1b, zb-h1 (a split
    backward: one full backward at I) and zbv (rank 0 holds the loss chunk: its last layer and
    the loss one checkpoint), every chunk and per chunk (a plan's stage_recompute); the tuple
    boundary (Fork -> Join) inside a chunk crosses a layer checkpoint."""
    cases = [dict(schedule=s, p=2, v=v, m=4, ckpt=True, granularity="layer")
             for s, v in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2))]
    cases += [dict(schedule="zbv", p=2, v=2, m=4, ckpt=[False, True, True, False], granularity="layer"),
              dict(schedule="1f1b", p=2, m=4, ckpt=True, granularity="layer", ranges=[(0, 5), (5, 9)])]
    _run_and_check(2, cases)


def test_per_layer_recompute_keeps_each_layer_input():
    """A layer-checkpointed chunk keeps each layer's input per microbatch (counted once per
    storage), a chunk-checkpointed one its input only; the granularity is refused by name."""
    from engine.stage import Chunk

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)
    kept = {}
    for gran in ("chunk", "layer"):
        chunk = Chunk(0, 0, layers, activation_checkpointing=True, recompute_granularity=gran)
        chunk.forward(0, x)
        kept[gran] = chunk.live_bytes
        chunk.backward(0, [torch.ones(4, 8)], _Plain())
    assert kept == {"chunk": 4 * 8 * 4, "layer": 3 * 4 * 8 * 4}
    with pytest.raises(ValueError, match="'chunk'.*'layer'"):
        Chunk(0, 0, layers, activation_checkpointing=True, recompute_granularity="block")


class _Plain:
    """The optimizer hooks a Chunk's backward calls, without scaling."""

    def backward(self, outs, grads, inputs=None):
        torch.autograd.backward(outs, grads, inputs=inputs)

    def loss_grad(self, loss):
        return torch.ones_like(loss)


def test_parity_four_stages_every_schedule():
    cases = [dict(schedule=s, p=4, m=4) for s in SCHEDS]
    cases += [dict(schedule=s, p=4, m=4, lookahead=2) for s in SCHEDS]   # receives posted ahead (NCCL's default)
    cases += [dict(schedule="interleaved-1f1b", p=4, v=2, m=4),
              dict(schedule="1f1b", p=2, d=2, m=2, bucket_mb=1e-4),   # a bucket per tensor: early
              dict(schedule="zb-h1", p=2, d=2, m=4, overlap=False),
              dict(schedule="interleaved-1f1b", p=4, v=2, m=4, tie=True),   # across ranks
              dict(schedule="zb-h1", p=2, d=2, m=4, tie=True, bucket_mb=1e-4),   # same rank
              dict(schedule="zbv", p=4, v=2, m=8), dict(schedule="zb-h2", p=4, m=6, cap=6),
              dict(schedule="zbv", p=2, v=2, d=2, m=4, tie=True, bucket_mb=1e-4),
              dict(schedule="zb-h2", p=2, d=2, m=4, cap=2)]
    _run_and_check(4, cases)


def _zb_auto(p: int, m: int, cap: int):
    """zb-auto built from unequal per-chunk costs (a Schedule object, as a planner passes it)."""
    from engine.schedules import build_schedule
    return build_schedule("zb-auto", p, m, max_inflight=cap, forward_s=[1.0, 2.0, 1.5, 0.5][:p],
                          backward_s=[2.0, 3.0, 3.0, 1.5][:p], weight_s=[0.5, 1.5, 1.0, 0.5][:p],
                          comm_s=0.1)


@pytest.mark.parametrize("p,d", [(2, 1), (3, 1), (4, 1), (2, 2)])
def test_parity_zb_auto_and_dualpipev(p, d):
    m = 2 * p
    cases = [dict(schedule="dualpipev", p=p, v=2, d=d, m=m),
             dict(schedule=_zb_auto(p, m, p + 1), p=p, d=d, m=m),
             dict(schedule=_zb_auto(p, m, 2), p=p, d=d, m=m)]   # less memory than 1F1B
    _run_and_check(p * d, cases)


def test_parity_three_stages():
    cases = [dict(schedule="1f1b", p=3, m=4), dict(schedule="zb-h1", p=3, m=4),
             dict(schedule="interleaved-1f1b", p=3, v=2, m=3),
             dict(schedule="zbv", p=3, v=2, m=6), dict(schedule="zb-h2", p=3, m=6),
             dict(schedule="zb-h2", p=3, m=4, cap=4, tie=True)]
    _run_and_check(3, cases)


@pytest.mark.parametrize("name,v,gloo", [("gpipe", 1, 0), ("1f1b", 1, 0), ("zb-h1", 1, 0),
                                         ("zb-h2", 1, 0), ("interleaved-1f1b", 2, 2),
                                         ("interleaved-1f1b", 3, 2), ("zbv", 2, 2)])
def test_default_recv_lookahead_posts_ahead_on_gloo_only_with_several_chunks_per_rank(name, v, gloo):
    from engine.runtime import default_recv_lookahead
    from engine.schedules import build_schedule

    sched = build_schedule(name, 2, 6, v)
    assert default_recv_lookahead("gloo", sched) == gloo
    assert default_recv_lookahead("nccl", sched) == 2


def test_single_process_pipeline_matches_reference():
    """p = 1 (no process group at all) runs the same code path in-process."""
    _check("p1", [_worker([dict(schedule="1f1b", p=1, m=4)])[0]])
    _check("p1-zb", [_worker([dict(schedule="zb-h1", p=1, m=2)])[0]])
    _check("p1-zbv", [_worker([dict(schedule="zbv", p=1, v=2, m=2)])[0]])
    # two chunks on one rank: activations and gradients pass locally, no communication
    case = dict(schedule="interleaved-1f1b", p=1, v=2, m=2, tie=True, ranges=[(0, 4), (4, 9)])
    _check(case, [_worker([case])[0]])


@pytest.mark.parametrize("kwargs, match", [
    (dict(stage_ranges=[(0, 4), (5, 9)]), "unassigned"),
    (dict(stage_ranges=[(0, 4), (4, 9)]), "world size 1 != num_stages 2"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(schedule="zigzag"), "unknown schedule"),
    (dict(batch=10), "not divisible by data_parallel"),
])
def test_bad_arguments_are_refused_with_a_remedy(kwargs, match):
    from engine import Pipeline
    batch = kwargs.pop("batch", 8)
    args = dict(stage_ranges=[(0, N_LAYERS)], loss_fn=nn.functional.mse_loss, microbatches=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        pipe = Pipeline(_factories(), **args)
        pipe.train_step(torch.randn(batch, 6), torch.randn(batch, 3))


def _issue_batches(schedule: str):
    """Run one step; return this rank's backend calls grouped by the P2P.flush that issued them
    (calls outside a flush land in a batch of their own, marked None)."""
    import torch.distributed as dist
    from engine import OptimizerConfig, Pipeline
    from engine.comm import P2P

    torch.set_num_threads(1)
    pipe = Pipeline(_factories(), ranges(N_LAYERS, 2), loss_fn=nn.functional.mse_loss,
                    schedule=schedule, microbatches=4, seed=SEED,
                    optimizer=OptimizerConfig(name="sgd", lr=LR), comm_timeout_s=30)
    batches_, state = [], {"in": False}
    flush = P2P.flush

    def recording_flush(self):
        state["in"] = True
        batches_.append([])
        try:
            flush(self)
        finally:
            state["in"] = False

    def wrap(kind, fn):
        def call(tensor, dst, group=None, tag=0):
            if state["in"]:
                batches_[-1].append(kind)
            else:
                batches_.append([None, kind])
            return fn(tensor, dst, group=group, tag=tag)
        return call

    P2P.flush = recording_flush
    isend, irecv = dist.isend, dist.irecv
    dist.isend, dist.irecv = wrap("send", isend), wrap("recv", irecv)
    try:
        pipe.train_step(*_data(0))
    finally:
        P2P.flush, dist.isend, dist.irecv = flush, isend, irecv
    return [b for b in batches_ if b]


def test_a_send_and_the_receive_after_it_are_issued_together_before_the_next_compute():
    """gloo: the transfers between two computes leave in one flush (a send, then the receive the
    next compute needs), not one call at a time with Python in between: that cost the peer's
    transport thread a second wake-up per microbatch (docs/performance.md, issue 10)."""
    per_rank = run_workers(_issue_batches, 2, "1f1b", timeout_s=120)
    for rank, batches_ in enumerate(per_rank):
        assert all(b[0] is not None for b in batches_), (rank, batches_)
        # steady state: rank 0 sends activations then posts the gradient receive; rank 1 sends
        # a gradient then posts the next activation receive: both in one batch, send first
        assert ["send", "recv"] in batches_, (rank, batches_)


def _collectives_in_a_step(schedule: str):
    """Two unchecked training steps and a checked one (``diagnose``); per step the collectives
    issued, the notes sent (by direction), and the loss and stats it reported."""
    import torch.distributed as dist
    from engine import OptimizerConfig, Pipeline

    torch.set_num_threads(1)
    v = 1 if schedule == "1f1b" else 2
    pipe = Pipeline(_factories(), ranges(N_LAYERS, 2 * v), loss_fn=nn.functional.mse_loss,
                    schedule=schedule, virtual_stages=v, microbatches=4, seed=SEED,
                    optimizer=OptimizerConfig(name="sgd", lr=LR), comm_timeout_s=30)
    names = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "barrier", "all_to_all", "reduce", "gather", "scatter")
    calls, notes, saved = [], [], {n: getattr(dist, n) for n in names + ("isend",)}

    def counting(name):
        def call(*a, **k):
            calls.append(name)
            return saved[name](*a, **k)
        return call

    def isend(tensor, dst, group=None, tag=0):
        if tag % 64 == 63:  # a note (engine.comm): its direction is bit 20 of the tag
            notes.append("B" if (tag >> 20) & 1 else "F")
        return saved["isend"](tensor, dst, group=group, tag=tag)

    out = []
    for step, diagnose in enumerate((False, False, True)):
        for n in names:
            setattr(dist, n, counting(n))
        dist.isend = isend
        try:
            r = pipe.train_step(*_data(step), diagnose=diagnose)  # diagnose: the norm's all-reduce
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)
        out.append({"collectives": list(calls), "loss": r.loss, "diagnose": diagnose,
                    "notes": {d: notes.count(d) for d in "FB"},
                    "nonfinite": r.stats.get("nonfinite_stage")})
        calls.clear()
        notes.clear()
    return out


@pytest.mark.parametrize("schedule,cuts", [("1f1b", 1), ("interleaved-1f1b", 3), ("zbv", 2)])
def test_a_step_with_one_replica_needs_no_collective_and_every_rank_has_the_loss(schedule, cuts):
    """The loss and the non-finite verdict ride the last microbatch's messages (issue 10): no
    rank waits on a collective at the end of a step, yet every rank reports the same loss,
    the single process's. Only a checked (diagnostic) step sends the partial verdict down with
    the activations; every step sends it up with the gradients, once per cut between ranks."""
    per_rank = run_workers(_collectives_in_a_step, 2, schedule, timeout_s=120)
    ref = reference(_factories(), _data, OptimizerConfig(name="sgd", lr=LR), 3, seed=SEED)
    for rank, steps in enumerate(per_rank):
        for k, s in enumerate(steps):
            if not s["diagnose"]:
                assert s["collectives"] == [], (rank, k, s)
            assert s["nonfinite"] is None
            assert s["loss"] == pytest.approx(ref["losses"][k], rel=RTOL, abs=ATOL), (rank, k)
    for k in range(3):
        sent = {d: sum(steps[k]["notes"][d] for steps in per_rank) for d in "FB"}
        assert sent == {"F": cuts if per_rank[0][k]["diagnose"] else 0, "B": cuts}, (k, sent)


def test_default_send_wait_waits_before_compute_only_where_it_cannot_deadlock():
    from engine.runtime import default_send_wait
    from engine.schedules import build_schedule

    one, zbv = build_schedule("1f1b", 2, 4), build_schedule("zbv", 2, 4, 2)
    assert default_send_wait("gloo", one, "batch") == "compute"
    assert default_send_wait("gloo", build_schedule("gpipe", 2, 4), "batch") == "compute"
    # zb-h1 allows it, but a blocking send gives back the bubble its W fills: not by default
    zb1 = build_schedule("zb-h1", 2, 4)
    assert default_send_wait("gloo", zb1, "batch") == "step"
    assert default_send_wait("gloo", zb1, "batch", "compute") == "compute"
    from engine.runtime import default_transport_threads
    assert [default_transport_threads("gloo", x) for x in (one, zb1, zbv)] == ["batch", "normal",
                                                                              "normal"]
    assert default_transport_threads("nccl", one) is None
    assert default_send_wait("gloo", one, "normal") == "step"    # slower there (docs/performance.md)
    assert default_send_wait("nccl", one, None) == "step"
    assert default_send_wait("gloo", zbv, "batch") == "step"
    assert default_send_wait("gloo", one, "normal", "compute") == "compute"   # asked for
    # interleaved cannot wait its sends; it yields to them where gloo's thread is under SCHED_BATCH
    inter = build_schedule("interleaved-1f1b", 2, 4, 2)
    assert default_transport_threads("gloo", inter) == "batch"
    assert default_send_wait("gloo", inter, "batch") == "yield"
    assert default_send_wait("gloo", inter, "normal") == "step"
    assert default_send_wait("gloo", zbv, "batch", "yield") == "yield"   # never blocks: allowed
    with pytest.raises(ValueError, match="deadlock interleaved-1f1b"):
        default_send_wait("gloo", inter, "batch", "compute")
    with pytest.raises(ValueError, match="deadlock zbv.*send_wait='yield' or 'step'"):
        default_send_wait("gloo", zbv, "batch", "compute")
    with pytest.raises(ValueError, match="use 'compute'"):
        default_send_wait("gloo", one, "batch", "sometimes")
