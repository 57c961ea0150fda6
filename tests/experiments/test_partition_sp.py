"""`model.sequence_parallel=auto` and `pipeline.recompute_granularity=auto`: the planner chooses
them (`experiments.partition`, tiny analytic models), records the choice in the plan, prints it in
the layout line and writes it into the resolved config; explicit values stay overrides. The GPT
under sequence parallelism is planned on its tp-rank shapes with the sequence-parallel profile."""
from __future__ import annotations

import json

import pytest

from experiments.config import ConfigError, validate_config
from experiments.partition import layout_line, run, validate_plan_config
from experiments.wiring import make_plan, profile_model, resolve_layout, search_kwargs, tp_model_spec
from partitioner import PartitionError

LLAMA = ("model=hf_llama", "model.layers=4", "model.dim=64", "model.heads=8", "model.kv_heads=4", "model.vocab=256",
         "model.seq_len=256", "model.intermediate=128", "model.tie_embeddings=false", "partitioner.profile=analytic",
         "partitioner.device_spec=h100", "precision=bf16", "train.batch_size=16", "pipeline.microbatches=4",
         "pipeline.schedule=1f1b", "data=synthetic", "logger.mode=disabled", "pipeline.tensor_parallel=2")


def _peak(cfg) -> int:
    cfg = validate_plan_config(cfg)
    return max(make_plan(cfg, tp_model_spec(cfg)).rank_memory_bytes)


def test_auto_plans_sequence_parallelism_where_only_it_fits(compose_cfg, tmp_path, capsys):
    limit = _peak(compose_cfg(*LLAMA, "model.sequence_parallel=true"))
    at = f"partitioner.memory_limit={limit}B"
    with pytest.raises(PartitionError):   # the premise: without sequence parallelism nothing fits
        _peak(compose_cfg(*LLAMA, at))
    cfg = compose_cfg(*LLAMA, at, "model.sequence_parallel=auto")
    assert search_kwargs(cfg)["sequence_parallel"] == "auto"
    run(cfg, tmp_path)
    assert "sequence_parallel=true" in capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["sequence_parallel"] is True and plan["tensor_parallel"] == 2 and max(plan["rank_memory_bytes"]) <= limit
    from partitioner import Plan

    resolved = resolve_layout(cfg, Plan.from_dict(plan))
    assert resolved.model.sequence_parallel is True
    # an explicit false is kept: nothing fits
    with pytest.raises(PartitionError):
        run(compose_cfg(*LLAMA, at, "model.sequence_parallel=false", "pipeline.schedule=auto"), tmp_path / "off")


def test_auto_plans_per_layer_recompute_where_only_it_fits(compose_cfg, tmp_path, capsys):
    ckpt = ("pipeline.activation_checkpointing=true",)
    limit = _peak(compose_cfg(*LLAMA, *ckpt, "pipeline.recompute_granularity=layer"))
    at = f"partitioner.memory_limit={limit}B"
    with pytest.raises(PartitionError):   # the premise: chunk checkpoints do not fit
        _peak(compose_cfg(*LLAMA, *ckpt, at))
    cfg = compose_cfg(*LLAMA, *ckpt, at, "pipeline.recompute_granularity=auto")
    run(cfg, tmp_path)
    out = capsys.readouterr().out
    assert "recompute_granularity=layer (2 of 2 chunks recompute)" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["recompute_granularity"] == "layer"
    from partitioner import Plan

    assert str(resolve_layout(cfg, Plan.from_dict(plan)).pipeline.recompute_granularity) == "layer"
    with pytest.raises(PartitionError):   # an explicit chunk is kept
        run(compose_cfg(*LLAMA, *ckpt, at, "pipeline.recompute_granularity=chunk", "pipeline.schedule=auto"),
            tmp_path / "chunk")


def test_auto_values_are_checked(compose_cfg):
    validate_config(compose_cfg("model.sequence_parallel=auto", "pipeline.recompute_granularity=auto"))
    validate_config(compose_cfg("pipeline.tensor_parallel=2", "model.sequence_parallel=auto"))  # training searches
    with pytest.raises(ConfigError, match="choose true"):
        validate_config(compose_cfg("model.sequence_parallel=sometimes"))
    # phi3's plan cannot split the sequence: auto plans it without, true is refused
    phi3 = (*LLAMA, "model.arch=phi3")
    assert search_kwargs(compose_cfg(*phi3, "model.sequence_parallel=auto"))["sequence_parallel"] is False
    assert layout_line(compose_cfg(*LLAMA), None).endswith("sequence_parallel=false")


