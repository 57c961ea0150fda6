"""Bad input is refused before any worker starts, with a message that says how to fix it.

One test per row of docs/bad_inputs.md, each at the levels where the input exists: the
experiment configuration (Hydra composition, then ``experiments.config.validate_config``) and
the programmatic API (``engine.Pipeline.check_arguments`` — the same checks ``Pipeline`` runs in
each worker — ``engine.schedules.build_schedule``, ``partitioner.partition`` /
``partitioner.profile`` and ``engine.checkpoint.load_checkpoint``). All of it runs in this
process: nothing here starts a worker.
"""
from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from engine.optim import OptimizerConfig, resolve_backend
from engine.runtime import Pipeline
from engine.schedules import SCHEDULES, build_schedule
from experiments.config import ConfigError, validate_config
from partitioner import LayerCost, PartitionError, Profile, partition, profile

LAYERS = 6                     # model=gpt with model.layers=4 has 4 + 2 pipeline layers
GOOD = [(0, 2), (2, 4), (4, 6)]


# ---- helpers --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_cfg(compose_cfg):
    """The default experiment, composed once, with a small model (4 blocks -> 6 layers)."""
    cfg = compose_cfg("model.layers=4", "pipeline.stages=2", "pipeline.microbatches=4",
                      "train.batch_size=16")
    validate_config(cfg)                    # the base is valid: each test breaks one thing
    return OmegaConf.to_container(cfg, resolve=True)


def _cfg(base: dict, **dotted) -> dict:
    cfg = copy.deepcopy(base)
    for key, value in dotted.items():
        node = cfg
        *path, leaf = key.split("__")
        for p in path:
            node = node[p]
        node[leaf] = value
    return cfg


def _compose_error(override: str) -> str:
    from experiments.config import compose_config
    with pytest.raises(Exception) as info:
        compose_config(override)
    return f"{info.value}\n{info.value.__cause__}"


def _check(ranges=GOOD, layers=LAYERS, **kw):
    kw.setdefault("microbatches", 4)
    return Pipeline.check_arguments(layers, ranges, **kw)


def _uniform_profile(n: int, act: int = 1000, param: int = 1000) -> Profile:
    return Profile([LayerCost(forward_s=1e-3, backward_s=2e-3, param_bytes=param,
                              activation_bytes=act, output_bytes=100) for _ in range(n)])


# ---- rows -----------------------------------------------------------------------------------
def test_more_stages_than_layers(base_cfg):
    with pytest.raises(ConfigError, match=r"6 pipeline layers .* use fewer stages "
                                          r"\(pipeline.stages<=6\)"):
        validate_config(_cfg(base_cfg, pipeline__stages=8, train__batch_size=16))
    with pytest.raises(ValueError, match="use at most 6 stages"):
        _check(ranges=[(i, i + 1) for i in range(6)] + [(6, 6)])
    with pytest.raises(PartitionError, match="use at most 6 stages"):
        partition(_uniform_profile(LAYERS), 8, microbatches=8)


def test_unknown_schedule_lists_valid_ones(base_cfg):
    valid = ", ".join(SCHEDULES)                                          # gpipe, 1f1b, ...
    assert valid.startswith("gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zbv")
    assert (f"Invalid value '1f1f', expected one of [{valid}, auto]"
            in _compose_error("pipeline.schedule=1f1f"))                  # Hydra: enum choices (auto: the planner's)
    with pytest.raises(ConfigError, match=r"choose one of \['gpipe', '1f1b'"):
        validate_config(_cfg(base_cfg, pipeline__schedule="1f1f"))
    with pytest.raises(ValueError, match=f"unknown schedule '1f1f'; choose one of {valid}"):
        build_schedule("1f1f", 2, 4)
    with pytest.raises(ValueError, match=f"choose one of {valid}"):
        _check(schedule="pipedream")
    with pytest.raises(ValueError, match="unknown schedule 'x'; use one of"):
        partition(_uniform_profile(LAYERS), 2, schedule="x", microbatches=4)


def test_unknown_recompute_granularity_names_the_choices(base_cfg):
    assert ("Invalid value 'block', expected one of [chunk, layer, auto]"
            in _compose_error("pipeline.recompute_granularity=block"))
    with pytest.raises(ConfigError, match=r"pipeline.recompute_granularity='block'; use 'chunk' .* or 'layer'"):
        validate_config(_cfg(base_cfg, pipeline__recompute_granularity="block"))
    with pytest.raises(ValueError, match="recompute_granularity='block'; use 'chunk'"):
        _check(recompute_granularity="block")
    with pytest.raises(ValueError, match="recompute_granularity='block'; use 'chunk'"):
        partition(_uniform_profile(LAYERS), 2, microbatches=4, recompute_granularity="block")


