"""The typed configuration: composed by Hydra, turned into the schema's dataclasses once
(`as_config`, `OmegaConf.to_object`), validated on that object, handed down whole (picklable
into workers), and still refused at composition when a key or type is wrong."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from hydra.errors import ConfigCompositionException

from experiments.config import (Config, ConfigError, GPTConfig, HFDataConfig, HFModelConfig, MLPConfig,
                                OptimizerName, PipelineConfig, ScheduleName, SyntheticDataConfig, TextDataConfig, TrainConfig,
                                as_config, load_config, model_config, to_plain_dict, validate_config)


def test_compose_then_to_object_gives_the_dataclasses(compose_cfg):
    cfg = as_config(compose_cfg("pipeline.stages=3", "optimizer=sgd", "model.layers=5"))
    assert type(cfg) is Config and type(cfg.model) is GPTConfig and type(cfg.data) is TextDataConfig
    assert type(cfg.pipeline) is PipelineConfig and cfg.pipeline.stages == 3 and cfg.model.layers == 5
    assert cfg.optimizer.name is OptimizerName["sgd"] and cfg.pipeline.schedule is ScheduleName["1f1b"]
    assert as_config(cfg) is cfg  # the typed object is passed on as it is
    llama = as_config(compose_cfg("model=hf_llama", "data=synthetic"))
    assert type(llama.model) is HFModelConfig and llama.model.arch == "llama" and llama.model.kv_heads == 2
    mlp = as_config(compose_cfg("model=mlp", "data=synthetic"))
    assert type(mlp.model) is MLPConfig and type(mlp.data) is SyntheticDataConfig


def test_union_and_any_fields_keep_their_values(compose_cfg):
    """activation_checkpointing is bool or "auto"; microbatches an int or "auto"."""
    auto = as_config(compose_cfg("pipeline.activation_checkpointing=auto", "pipeline.microbatches=auto"))
    assert auto.pipeline.activation_checkpointing == "auto" and auto.pipeline.microbatches == "auto"
    plain = as_config(compose_cfg("pipeline.activation_checkpointing=true", "pipeline.microbatches=8"))
    assert plain.pipeline.activation_checkpointing is True and plain.pipeline.microbatches == 8


def test_recompute_granularity_is_a_choice_the_planner_and_the_engine_get(compose_cfg):
    """`pipeline.recompute_granularity`: chunk by default (today's behaviour), layer on request,
    handed to `partitioner.partition` and to `engine.Pipeline` alike."""
    from experiments.wiring import partition_kwargs, pipeline_kwargs

    default = as_config(compose_cfg())
    assert default.pipeline.recompute_granularity == "chunk"
    assert pipeline_kwargs(default, [(0, 3), (3, 6)])["recompute_granularity"] == "chunk"
    cfg = as_config(compose_cfg("pipeline.recompute_granularity=layer", "pipeline.activation_checkpointing=true"))
    assert partition_kwargs(cfg)["recompute_granularity"] == "layer"
    assert pipeline_kwargs(cfg, [(0, 3), (3, 6)])["recompute_granularity"] == "layer"


def test_validate_config_runs_on_the_typed_object_and_returns_it(compose_cfg):
    cfg = as_config(compose_cfg())
    assert validate_config(cfg) is cfg
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=18))
    with pytest.raises(ConfigError, match="train.batch_size=18"):
        validate_config(bad)
    assert load_config("experiment=smoke").name == "smoke"
    with pytest.raises(ConfigError, match="pipeline.stages"):
        load_config("pipeline.stages=9")


@pytest.mark.parametrize("overrides", [["model.layrs=3"], ["pipeline.stage=3"], ["train.steps=many"],
                                       ["pipeline.schedule=1f1f"], ["pipeline.activation_checkpointing=maybe"]])
def test_a_bad_key_or_type_still_fails_at_composition(overrides):
    with pytest.raises(ConfigCompositionException):
        load_config(*overrides)


def test_the_typed_config_pickles_and_has_a_plain_form(compose_cfg):
    """Workers (engine.launch, submitit) get it pickled; W&B and JSON get plain dicts."""
    cfg = as_config(compose_cfg("model=hf_llama", "data=synthetic", "pipeline.microbatches=auto",
                                "pipeline.activation_checkpointing=auto"))
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and back.pipeline.schedule is ScheduleName["1f1b"]
    plain = to_plain_dict(cfg)
    assert plain == to_plain_dict(compose_cfg("model=hf_llama", "data=synthetic", "pipeline.microbatches=auto",
                                              "pipeline.activation_checkpointing=auto"))
    assert type(plain["pipeline"]["schedule"]) is str and plain["model"]["arch"] == "llama"
    assert as_config(plain) == cfg  # a saved plain config types back to the same object


def test_plain_dicts_take_the_schema_defaults_and_refuse_unknown_keys():
    cfg = as_config({"model": {"name": "gpt", "layers": 2}, "data": {"name": "hf", "files": "a.txt"}})
    assert cfg.model == GPTConfig(layers=2) and type(cfg.data) is HFDataConfig and cfg.train == TrainConfig()
    assert model_config({"name": "mlp"}) == MLPConfig()
    with pytest.raises(ConfigError, match="model.layrs"):
        as_config({"model": {"name": "gpt", "layrs": 2}})
    with pytest.raises(ConfigError, match="unknown model='resnet'"):
        model_config({"name": "resnet"})


def test_the_default_run_reads_no_hydra_node(compose_cfg):
    """Hydra's own `hydra` node is not part of the experiment config (HydraConfig holds it)."""
    assert "hydra" not in to_plain_dict(as_config(compose_cfg()))


_SCHEMA_OF = {"model/gpt": "GPTConfig", "model/mlp": "MLPConfig", "model/hf": "HFModelConfig",
              "model/hf_gpt2": "HFModelConfig", "model/hf_llama": "HFModelConfig", "data/text": "TextDataConfig",
              "data/synthetic": "SyntheticDataConfig", "data/hf": "HFDataConfig", "pipeline/default": "PipelineConfig",
              "partitioner/default": "PartitionerConfig", "optimizer/adamw": "OptimConfig",
              "optimizer/adam": "OptimConfig", "optimizer/sgd": "OptimConfig", "logger/wandb": "LoggerConfig",
              "generate/default": "GenerateConfig"}


def _leaves(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("option", sorted(_SCHEMA_OF))
def test_group_yaml_sets_only_what_differs_from_the_dataclass(option):
    """Defaults live in the dataclass fields alone: a group option's YAML holds only its preset
    (values that differ, or Hydra interpolations), never a copy of a default that could drift."""
    from omegaconf import OmegaConf

    from experiments import config as schema

    raw = OmegaConf.to_container(OmegaConf.load(schema.CONF_DIR / f"{option}.yaml"), resolve=False)
    defaults = to_plain_dict(getattr(schema, _SCHEMA_OF[option])())
    for key, value in _leaves({k: v for k, v in (raw or {}).items() if k != "defaults"}).items():
        node = defaults
        for part in key.split("."):
            node = node[part]
        assert (isinstance(value, str) and value.startswith("${")) or value != node, \
            f"conf/{option}.yaml repeats the default {key}={value!r}; remove it (the dataclass holds it)"


def test_the_primary_yaml_holds_no_defaults():
    from omegaconf import OmegaConf

    from experiments.config import CONF_DIR

    assert set(OmegaConf.load(CONF_DIR / "config.yaml").keys()) <= {"defaults", "hydra"}
