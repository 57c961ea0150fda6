"""engine.zero: DeepSpeed ZeRO 0/1/2 driven by a hand-written 2-stage x 2-replica pipeline.

World 4 on gloo: pipeline groups {0,1},{2,3}; data-parallel groups {0,2},{1,3}. Every case is
compared with one process training the same model on the whole batch. SGD is the parity
optimizer that matters (Adam hides a gradient off by a constant factor). DeepSpeed engines are
slow to build, so all cases run in two spawned jobs (module-scoped fixtures).
"""

from __future__ import annotations

import pytest
import torch

from _zero_harness import make_config, reference, run_cases, spawn
from engine.optim import lr_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SGD = dict(name="sgd", lr=0.1, momentum=0.9)
ADAMW = dict(name="adamw", lr=0.01, weight_decay=0.01)
STAGES = (0, 1, 2)

PARITY = [
    *[dict(cfg=dict(SGD, zero_stage=z), steps=3) for z in STAGES],
    *[dict(cfg=dict(ADAMW, zero_stage=z), steps=3) for z in STAGES],
    # zero-bubble split backward (I now, W deferred) and interleaved chunks (2 per rank)
    dict(cfg=dict(SGD, zero_stage=2), steps=3, split=True),
    dict(cfg=dict(SGD, zero_stage=2), steps=3, virtual=2),
    dict(cfg=dict(SGD, zero_stage=1), steps=3, virtual=2, split=True),
    dict(cfg=dict(SGD, zero_stage=2), steps=3, virtual=2, split=True),
    # learning-rate warm-up then cosine decay, applied on the same steps as a single process
    dict(cfg=dict(SGD, zero_stage=1, warmup_steps=2, decay_steps=2), steps=3),
]
OTHER = [
    *[dict(cfg=dict(SGD, zero_stage=z, grad_clip=0.3), steps=3) for z in STAGES],
    *[dict(cfg=dict(SGD, zero_stage=z), steps=3, precision="fp16-autocast", poison_step=1) for z in STAGES],
    dict(cfg=dict(ADAMW, zero_stage=1), steps=3, precision="bf16-autocast", autocast=torch.bfloat16),
    *[dict(cfg=dict(ADAMW, zero_stage=z, warmup_steps=2), resume=True) for z in (1, 2)],
    dict(cfg=dict(SGD, zero_stage=0), resume=True),
    # fp32 with a non-finite gradient on one stage: raise everywhere, or skip everywhere
    dict(cfg=dict(SGD, zero_stage=2), steps=2, poison_step=1),
    dict(cfg=dict(SGD, zero_stage=1), steps=3, poison_step=1, nonfinite="skip"),
    dict(walk=True),   # ZeRO-2's bucket reduces with bf16 weights
]
WALK = len(OTHER) - 1


@pytest.fixture(scope="module")
def parity() -> list[list[dict]]:
    return spawn(run_cases, 4, PARITY)


@pytest.fixture(scope="module")
def other() -> list[list[dict]]:
    return spawn(run_cases, 4, OTHER)