def test_a_negative_memory_interval_is_refused_whatever_the_granularity(base_cfg):
    for granularity in ("chunk", "auto"):
        with pytest.raises(ConfigError, match="train.memory_every must be >= 0"):
            validate_config(_cfg(base_cfg, train__memory_every=-1, pipeline__recompute_granularity=granularity))


def test_batch_not_divisible_by_replicas_times_microbatches(base_cfg):
    with pytest.raises(ConfigError, match=r"train.batch_size=18 .* multiple of 8 "
                                          r"\(e.g. train.batch_size=16\)"):
        validate_config(_cfg(base_cfg, train__batch_size=18, pipeline__data_parallel=2))
    with pytest.raises(ValueError, match=r"global batch of 18 is not divisible by data_parallel "
                                         r"\(2\) x microbatches \(4\); use a batch size that is "
                                         r"a multiple of 8"):
        _check(data_parallel=2, global_batch=18)


def test_interleaving_needs_virtual_stages_and_microbatch_multiple(base_cfg):
    inter = dict(pipeline__schedule="interleaved-1f1b")
    with pytest.raises(ConfigError, match=r"pipeline.schedule=interleaved-1f1b cannot run .*"
                                          r"pipeline.virtual_stages=1: .*needs virtual_stages >= 2"):
        validate_config(_cfg(base_cfg, pipeline__virtual_stages=1, **inter))
    with pytest.raises(ConfigError, match=r"pipeline.stages=2, pipeline.microbatches=3, .*"
                                          r"multiple of num_stages .*use m=2 or 4"):
        validate_config(_cfg(base_cfg, pipeline__virtual_stages=2, pipeline__microbatches=3,
                             train__batch_size=12, **inter))
    with pytest.raises(ValueError, match="needs virtual_stages >= 2"):
        build_schedule("interleaved-1f1b", 2, 4, virtual_stages=1)
    with pytest.raises(ValueError, match="multiple of num_stages .* use m=2 or 4"):
        build_schedule("interleaved-1f1b", 2, 3, virtual_stages=2)
    with pytest.raises(ValueError, match="use m=2 or 4"):
        _check(ranges=[(0, 1), (1, 3), (3, 4), (4, 6)], schedule="interleaved-1f1b",
               virtual_stages=2, microbatches=3)
    with pytest.raises(ValueError, match="interleaved-1f1b needs virtual_stages >= 2"):
        partition(_uniform_profile(LAYERS), 2, schedule="interleaved-1f1b", microbatches=4)


def test_memory_limit_nothing_fits_names_the_smallest_that_works():
    prof = _uniform_profile(8, act=10_000, param=1_000)
    with pytest.raises(PartitionError, match="smallest memory_limit_bytes that works is") as info:
        partition(prof, 2, microbatches=4, memory_limit_bytes=1_000)
    named = int(str(info.value).split("works is ")[1].split()[0])
    plan = partition(prof, 2, microbatches=4, memory_limit_bytes=named)   # the remedy works
    assert max(plan.stage_memory_bytes) <= named
    with pytest.raises(PartitionError):
        partition(prof, 2, microbatches=4, memory_limit_bytes=int(named * 0.99))


@pytest.mark.parametrize("ranges, message", [
    ([(0, 2), (3, 4), (4, 6)], "leaves layers 2..2 unassigned"),
    ([(0, 3), (2, 4), (4, 6)], "overlaps the previous one"),
    ([(0, 2), (0, 2), (2, 6)], "overlaps the previous one"),          # a duplicated range
    ([(0, 2), (2, 4), (4, 5)], "the model has 6 layers; the last range must stop at 6"),
    ([(0, 2), (2, 4), (4, 7)], "the model has 6 layers; the last range must stop at 6"),
    ([(0, 2), (2, 2), (2, 6)], "is empty; every chunk needs at least one layer"),
    ([(1, 2), (2, 4), (4, 6)], "leaves layers 0..0 unassigned"),
], ids=["gap", "overlap", "duplicate", "short", "beyond", "empty", "missing-first"])
def test_stage_ranges_must_cover_the_model_exactly(ranges, message):
    with pytest.raises(ValueError, match=message):
        _check(ranges=ranges)


