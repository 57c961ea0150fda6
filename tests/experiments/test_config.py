"""Hydra compose tests for every config group option and experiment preset, and validate_config."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from experiments.config import (
    CONF_DIR,
    Config,
    ConfigError,
    GPTConfig,
    HFModelConfig,
    MLPConfig,
    ScheduleName,
    count_pipeline_layers,
    optimizer_kwargs,
    parse_memory_limit,
    parse_size,
    to_plain_dict,
    validate_config,
)



def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_default_config_has_the_documented_keys_and_values(compose_cfg):
    cfg = compose_cfg()
    validate_config(cfg)
    assert cfg.pipeline.stages == 2 and cfg.pipeline.schedule == "1f1b"
    assert cfg.model.name == "gpt" and cfg.data.name == "text"
    assert cfg.logger.mode == "offline"
    assert cfg.optimizer.name == "adamw"
    assert str(cfg.precision) == "fp32"
    for key in ("pipeline.stages", "pipeline.schedule", "pipeline.microbatches", "pipeline.virtual_stages",
                "pipeline.data_parallel", "pipeline.activation_checkpointing", "partitioner.method",
                "partitioner.profile", "partitioner.memory_limit", "optimizer.name", "optimizer.lr",
                "optimizer.zero_stage", "optimizer.grad_clip", "optimizer.warmup_steps",
                "optimizer.weight_decay", "optimizer.momentum", "optimizer.betas", "precision",
                "model.layers", "model.dim", "model.heads", "model.vocab", "model.seq_len", "model.dropout",
                "train.steps", "train.batch_size", "train.seed", "train.log_every", "train.eval_every",
                "logger.mode", "logger.project", "checkpoint.every_steps", "checkpoint.dir",
                "checkpoint.keep_last"):
        assert OmegaConf.select(cfg, key, default="<absent>") != "<absent>", key


@pytest.mark.parametrize("group", ["model", "pipeline", "partitioner", "optimizer", "data", "logger"])
def test_every_group_option_composes(compose_cfg, group):
    options = _options(group)
    assert options, f"conf/{group} has no options"
    for option in options:
        extra = ["data=synthetic"] if (group, option) == ("model", "mlp") else []
        if (group, option) == ("data", "synthetic"):
            extra = []
        if (group, option) == ("data", "hf"):  # its files and tokenizer have no defaults
            extra = ["data.files=corpus.jsonl", "data.tokenizer=tokenizer_dir"]
        cfg = compose_cfg(f"{group}={option}", *extra)
        validate_config(cfg)


def test_model_options_have_their_schema_types(compose_cfg):
    assert OmegaConf.get_type(compose_cfg("model=gpt").model) is GPTConfig
    assert OmegaConf.get_type(compose_cfg("model=mlp", "data=synthetic").model) is MLPConfig
    llama = compose_cfg("model=hf_llama")
    assert OmegaConf.get_type(llama.model) is HFModelConfig and llama.model.arch == "llama"


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_experiment_preset_composes_and_validates(compose_cfg, preset):
    cfg = compose_cfg(f"experiment={preset}")
    validate_config(cfg)
    assert cfg.name == preset  # presets are global packages: they set top-level keys


def test_presets_exist():
    assert {"smoke", "gpt_small", "mlp_profile", "bench"} <= set(_options("experiment"))


def test_overrides_reach_typed_fields(compose_cfg):
    cfg = compose_cfg("pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2", "precision=bf16",
                   "partitioner.memory_limit=24GiB", "optimizer=sgd", "optimizer.lr=0.5")
    validate_config(cfg)
    assert cfg.pipeline.schedule is ScheduleName["interleaved-1f1b"]
    assert cfg.partitioner.memory_limit == "24GiB"
    assert optimizer_kwargs(cfg) == {**optimizer_kwargs(cfg), "name": "sgd", "lr": 0.5}
    plain = to_plain_dict(cfg)
    assert plain["pipeline"]["schedule"] == "interleaved-1f1b" and type(plain["precision"]) is str


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.layrs=3"],                       # misspelt key
        ["pipeline.stage=3"],                    # misspelt key
        ["train.steps=many"],                    # wrong type
        ["pipeline.activation_checkpointing=maybe"],
        ["model=mlp", "model.heads=3"],          # key of another model's schema
        ["model=transformer"],                   # unknown option
    ],
)
def test_bad_keys_and_types_fail_at_composition(compose_cfg, overrides):
    with pytest.raises(ConfigCompositionException):
        compose_cfg(*overrides)


@pytest.mark.parametrize(
    "override",
    ["pipeline.schedule=1F1B", "pipeline.schedule=pipedream", "partitioner.method=best",
     "partitioner.profile=guess", "optimizer.name=lamb", "precision=fp8", "logger.mode=on",
     "model=mlp,model.profile=diamond"],
)
def test_bad_choice_fails_at_composition(compose_cfg, override):
    with pytest.raises(ConfigCompositionException):
        compose_cfg(*override.split(","))


@pytest.mark.parametrize(
    "overrides, remedy",
    [
        (["train.batch_size=10"], "train.batch_size to a multiple of 4"),
        (["pipeline.data_parallel=2", "train.batch_size=12"], "multiple of 8"),
        (["pipeline.schedule=interleaved-1f1b"], "pass virtual_stages=2"),
        (["pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=2", "pipeline.stages=3",
          "pipeline.microbatches=4", "train.batch_size=12"], "use m=3 or 6"),
        (["pipeline.virtual_stages=2"], "pass virtual_stages=1"),
        (["pipeline.schedule=zbv"], "pass virtual_stages=2"),
        (["pipeline.schedule=zb-h2", "pipeline.virtual_stages=2"], "pass virtual_stages=1"),
        (["pipeline.stages=7"], "pipeline.stages<=6"),
        (["pipeline.schedule=interleaved-1f1b", "pipeline.virtual_stages=4"], "fewer stages"),
        (["partitioner.memory_limit='24 GB GB'"], "e.g. 24GiB"),
        (["partitioner.memory_limit=24XB"], "GiB"),
        (["partitioner.memory_limit='1GiB,2GiB,3GiB'"], "exactly 2"),
        (["optimizer.zero_stage=4"], "choose 0"),
        (["optimizer.zero_stage=3", "optimizer.backend=deepspeed"], "set optimizer.backend=auto"),
        (["pipeline.tensor_parallel=3"], "divides the attention heads"),
        (["pipeline.tensor_parallel=2", "model=mlp"], "has no tensor-parallel plan"),
        (["pipeline.tensor_parallel=2", "model=hf_gpt2", "model.tie_embeddings=false"],
         "'gpt2' ships no base_model_tp_plan"),
        (["pipeline.tensor_parallel=2", "model=hf_llama", "model.tie_embeddings=false", "model.kv_heads=1"],
         "does not divide model.kv_heads=1"),
        (["pipeline.tensor_parallel=2", "model=hf_llama", "model.tie_embeddings=false", "model.arch=qwen3",
          "optimizer.zero_stage=3"], "replicated_with_grad_allreduce"),
        (["pipeline.tensor_parallel=2", "model=hf_llama", "model.tie_embeddings=false", "model.arch=phi3",
          "model.sequence_parallel=true"], "'phi3' is not one whose decoder layer"),
        (["pipeline.tensor_parallel=2", "model=hf_llama", "model.tie_embeddings=false",
          "model.sequence_parallel=true", "model.seq_len=33"], "does not divide model.seq_len=33"),
        (["model.vocab=128"], "model.vocab>=256"),
        (["model=mlp"], "data=synthetic"),
        (["model.heads=3"], "heads dividing dim"),
        (["optimizer.backend=torch", "optimizer.zero_stage=1"], "optimizer.backend=auto"),
        (["optimizer.lr=0"], "optimizer.lr=3e-3"),
        (["partitioner.profile=analytic", "partitioner.device_spec=h100", "partitioner.gpus_per_node=0"],
         "e.g. partitioner.gpus_per_node=8"),
        (["partitioner.profile=analytic", "partitioner.device_spec=h100", "partitioner.gpus_per_node=-4"],
         "or null for the device spec's own"),
        (["partitioner.gpus_per_node=8"], "partitioner.profile=measure (measured layers"),
        (["partitioner.profile=analytic", "partitioner.gpus_per_node=8"], "partitioner.device_spec=null"),
        (["partitioner.profile=analytic", "partitioner.device_spec=cpu", "partitioner.gpus_per_node=8"],
         "partitioner.device_spec=cpu has no links"),
    ],
)
def test_validate_config_rejects_with_a_remedy(compose_cfg, overrides, remedy):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert remedy in str(err.value)
    assert isinstance(err.value, ValueError)


def test_validate_config_checks_precision_outside_hydra(compose_cfg):
    cfg = to_plain_dict(compose_cfg())
    cfg["precision"] = "fp16,bf16"
    with pytest.raises(ConfigError, match="exactly one"):
        validate_config(cfg)


def test_validate_accepts_a_dataclass():
    cfg = Config(model=GPTConfig(), data=__import__("experiments.config").config.TextDataConfig())
    validate_config(cfg)


@pytest.mark.parametrize(
    "text, expected",
    [("24GiB", 24 * 2**30), ("24 GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("1.5KiB", 1536),
     ("100KB", 100_000), ("4096", 4096), ("4096B", 4096), (2048, 2048), ("1e3MB", 10**9)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-1GiB", "0", "24 G iB"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError):
        parse_size(text)


def test_parse_memory_limit_forms():
    assert parse_memory_limit(None) is None and parse_memory_limit("null") is None
    assert parse_memory_limit("1MiB,2MiB") == [2**20, 2 * 2**20]


def test_count_pipeline_layers(compose_cfg):
    assert count_pipeline_layers(compose_cfg().model) == 4 + 2
    assert count_pipeline_layers(compose_cfg("model=mlp", "data=synthetic", "model.depth=5").model) == 7
    assert count_pipeline_layers({"name": "mlp", "widths": [1, 2, 3], "depth": 99}) == 5
    assert count_pipeline_layers(compose_cfg("model=hf_gpt2", "model.layers=3").model) == 5


def test_every_engine_schedule_is_a_config_choice(compose_cfg):
    from engine.schedules import SCHEDULE_INFO

    assert [m.value for m in ScheduleName] == [*SCHEDULE_INFO, "auto"]  # every engine schedule, or the planner's
    for name, info in SCHEDULE_INFO.items():
        cfg = compose_cfg(f"pipeline.schedule={name}", f"pipeline.virtual_stages={info.virtual_stages(2)}")
        validate_config(cfg)


@pytest.mark.parametrize("overrides", [
    ["pipeline.schedule=auto"],
    ["pipeline.schedule=auto", "pipeline.microbatches=auto"],
    ["pipeline.microbatches=auto"],
    ["pipeline.schedule=zbv", "pipeline.virtual_stages=2", "pipeline.microbatches=auto"],
    ["pipeline.schedule=auto", "pipeline.max_inflight=3", "partitioner.search.schedules=[zb-h2,zbv]"],
    ["pipeline.schedule=auto", "partitioner.search.max_virtual_stages=3", "partitioner.search.max_microbatches=8",
     "partitioner.search.top=3", "partitioner.memory_limit=1GiB"],
    ["pipeline.schedule=zb-h2", "pipeline.max_inflight=2"],
])
def test_the_planner_can_choose_the_layout(compose_cfg, overrides):
    from experiments.config import configured_microbatches, searches

    cfg = compose_cfg(*overrides)
    validate_config(cfg)
    auto = "pipeline.schedule=auto" in overrides or "pipeline.microbatches=auto" in overrides
    assert searches(cfg) is auto
    assert (configured_microbatches(cfg) is None) is ("pipeline.microbatches=auto" in overrides)


@pytest.mark.parametrize("overrides, remedy", [
    (["pipeline.microbatches=many"], "pipeline.microbatches=auto"),
    (["pipeline.microbatches=auto", "train.batch_size=1"], "train.batch_size=2"),
    (["pipeline.microbatches=auto", "pipeline.data_parallel=2", "train.batch_size=7"], "multiple of 4 (e.g. train.batch_size=8)"),
    (["pipeline.schedule=auto", "pipeline.max_inflight=7"], "2 * num_stages - 1 (3"),
    (["pipeline.schedule=auto", "pipeline.max_inflight=3", "partitioner.search.schedules=[1f1b]"], "add it"),
    (["pipeline.schedule=auto", "partitioner.search.schedules=[1f1b,pipedream]"], "unknown schedules ['pipedream']"),
    (["pipeline.schedule=auto", "partitioner.search.max_virtual_stages=1"], "must be >= 2"),
    (["pipeline.schedule=1f1b", "pipeline.max_inflight=3"], "drop it for '1f1b'"),
])
def test_bad_search_settings_are_refused_with_a_remedy(compose_cfg, overrides, remedy):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_cfg(*overrides))
    assert remedy in str(err.value)


def test_tensor_parallel_layouts_that_run_are_accepted(compose_cfg):
    """pipeline.tensor_parallel=2 on GPT and a Llama-style HF model (with sequence parallelism),
    and on a Llama (ZeRO-3 too)."""
    validate_config(compose_cfg("pipeline.tensor_parallel=2", "model.sequence_parallel=true"))
    for arch in ("llama", "qwen3"):
        validate_config(compose_cfg("pipeline.tensor_parallel=2", "model=hf_llama", "model.tie_embeddings=false",
                                    f"model.arch={arch}", "model.sequence_parallel=true"))
    validate_config(compose_cfg("pipeline.tensor_parallel=2", "model=hf_llama", "model.tie_embeddings=false",
                                "model.sequence_parallel=true", "optimizer.zero_stage=3"))
    validate_config(compose_cfg("pipeline.tensor_parallel=2", "model=hf_llama", "model.tie_embeddings=false",
                                "optimizer.zero_stage=3"))