def _assert_params(per_rank: list[dict], ref: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    seen = set()
    for r in per_rank:
        for k, v in r["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
            seen.add(k)
    assert seen == set(ref["params"]), "the ranks together must hold every layer"


def _label(case: dict) -> str:
    c = case["cfg"]
    sched = " lr-schedule" if c.get("warmup_steps") else ""
    return f"{c['name']} zero{c['zero_stage']} v{case.get('virtual', 1)} split={case.get('split', False)}{sched}"


@pytest.mark.parametrize("idx", range(len(PARITY)), ids=[_label(c) for c in PARITY])
def test_parity_with_single_process(parity, idx):
    case = PARITY[idx]
    per_rank = [rank_out[idx] for rank_out in parity]
    cfg = make_config(**case["cfg"])
    ref = reference(cfg, case["steps"])
    for r in per_rank:
        assert [s["lr"] for s in r["results"]] == pytest.approx([lr_at(cfg, s) for s in range(case["steps"])])
        losses = [s["loss"] for s in r["results"]]
        assert losses == pytest.approx(ref["losses"], rel=1e-5)
        assert not any(s["skipped"] for s in r["results"])
        assert [s["norm"] for s in r["results"]] == pytest.approx(ref["norms"], rel=1e-5)
    _assert_params(per_rank, ref)


def test_optimizer_state_is_sharded_over_replicas(parity):
    # AdamW: two fp32 moments per parameter; d = 2 replicas.
    for idx, case in enumerate(PARITY[3:6], start=3):
        per_rank = [rank_out[idx] for rank_out in parity]
        for r in per_rank:
            unsharded = 2 * 4 * r["stage_numel"]
            expected = unsharded / 2 if case["cfg"]["zero_stage"] > 0 else unsharded
            assert r["state_bytes"] == pytest.approx(expected, rel=0.10), (case, r["state_bytes"])


@pytest.mark.parametrize("zero", STAGES)
def test_global_clipping_matches_single_process(other, zero):
    case = OTHER[STAGES.index(zero)]
    per_rank = [rank_out[STAGES.index(zero)] for rank_out in other]
    ref = reference(make_config(**case["cfg"]), case["steps"])
    assert min(ref["norms"]) > case["cfg"]["grad_clip"], "the case must actually clip"
    for r in per_rank:  # the reported norm is the pre-clip global norm, equal on every rank
        assert [s["norm"] for s in r["results"]] == pytest.approx(ref["norms"], rel=1e-5)
    _assert_params(per_rank, ref)


@pytest.mark.parametrize("zero", STAGES)
def test_fp16_overflow_skips_the_step_on_every_rank(other, zero):
    idx = 3 + STAGES.index(zero)
    case = OTHER[idx]
    per_rank = [rank_out[idx] for rank_out in other]
    for r in per_rank:
        assert [s["skipped"] for s in r["results"]] == [False, True, False]
        assert r["results"][1]["norm"] is None
        assert r["scales"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
        assert r["scaler"] == "LossScaler"   # the engine's one scaler, shared with torch's
    # The forward ran in fp32 here, so scaling by a power of two is exact: the surviving updates
    # must equal a single process that applied the data of steps 0 and 2 only.
    _assert_params(per_rank, reference(make_config(**case["cfg"]), [0, 2]))


def test_bf16_autocast_stays_close_to_fp32(other):
    idx = 6
    case = OTHER[idx]
    per_rank = [rank_out[idx] for rank_out in other]
    ref32 = reference(make_config(**case["cfg"]), case["steps"])
    ref16 = reference(make_config(**case["cfg"]), case["steps"], autocast=torch.bfloat16)
    for r in per_rank:
        assert all(p.dtype == torch.float32 for p in r["params"].values()), "master weights stay fp32"
        losses = [s["loss"] for s in r["results"]]
        assert losses == pytest.approx(ref16["losses"], rel=1e-3)
        assert losses == pytest.approx(ref32["losses"], rel=3e-2)


@pytest.mark.parametrize("pos", range(3))
def test_state_dict_round_trip_resumes_exactly(other, pos):
    idx = 7 + pos
    case = OTHER[idx]
    per_rank = [rank_out[idx] for rank_out in other]
    ref = reference(make_config(**case["cfg"]), 3)
    _assert_params(per_rank, ref, rtol=1e-6, atol=1e-7)
    for r in per_rank:
        before, after = r["lr"]
        assert before == after
        if case["cfg"].get("warmup_steps"):  # linear warm-up over 2 steps, then the base lr
            assert after == pytest.approx(case["cfg"]["lr"])
        sd = r["state"]
        assert sd["steps"] == 2
        expected = {"exp_avg", "exp_avg_sq", "step"} if case["cfg"]["name"] == "adamw" else {"momentum_buffer"}
        assert sd["state"] and all(set(e) == expected for e in sd["state"].values())
    # gathered (full) state is identical on the two replicas of each stage
    for a, b in ((0, 2), (1, 3)):
        sa, sb = per_rank[a]["state"]["state"], per_rank[b]["state"]["state"]
        assert sa.keys() == sb.keys()
        for name in sa:
            for k in sa[name]:
                torch.testing.assert_close(sa[name][k], sb[name][k], rtol=0, atol=0)


def test_fp32_nonfinite_raises_or_skips_on_every_rank(other):
    raised = [rank_out[10] for rank_out in other]
    for r in raised:
        assert r["results"][-1].get("raised") == "NonFiniteError", r["results"]
        assert "step 1" in r["results"][-1]["message"]
    case = OTHER[11]
    skipped = [rank_out[11] for rank_out in other]
    for r in skipped:
        assert [s["skipped"] for s in r["results"]] == [False, True, False]
    _assert_params(skipped, reference(make_config(**case["cfg"]), [0, 2]))


def test_zero2_with_cross_stage_ties_is_refused():
    from engine.zero import DeepSpeedStageOptimizer

    module = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2)})
    with pytest.raises(ValueError, match="zero_stage=2 cannot be used with parameters tied"):
        DeepSpeedStageOptimizer(make_config(**SGD, zero_stage=2), module, dp_group=None,
                                pipeline_group=None, microbatches=2, precision="fp32",
                                norm_skip=["0.weight"])


@pytest.mark.parametrize("bad, match", [
    (dict(zero_stage=3), "zero_stage=3 runs on torch's FSDP2, not the deepspeed backend"),
    (dict(zero_stage=4), "zero_stage=4 is not supported"),
    (dict(name="lamb"), "optimizer 'lamb' is not supported"),
])
def test_bad_configs_are_refused(bad, match):
    from engine.zero import DeepSpeedStageOptimizer

    module = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2)})
    with pytest.raises(ValueError, match=match):
        DeepSpeedStageOptimizer(make_config(**{**SGD, "zero_stage": 1, **bad}), module, dp_group=None,
                                pipeline_group=None, microbatches=2, precision="fp32")


def test_zero2_bucket_reduces_are_the_walk_of_the_ranks_tensors(other):
    """engine.footprint.zero_reduces is DeepSpeed's bucketing: every bucket its ZeRO-2 reduces
    in a backward of each chunk (16-bit weights), with the gradient whose hook started the
    reduce; where it calls a reduce one tensor within one partition, every replica flattens one
    slice (a view), and each reduce it calls a copy flattens several on some replica."""
    from engine.footprint import zero_bucket_elements, zero_reduces

    sizes = other[0][WALK]["sizes"]
    want = zero_reduces(sizes, 2)
    bucket = zero_bucket_elements(sum(map(sum, sizes)), 2)
    assert {bool(t) for _, t, _, _ in want} == {True, False}, "a hook's reduce and an epilogue's"
    assert {one for _, _, one, _ in want} == {True, False}, "a view and a copy"
    for r in other:
        assert r[WALK]["sizes"] == sizes
        got = sorted((n, t) for n, t, _ in r[WALK]["reduces"] if n <= bucket)
        assert got == sorted((int(e), int(t)) for e, t, _, _ in want)
    for e, t, one, _ in want:
        slices = [s for r in other for n, tt, s in r[WALK]["reduces"] if (n, tt) == (e, t)]
        assert (max(slices) == 1) if one else (max(slices) > 1), (e, t, one, slices)
