"""experiments.wiring: the config turns into arguments the partitioner and engine accept."""

from __future__ import annotations

import inspect

import pytest

import engine
import partitioner
from experiments.config import ConfigError
from experiments.models import build_model
from experiments.wiring import (
    checkpoint_root,
    engine_optimizer_kwargs,
    make_plan,
    microbatch_size,
    partition_kwargs,
    pipeline_kwargs,
    plan_matches,
    profile_kwargs,
    resume_checkpoint,
    run_name,
    world_size,
)



def test_names_and_sizes(compose_cfg):
    cfg = compose_cfg("pipeline.data_parallel=2", "train.batch_size=32", "pipeline.schedule=zb-h1")
    assert microbatch_size(cfg) == 4 and world_size(cfg) == 4
    assert run_name(cfg) == "default-zb-h1-p2-d2"
    assert run_name(compose_cfg("logger.run_name=mine")) == "mine"


def test_partition_kwargs_are_plain_and_accepted_by_partition(compose_cfg):
    cfg = compose_cfg("experiment=smoke", "partitioner.memory_limit=1GiB", "partitioner.profile=analytic")
    kwargs = partition_kwargs(cfg)
    assert kwargs["schedule"] == "1f1b" and type(kwargs["schedule"]) is str
    assert kwargs["memory_limit_bytes"] == 2**30
    spec = build_model(cfg.model)
    prof = partitioner.profile(spec.layers, spec.example_input(microbatch_size(cfg)), **profile_kwargs(cfg))
    plan = partitioner.partition(prof, **kwargs)
    assert len(plan.stage_ranges) == cfg.pipeline.stages
    assert plan.stage_ranges[0][0] == 0 and plan.stage_ranges[-1][1] == len(spec.layers)


def test_attention_backend_reaches_the_analytic_profile(compose_cfg):
    base = ("experiment=smoke", "partitioner.profile=analytic", "partitioner.device_spec=h100")
    assert profile_kwargs(compose_cfg(*base))["attention"] is None          # the device spec's
    kw = profile_kwargs(compose_cfg(*base, "partitioner.attention=math"))
    assert kw["attention"] == "math" and type(kw["attention"]) is str
    spec = build_model(compose_cfg(*base).model)
    x = spec.example_input(1)
    assert partitioner.profile(spec.layers, x, **kw).meta["attention"] == "math"
    with pytest.raises(Exception, match="attention"):
        compose_cfg(*base, "partitioner.attention=cudnn")


def test_pipeline_and_optimizer_kwargs_match_the_engine_signatures(compose_cfg):
    cfg = compose_cfg("precision=bf16", "optimizer=sgd")
    spec = build_model(cfg.model)
    kwargs = pipeline_kwargs(cfg, [(0, 3), (3, 6)], ties=spec.ties)
    params = inspect.signature(engine.Pipeline.__init__).parameters
    assert set(kwargs) <= set(params), set(kwargs) - set(params)
    assert kwargs["precision"] == "bf16" and type(kwargs["schedule"]) is str
    opt = engine.OptimizerConfig(**engine_optimizer_kwargs(cfg))
    assert opt.name == "sgd" and opt.momentum == 0.9 and isinstance(opt.betas, tuple)


def test_pipeline_kwargs_validates_first(compose_cfg):
    with pytest.raises(ConfigError, match="multiple of 4"):
        pipeline_kwargs(compose_cfg("train.batch_size=6"), [(0, 3), (3, 6)])


def _fake_checkpoint(root, step: int) -> None:
    d = root / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    (root / "latest").write_text(d.name)


def test_checkpoint_root_and_resume_modes(compose_cfg, tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose_cfg("experiment=smoke")
    assert checkpoint_root(cfg, run_dir) == run_dir / "checkpoints"
    assert checkpoint_root(compose_cfg(f"checkpoint.dir={tmp_path / 'elsewhere'}"), run_dir) == tmp_path / "elsewhere"
    assert resume_checkpoint(cfg, run_dir) is None  # default true, but nothing to resume yet
    _fake_checkpoint(run_dir / "checkpoints", 2)
    _fake_checkpoint(run_dir / "checkpoints", 4)
    assert resume_checkpoint(cfg, run_dir) == run_dir / "checkpoints" / "step_000004"
    assert resume_checkpoint(compose_cfg("checkpoint.resume=true"), run_dir).name == "step_000004"
    assert resume_checkpoint(compose_cfg("checkpoint.resume=false"), run_dir) is None
    other = tmp_path / "other" / "checkpoints"
    _fake_checkpoint(other, 7)
    assert resume_checkpoint(compose_cfg(f"checkpoint.resume={other}"), run_dir) == other / "step_000007"
    assert resume_checkpoint(compose_cfg(f"checkpoint.resume={other / 'step_000007'}"), run_dir).name == "step_000007"
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        resume_checkpoint(compose_cfg(f"checkpoint.resume={tmp_path / 'nothing'}"), run_dir)


def test_make_plan_and_plan_matches(compose_cfg):
    cfg = compose_cfg("experiment=smoke", "partitioner.method=uniform", "partitioner.profile=analytic",
                   "partitioner.device_spec=h100")
    spec = build_model(cfg.model)
    plan = make_plan(cfg, spec)
    assert plan.stage_ranges == [(0, 2), (2, 4)] and plan.method == "uniform"
    assert plan_matches(plan, cfg, len(spec.layers))
    assert not plan_matches(plan, compose_cfg("experiment=smoke", "partitioner.method=uniform", "pipeline.stages=3"), 4)
    assert not plan_matches(plan, compose_cfg("experiment=smoke", "partitioner.method=optimal"), 4)
    assert make_plan(cfg, spec, method="greedy").method == "greedy"