def test_gpt_sequence_parallel_is_planned_on_tp_rank_shapes(compose_cfg):
    """GPT, tp = 2 with sequence parallelism: its tp-rank shapes, every output but the head's
    halved, each block one residual stream less per LayerNorm (2 x 1/2), the head a half."""
    base = ("experiment=smoke", "partitioner.profile=analytic", "pipeline.schedule=1f1b", "pipeline.tensor_parallel=2")
    plain, sp = compose_cfg(*base), compose_cfg(*base, "model.sequence_parallel=true")
    whole, split = profile_model(plain, tp_model_spec(plain)), profile_model(sp, tp_model_spec(sp))
    assert [c.output_bytes // 2 for c in whole.layers[:-1]] == [c.output_bytes for c in split.layers[:-1]]
    stream = whole.layers[0].output_bytes
    fewer = [0, *[stream] * (len(whole) - 2), stream // 2]
    assert [c.activation_bytes - f for c, f in zip(whole.layers, fewer)] == [c.activation_bytes for c in split.layers]
    plan = make_plan(sp, tp_model_spec(sp))
    assert plan.tensor_parallel == 2 and plan.sequence_parallel and not any("tensor_parallel=1" in n for n in plan.notes)


def _norm_saves(norm, dtype, autocast: bool = False) -> float:
    """Residual-stream-sized tensors `norm` saves for backward on an input of `dtype`, in units
    of that input (deduplicated by storage, parameters left out)."""
    import torch

    x = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
    norm = norm.to(dtype)
    seen: dict = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    big = x.numel() * x.element_size()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                norm(x)
        else:
            norm(x)
    return sum(v for v in seen.values() if v >= big // 2) / big


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-autocast"])
def test_the_norm_rule_counts_what_the_norms_save(compose_cfg, precision):
    """`sp_norm_tensors` is what the norms save on a residual stream of the run's dtype: the HF
    RMSNorm 2 (fp32, autocast: 4-byte stream) or 3 (16-bit weights: its fp32 upcast is two
    units), the GPT's LayerNorm 1. Sequence parallelism splits all of them."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from experiments.wiring import sp_norm_tensors

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    auto = precision.endswith("autocast")
    cfg = compose_cfg(*LLAMA, f"precision={precision}")
    assert sp_norm_tensors(cfg) == _norm_saves(LlamaRMSNorm(64), dtype, auto)
    gpt = compose_cfg("experiment=smoke", f"precision={precision}")
    assert sp_norm_tensors(gpt) == _norm_saves(torch.nn.LayerNorm(64), dtype, auto)


def test_a_training_run_takes_the_chosen_granularity(compose_cfg):
    """tp = 1, `pipeline.recompute_granularity=auto` with every chunk recomputing: the plan
    chooses (the less memory at the same step), `resolve_layout` writes it, the engine gets it."""
    from experiments.config import searches
    from experiments.models import build_model
    from experiments.wiring import pipeline_kwargs

    cfg = compose_cfg("experiment=smoke", "partitioner.profile=analytic", "pipeline.activation_checkpointing=true",
                      "pipeline.recompute_granularity=auto")
    assert searches(cfg)
    plan = make_plan(cfg, build_model(cfg.model))
    assert plan.search is not None and all(plan.stage_recompute)
    resolved = resolve_layout(cfg, plan)
    kw = pipeline_kwargs(resolved, plan.stage_ranges, recompute=plan.stage_recompute)
    assert kw["recompute_granularity"] == plan.recompute_granularity in ("chunk", "layer")


def test_a_searched_plan_of_a_profile_already_under_sequence_parallelism(compose_cfg):
    """`make_plan` with the profile `profile_model` made (sequence parallelism applied once) and a
    searched layout: planned as it is, not divided again."""
    cfg = validate_plan_config(compose_cfg(*LLAMA, "model.sequence_parallel=true", "pipeline.schedule=auto"))
    spec = tp_model_spec(cfg)
    prof = profile_model(cfg, spec)
    plan = make_plan(cfg, spec, prof)
    assert plan.sequence_parallel and plan.search is not None