def test_stage_range_count_must_match_the_layout():
    with pytest.raises(ValueError, match="processes cannot run 3 stages x 1 replicas; start 3"):
        _check(world_size=4)
    with pytest.raises(ValueError, match="not a multiple of virtual_stages=2"):
        _check(schedule="interleaved-1f1b", virtual_stages=2)


def test_post_validate_on_a_backend_that_cannot_roll_back(base_cfg):
    with pytest.raises(ConfigError, match="optimizer.step_sync=post_validate rolls back a rank's "
                                          "update.*deepspeed backend.*set optimizer.step_sync=global"):
        validate_config(_cfg(base_cfg, optimizer__zero_stage=1, optimizer__step_sync="post_validate"))
    with pytest.raises(ConfigError, match="resolves to the fsdp backend"):
        validate_config(_cfg(base_cfg, optimizer__zero_stage=3, model__tie_embeddings=False,
                             optimizer__step_sync="post_validate"))
    validate_config(_cfg(base_cfg, optimizer__step_sync="post_validate"))
    with pytest.raises(ValueError, match="step_sync='post_validate' needs the torch optimizer backend"):
        _check(optimizer=OptimizerConfig(zero_stage=2, step_sync="post_validate"))


def test_zero_stage_unsupported(base_cfg):
    with pytest.raises(ConfigError, match=r"optimizer.zero_stage=4; choose 0 \(off\), 1"):
        validate_config(_cfg(base_cfg, optimizer__zero_stage=4))
    with pytest.raises(ConfigError, match="zero_stage=3 runs on torch's FSDP2, not optimizer.backend="
                                          "deepspeed .*set optimizer.backend=auto"):
        validate_config(_cfg(base_cfg, optimizer__zero_stage=3, optimizer__backend="deepspeed"))
    with pytest.raises(ConfigError, match="zero_stage=3 .* does not support tied weights yet"):
        validate_config(_cfg(base_cfg, optimizer__zero_stage=3, model__tie_embeddings=True))
    with pytest.raises(ConfigError, match="reshard_after_forward='sometimes'; choose auto, true"):
        validate_config(_cfg(base_cfg, optimizer__reshard_after_forward="sometimes"))
    validate_config(_cfg(base_cfg, pipeline__tensor_parallel=2))
    for kw, match in (
            (dict(pipeline__tensor_parallel=3), "tensor_parallel=3 does not divide model.heads=4"),
            (dict(pipeline__tensor_parallel=2, optimizer__zero_stage=1), "optimizer.zero_stage=1 .* "
             "is not built.*optimizer.zero_stage=0 or 3"),
            (dict(pipeline__tensor_parallel=2, optimizer__zero_stage=3), "zero_stage=3 is not built for "
             "model=gpt.*fused q/k/v"),
            (dict(pipeline__tensor_parallel=2, model__tie_embeddings=True), "tied weights.*"
             "model.tie_embeddings=false"),
            (dict(pipeline__tensor_parallel=2, model__loss="chunked"), "model.loss=full"),
            (dict(pipeline__tensor_parallel=2, precision="bf16"), "precision=bf16-autocast"),
            (dict(pipeline__tensor_parallel=2, optimizer__step_sync="post_validate"), "step_sync=post_validate is not "
             "built.*optimizer.step_sync=global"),
            (dict(pipeline__tensor_parallel=0), "at least 1"),
            (dict(pipeline__tensor_parallel=3, model__heads=3, model__dim=96, model__vocab=258,
                  model__sequence_parallel=True), "does not divide model.seq_len=128")):
        with pytest.raises(ConfigError, match=match):
            validate_config(_cfg(base_cfg, **kw))
    validate_config(_cfg(base_cfg, optimizer__zero_stage=3, model__tie_embeddings=False))
    with pytest.raises(ConfigError, match="needs DeepSpeed; set optimizer.backend=auto"):
        validate_config(_cfg(base_cfg, optimizer__zero_stage=1, optimizer__backend="torch"))
    with pytest.raises(ConfigError, match="zero_stage=2 cannot be used with "
                                          "model.tie_embeddings=true .*optimizer.zero_stage=1"):
        validate_config(_cfg(base_cfg, optimizer__zero_stage=2, model__tie_embeddings=True))
    validate_config(_cfg(base_cfg, optimizer__zero_stage=2, pipeline__schedule="zb-h1"))
    with pytest.raises(ValueError, match="zero_stage=4 is not supported; use 0, 1 or 2"):
        _check(optimizer=OptimizerConfig(zero_stage=4))
    with pytest.raises(ValueError, match="zero_stage=3 .FSDP2. does not support tied parameters"):
        _check(optimizer=OptimizerConfig(zero_stage=3), ties=[("0.weight", "3.weight")])
    with pytest.raises(ValueError, match="needs backend='deepspeed'"):
        resolve_backend(OptimizerConfig(zero_stage=1, backend="torch"))
    with pytest.raises(ValueError, match="across pipeline stages 0 and 2: .* use zero_stage=1"):
        _check(optimizer=OptimizerConfig(zero_stage=2), ties=[("0.weight", "5.weight")])
    for name in ("gpipe", "1f1b", "zb-h1"):        # every schedule is fine with ZeRO 0-2
        _check(schedule=name, optimizer=OptimizerConfig(zero_stage=2))


