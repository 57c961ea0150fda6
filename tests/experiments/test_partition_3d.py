"""`experiments.partition` with the 3-D keys: ZeRO-3 planned as ZeRO-3 (reshard policy chosen or
overridden), `pipeline.tensor_parallel` planned on one tp rank's shapes, the 3-D search
(`partitioner.search.tensor_parallel` / `zero_stages`), composed through Hydra's compose API."""
from __future__ import annotations

import json

import pytest

from experiments.config import ConfigError
from experiments.partition import layout_line, run, validate_plan_config
from experiments.wiring import engine_optimizer_kwargs, partition_kwargs, tp_model_spec

TINY = ("model=hf_llama", "model.layers=4", "model.dim=64", "model.heads=8", "model.kv_heads=4", "model.vocab=256",
        "model.seq_len=32", "model.intermediate=128", "model.tie_embeddings=false", "partitioner.profile=analytic",
        "partitioner.device_spec=h100", "precision=bf16", "train.batch_size=16", "pipeline.microbatches=4",
        "data=synthetic", "logger.mode=disabled")


def test_zero3_and_tp_planned_and_printed(compose_cfg, tmp_path, capsys):
    cfg = compose_cfg(*TINY, "pipeline.data_parallel=2", "pipeline.tensor_parallel=2", "optimizer.zero_stage=3")
    out = run(cfg, tmp_path)
    text = capsys.readouterr().out
    assert "layout: pp2 x dp2 x tp2 = 8 GPUs; ZeRO-3 (FSDP2), reshard_after_forward=false" in text
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["zero_stage"] == 3 and plan["tensor_parallel"] == 2 and plan["reshard_after_forward"] is False
    assert all("gathered_parameters" in b for b in plan["rank_memory_breakdown"])
    assert json.loads((tmp_path / "profile.json").read_text())["meta"]["tensor_parallel"] == 2
    assert out["plans"]["optimal"].rank_collective_s[0] > 0   # the h100 spec's links: ZeRO-3's collectives


def test_tp_rank_shapes_shard_everything_but_the_norms(compose_cfg):
    cfg = validate_plan_config(compose_cfg(*TINY, "pipeline.tensor_parallel=2"))
    whole, half = tp_model_spec(cfg, 1), tp_model_spec(cfg)
    norms = 4 * 2 * 64 + 64   # two RMSNorms per block and the final one: replicated on every tp rank
    assert half.num_params - norms == pytest.approx((whole.num_params - norms) / 2)


def test_tp_that_does_not_divide_is_refused_with_the_fix(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, "pipeline.tensor_parallel=3")
    with pytest.raises(ConfigError, match="does not divide model.heads=8"):
        run(cfg, tmp_path)
    with pytest.raises(ConfigError, match="Llama-style"):   # no tp-rank shapes for GPT-NeoX
        run(compose_cfg("model=hf", "model.arch=gpt_neox", "model.tie_embeddings=false", "partitioner.profile=analytic",
                        "data=synthetic", "pipeline.tensor_parallel=2"), tmp_path)


def test_reshard_override_and_the_engine_follows_the_plan(compose_cfg):
    cfg = compose_cfg(*TINY, "pipeline.data_parallel=2", "optimizer.zero_stage=3",
                      "optimizer.reshard_after_forward=true")
    kw = partition_kwargs(cfg)
    assert kw["zero_stage"] == 3 and kw["reshard_after_forward"] is True and kw["links"] is not None

    class Chosen:
        reshard_after_forward = False

    auto = compose_cfg(*TINY, "pipeline.data_parallel=2", "optimizer.zero_stage=3")
    assert partition_kwargs(auto)["reshard_after_forward"] is None
    assert engine_optimizer_kwargs(auto, Chosen())["reshard_after_forward"] == "false"
    assert str(engine_optimizer_kwargs(cfg, Chosen())["reshard_after_forward"]).lower() == "true"   # the override wins
    assert layout_line(cfg, None).endswith("reshard_after_forward=true")


def test_search_chooses_tp_and_zero_stage(compose_cfg, tmp_path, capsys):
    cfg = compose_cfg(*TINY, "pipeline.data_parallel=2", "pipeline.tensor_parallel=2", "pipeline.schedule=auto",
                      "pipeline.microbatches=auto", "partitioner.search.tensor_parallel=[1,2,4]",
                      "partitioner.search.zero_stages=[1,3]", "partitioner.search.schedules=[1f1b,zb-h1]")
    run(cfg, tmp_path)
    text = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    chosen = plan["search"]["chosen"]
    assert {(r["data_parallel"], r["tensor_parallel"]) for r in plan["search"]["candidates"]} == {(4, 1), (2, 2), (1, 4)}
    assert (plan["tensor_parallel"], plan["data_parallel"]) == (chosen["tensor_parallel"], chosen["data_parallel"])
    assert plan["zero_stage"] == chosen["zero_stage"]
    tp, dp = plan["tensor_parallel"], plan["data_parallel"]
    assert f"layout: pp2 x dp{dp} x tp{tp} = 8 GPUs; ZeRO-{plan['zero_stage']}" in text
    assert "dp x tp" in text


def test_a_searched_layout_the_run_cannot_use_is_refused_with_the_fix(compose_cfg):
    """The training run checks the planner's layout as it checks an explicit one: a 3-D search
    that chose tp = 2 under 16-bit weights is refused, naming both fixes."""
    from experiments.config import ConfigError
    from experiments.job import _checked_choice

    ok = compose_cfg("pipeline.tensor_parallel=2")
    assert _checked_choice(ok) is not None
    with pytest.raises(ConfigError, match="planner chose a layout.*precision=bf16-autocast.*tensor_parallel / zero_stages"):
        _checked_choice(compose_cfg("pipeline.tensor_parallel=2", "precision=bf16"))