def test_fp16_and_bf16_both_asked(base_cfg):
    # Hydra: a list is not a Precision; a quoted 'bf16,fp16' is not one of the choices; an
    # unquoted bf16,fp16 is refused as ambiguous unless --multirun (then it is a sweep: 2 runs).
    assert "is not a valid input for <enum 'Precision'>" in _compose_error("precision=[bf16,fp16]")
    assert "expected one of [fp32, bf16, fp16, bf16-autocast, fp16-autocast]" in _compose_error("precision='bf16,fp16'")
    assert "Ambiguous value" in _compose_error("precision=bf16,fp16")
    with pytest.raises(ConfigError, match="choose exactly one of .* bf16 and fp16 cannot be "
                                          "combined"):
        validate_config(_cfg(base_cfg, precision="bf16,fp16"))
    with pytest.raises(ValueError, match=r"must be one of .* \(exactly one\), got 'fp16\+bf16'; "
                                         "bf16 and fp16 cannot be combined"):
        _check(precision="fp16+bf16")
    with pytest.raises(ValueError, match="exactly one, as a string"):
        _check(precision=["bf16", "fp16"])


def test_layer_shape_mismatch_is_found_while_profiling():
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(8, 8)]   # layer 2 wants 8, gets 16
    for mode in ("measure", "analytic"):
        kw = {"repeats": 1, "warmup": 0} if mode == "measure" else {}
        with pytest.raises(ValueError, match=r"layer 2 \(Linear\) cannot take the output of "
                                             r"layer 1 \(ReLU\) with shapes .*16") as info:
            profile(layers, torch.randn(4, 8), mode=mode, **kw)
        assert "consecutive layers agree on shapes" in str(info.value)


def test_restarts_need_checkpoints(base_cfg):
    with pytest.raises(ConfigError, match=r"train.max_restarts=2 restarts a failed job from its newest checkpoint, "
                                          r"but checkpoint.every_steps=0 writes none; set checkpoint.every_steps"):
        validate_config(_cfg(base_cfg, train__max_restarts=2, checkpoint__every_steps=0))
    with pytest.raises(ConfigError, match=r"train.max_restarts=-1; it must be >= 0"):
        validate_config(_cfg(base_cfg, train__max_restarts=-1))
    validate_config(_cfg(base_cfg, train__max_restarts=2, checkpoint__every_steps=10))


def test_a_node_size_that_is_no_count_or_has_no_links_to_set(base_cfg):
    gpu = dict(partitioner__profile="analytic", partitioner__device_spec="h100")
    for bad in (0, -8):
        with pytest.raises(ConfigError, match=rf"partitioner.gpus_per_node={bad}; give the GPUs one node holds "
                                              r"\(e.g. partitioner.gpus_per_node=8\)"):
            validate_config(_cfg(base_cfg, **gpu, partitioner__gpus_per_node=bad))
    with pytest.raises(ConfigError, match=r"partitioner.gpus_per_node=8 sets the node size of a GPU preset's links, "
                                          r"but partitioner.profile=measure .* set partitioner.gpus_per_node=null"):
        validate_config(_cfg(base_cfg, partitioner__gpus_per_node=8))
    validate_config(_cfg(base_cfg, **gpu, partitioner__gpus_per_node=4))


def test_checkpoint_from_another_model(tmp_path):
    mine = {i: dict(nn.Linear(8, 8).state_dict()) for i in range(3)}
    save_checkpoint(tmp_path, 1, layers=mine, num_layers=3)
    other = {i: dict(nn.Linear(8, 16).state_dict()) for i in range(3)}
    with pytest.raises(CheckpointError, match=r"layer 0: 'weight' has shape \(8, 8\) in the "
                                              r"checkpoint, \(16, 8\) in this model"):
        load_checkpoint(tmp_path / "step_000001", range(3), expected=other, num_layers=3)
    with pytest.raises(CheckpointError, match="model with 3 layers, this model has 4; it comes "
                                              "from another model"):
        load_checkpoint(tmp_path / "step_000001", range(4), num_layers=4)
    half = {i: {k: v.half() for k, v in mine[i].items()} for i in range(3)}
    with pytest.raises(CheckpointError, match="torch.float32 in the checkpoint, torch.float16"):
        load_checkpoint(tmp_path / "step_000001", range(3), expected=half, num_layers=3)
    ok = load_checkpoint(tmp_path / "step_000001", range(3), expected=mine, num_layers=3)
    assert torch.equal(ok.layers[2]["weight"], mine[2]["weight"])


def test_pretrained_directory_that_cannot_be_loaded(base_cfg, tmp_path):
    hf = {"name": "hf", "arch": "llama", "layers": 2, "dim": 32, "heads": 4, "vocab": 256, "seq_len": 16,
          "dropout": 0.0, "tie_embeddings": True, "kv_heads": None, "intermediate": None}
    with pytest.raises(ConfigError, match="is not a directory; give the folder that "
                                          r"model.save_pretrained\(...\) wrote"):
        validate_config(_cfg(base_cfg, model={**hf, "pretrained": str(tmp_path / "missing")}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        validate_config(_cfg(base_cfg, model={**hf, "pretrained": str(tmp_path / "empty")}))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"neither model.safetensors nor .* convert with .*save_pretrained"):
        validate_config(_cfg(base_cfg, model={**hf, "pretrained": str(tmp_path / "bin")}))


def test_generation_prompts_and_export_input():
    from experiments.export_hf import resolve_checkpoint
    from experiments.generate import read_prompts

    with pytest.raises(ConfigError, match=r"generate.prompts is not set; give token-id lists"):
        read_prompts(None)
    with pytest.raises(ConfigError, match="prompt 1 is \\[\\]; each prompt must be a non-empty list"):
        read_prompts([[1], []])
    with pytest.raises(ConfigError, match="holds no complete pipeshard checkpoint"):
        resolve_checkpoint("/nonexistent/run")


def test_data_files_that_cannot_be_trained_on(base_cfg, tmp_path):
    from hf_data import save_tokenizer

    from experiments.hfdata import DataError, prepare

    tok = save_tokenizer(tmp_path / "tok")
    (tmp_path / "a.jsonl").write_text('{"body": "the pipeline stage splits layers across ranks"}\n' * 30)
    data = {"name": "hf", "files": str(tmp_path / "a.jsonl"), "text_field": "body", "sample_by": "line",
            "tokenizer": tok, "eval_fraction": 0.1, "streaming": False, "shards": None, "shuffle": False,
            "prefetch": 2, "cache_dir": str(tmp_path / "cache")}
    cfg = _cfg(base_cfg, data=data, model__seq_len=8)
    validate_config(cfg)
    prepare(cfg, echo=lambda _: None)  # the base is valid: each case breaks one thing

    def refused(pattern: str, **change) -> None:
        broken = _cfg(cfg, **change)
        with pytest.raises((ConfigError, DataError), match=pattern):
            validate_config(broken)
            prepare(broken, echo=lambda _: None)

    refused(r"data.files: '.*missing.jsonl' does not exist; give a file", data__files=str(tmp_path / "missing.jsonl"))
    refused("data.files: no file matches", data__files=str(tmp_path / "none*.jsonl"))
    (tmp_path / "empty.txt").write_text("\n\n")
    refused("data.files holds no text", data__files=str(tmp_path / "empty.txt"))
    refused(r"data.text_field='text' is not a field of .*: its fields are \['body'\]; set data.text_field=body",
            data__text_field="text")
    refused(r"has \d+ tokens but the model's embedding has 64 rows .*raise model.vocab", model__vocab=64)
    refused("needs a tokenizer", data__tokenizer=None)
