"""Structured configuration for pipeshard experiments (Hydra + OmegaConf).

Every config group under `conf/` is backed by a dataclass registered in Hydra's ConfigStore, so
a misspelt key, a wrong type or an unknown choice fails when Hydra composes the config. The
composed config is then turned into these dataclasses once (`as_config`, `OmegaConf.to_object`),
checked across fields by `validate_config`, and the typed `Config` is what every entry point,
worker and helper of experiments/ is handed and reads by attribute (`cfg.pipeline.stages`).
Defaults live only in the field declarations below; `docs/configuration.md` is generated from
them (`python -m experiments.config_doc`).

Example:
    >>> from hydra import compose, initialize_config_dir
    >>> from experiments.config import CONF_DIR, as_config, register_configs, validate_config
    >>> register_configs()
    >>> with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
    ...     composed = compose("config", overrides=["pipeline.stages=2", "optimizer=sgd"])
    >>> cfg = validate_config(as_config(composed))
    >>> cfg.pipeline.stages, cfg.optimizer.name
    (2, <OptimizerName.sgd: 'sgd'>)
"""

from __future__ import annotations

import re
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, List, Optional, Union

from omegaconf import MISSING, DictConfig, OmegaConf

from engine.caches import CACHE_MODES
from engine.choices import (BACKENDS, GRAD_ACCUM_DTYPES, NONFINITE, OPTIMIZERS, PRECISIONS, RECOMPUTE_GRANULARITIES,
                            STEP_SYNCS, check_recompute_granularity)
from engine.footprint import GRAD_BUCKET_MB
from engine.schedules import SCHEDULES
from experiments.fields import choice_text, sequence_parallel_mode
from partitioner.devices import ATTENTION_BACKENDS
from partitioner.planner import METHODS
from partitioner.planner import checkpointing_mode as _recompute_mode
from partitioner.search import AUTO

__all__ = [
    "CONF_DIR",
    "compose_config",
    "ConfigError",
    "Choice",
    "ScheduleName",
    "PartitionMethod",
    "ProfileMode",
    "ProfileCaches",
    "AttentionBackend",
    "OptimizerName",
    "OptimizerBackend",
    "Precision",
    "WeightDtype",
    "GradAccumDtype",
    "checkpointing_mode",
    "sequence_parallel_setting",
    "sequence_parallel_problem_at",
    "LoggerMode",
    "LossKind",
    "MLPProfile",
    "HFArch",
    "Device",
    "NonFinite",
    "RecomputeGranularity",
    "ModelConfig",
    "GPTConfig",
    "MLPConfig",
    "HFModelConfig",
    "PipelineConfig",
    "PartitionerConfig",
    "SearchConfig",
    "OptimConfig",
    "DataConfig",
    "TextDataConfig",
    "SyntheticDataConfig",
    "HFDataConfig",
    "TextUnit",
    "LoggerConfig",
    "TrainConfig",
    "CheckpointConfig",
    "BenchConfig",
    "GenerateConfig",
    "ExportConfig",
    "Config",
    "register_configs",
    "validate_config",
    "parse_size",
    "parse_memory_limit",
    "count_pipeline_layers",
    "to_plain_dict",
    "choice_text",
    "as_config",
    "model_config",
    "load_config",
    "MODEL_SCHEMAS",
    "DATA_SCHEMAS",
    "optimizer_kwargs",
    "searches",
    "configured_microbatches",
]

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
"""The repository's `conf/` directory (primary config `config.yaml`)."""


class ConfigError(ValueError):
    """A configuration that composes but cannot run; the message says how to fix it."""


# --------------------------------------------------------------------------- choices
class Choice(str, Enum):
    """A string choice: compares equal to its text, prints as its text, JSON-serialises as text.

    Member names equal their values (`ScheduleName["1f1b"]`), because OmegaConf looks enum
    values up by name.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


def _choice(name: str, values: tuple[str, ...]) -> type[Choice]:
    enum = Choice(name, [(v, v) for v in values])  # type: ignore[call-overload]
    enum.__module__ = __name__
    return enum


# The engine's and the partitioner's choices, read from where they are defined. A schedule is
# one of the engine's, or "auto": the planner chooses (partitioner.search).
ScheduleName = _choice("ScheduleName", (*SCHEDULES, AUTO))
PartitionMethod = _choice("PartitionMethod", METHODS)
ProfileMode = _choice("ProfileMode", ("measure", "analytic"))
ProfileCaches = _choice("ProfileCaches", CACHE_MODES)
AttentionBackend = _choice("AttentionBackend", ATTENTION_BACKENDS)
OptimizerName = _choice("OptimizerName", OPTIMIZERS)
OptimizerBackend = _choice("OptimizerBackend", BACKENDS)
Precision = _choice("Precision", PRECISIONS)
WeightDtype = _choice("WeightDtype", ("fp32", "bf16", "fp16"))
GradAccumDtype = _choice("GradAccumDtype", GRAD_ACCUM_DTYPES)
StepSync = _choice("StepSync", STEP_SYNCS)
LoggerMode = _choice("LoggerMode", ("offline", "online", "disabled"))
LossKind = _choice("LossKind", ("full", "chunked"))
MLPProfile = _choice("MLPProfile", ("uniform", "ramp", "hourglass"))
HFArch = _choice("HFArch", ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox"))
Device = _choice("Device", ("auto", "cpu", "cuda"))
NonFinite = _choice("NonFinite", NONFINITE)
RecomputeGranularity = _choice("RecomputeGranularity", (*RECOMPUTE_GRANULARITIES, AUTO))
TextUnit = _choice("TextUnit", ("line", "paragraph", "document"))


# --------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """Base of the `model` group; `name` selects the builder in `experiments.models.build_model`."""

    name: str = MISSING  # builder name: gpt | mlp | hf | hf_gpt2 | hf_llama (set by the option's schema)


@dataclass
class GPTConfig(ModelConfig):
    """`model=gpt`: decoder-only transformer, pipeline layers = embedding, `layers` blocks, head."""

    name: str = "gpt"
    layers: int = 4  # transformer blocks (the pipeline has layers + 2 layers)
    dim: int = 128  # hidden size; must be divisible by heads
    heads: int = 4  # attention heads
    vocab: int = 256  # vocabulary size; >= 256 for byte-level text data
    seq_len: int = 128  # context length (tokens per sample)
    dropout: float = 0.0  # dropout after embedding, attention and MLP
    mlp_ratio: int = 4  # MLP hidden size = mlp_ratio * dim
    tie_embeddings: bool = False  # share the token embedding with the LM head (summed gradients)
    loss: LossKind = LossKind["full"]  # LM head + cross-entropy: full ([b, s, V] logits) | chunked (never materialises the fp32 logits)
    loss_chunk: int = 1024  # chunked loss: tokens per chunk of the fused head + cross-entropy
    sequence_parallel: Union[bool, str] = False  # with pipeline.tensor_parallel > 1: LayerNorms and the residual stream split on the sequence over the tp ranks (seq_len divisible by tp); auto: the planner chooses (experiments.partition, and a training run's search)


@dataclass
class MLPConfig(ModelConfig):
    """`model=mlp`: deep residual MLP whose blocks have unequal hidden widths (unequal costs)."""

    name: str = "mlp"
    depth: int = 16  # residual blocks (the pipeline has depth + 2 layers); ignored if widths is set
    dim: int = 256  # residual stream width
    width: int = 256  # base hidden width of a block
    profile: MLPProfile = MLPProfile["hourglass"]  # how hidden widths vary: uniform | ramp | hourglass
    ratio: float = 4.0  # widest / narrowest hidden width in ramp and hourglass
    widths: Optional[List[int]] = None  # explicit hidden width per block (overrides depth/width/profile)
    in_dim: int = 64  # input features
    classes: int = 10  # output classes (cross-entropy)
    dropout: float = 0.0  # dropout on each block's output


@dataclass
class HFModelConfig(ModelConfig):
    """`model=hf` (and the presets `hf_gpt2` / `hf_llama`): a Hugging Face causal LM.

    With `pretrained` (a `save_pretrained` directory: config.json + safetensors) the architecture,
    sizes and weights come from the directory (each rank loads only its own layers) and the size
    fields below are ignored; without it, a random model of family `arch` with these sizes.
    """

    name: str = "hf_gpt2"
    pretrained: Optional[str] = None  # local save_pretrained directory; null = random weights of `arch`
    arch: HFArch = HFArch["gpt2"]  # family of a random model: gpt2 | llama | mistral | qwen2 | qwen3 | phi3 | gpt_neox
    layers: int = 4  # decoder blocks (the pipeline has layers + 2 layers)
    dim: int = 128  # hidden size
    heads: int = 4  # attention heads
    vocab: int = 256  # vocabulary size (with pretrained: the token range data=synthetic draws from)
    seq_len: int = 128  # training sequence length (random models: also the max positions)
    dropout: float = 0.0  # attention / residual / embedding dropout
    tie_embeddings: bool = True  # tie input and output embeddings (as the HF models do by default)
    kv_heads: Optional[int] = None  # key/value heads (grouped-query attention; not gpt2/gpt_neox); None = heads
    intermediate: Optional[int] = None  # MLP hidden size (not gpt2); None = 4 * dim
    loss: LossKind = LossKind["full"]  # LM head + cross-entropy: full ([b, s, V] logits) | chunked (never materialises the fp32 logits)
    loss_chunk: int = 1024  # chunked loss: tokens per chunk of the fused head + cross-entropy
    sequence_parallel: Union[bool, str] = False  # with pipeline.tensor_parallel > 1 (llama, mistral, qwen2, qwen3): norms and the residual stream split on the sequence over the tp ranks (seq_len divisible by tp); auto: the planner chooses (experiments.partition, and a training run's search)


# --------------------------------------------------------------------------- pipeline etc.
@dataclass
class PipelineConfig:
    """`pipeline`: how the model is pipelined and replicated."""

    stages: int = 2  # pipeline ranks (p)
    schedule: ScheduleName = ScheduleName["1f1b"]  # one of engine.schedules.SCHEDULES (gpipe, 1f1b, ...), or auto: the planner chooses
    microbatches: Any = 4  # microbatches per step per replica (m), or auto: the planner chooses (a divisor of the batch per replica)
    virtual_stages: int = 1  # model chunks per rank (v); the schedule says which (>= 2: interleaved-1f1b, 2: zbv); chosen under schedule=auto
    max_inflight: Optional[int] = None  # zb-h2: most microbatches a rank holds, stages..2*stages-1 (null: 2*stages-1); chosen under schedule=auto
    data_parallel: int = 1  # replicas of the pipeline (d); processes = stages * data_parallel * tensor_parallel
    tensor_parallel: int = 1  # tensor-parallel ranks per stage and replica (t; the mesh's innermost axis; engine.tp, GPT and HF models)
    activation_checkpointing: Union[bool, str] = False  # false | true (every chunk recomputes) | auto (the partitioner decides per chunk)
    recompute_granularity: RecomputeGranularity = RecomputeGranularity["chunk"]  # what one checkpoint of a recomputing chunk covers: chunk (a held microbatch keeps the chunk's input; backward recomputes the whole chunk at once) | layer (each layer its own checkpoint, torchtitan's "full" AC: keeps every layer's input, recomputes one layer at a time) | auto (the planner chooses, per layout); planned by the partitioner
    comm_timeout_s: float = 60.0  # a point-to-point transfer waiting longer than this fails the job
    nonfinite: NonFinite = NonFinite["raise"]  # a non-finite loss/gradient: raise (stop) | skip (drop the step)


@dataclass
class SearchConfig:
    """`partitioner.search`: what `pipeline.schedule=auto` / `pipeline.microbatches=auto` search over."""

    schedules: Optional[List[str]] = None  # schedules considered; null = every one of engine.schedules.SCHEDULES
    max_virtual_stages: int = 4  # interleaved-1f1b: chunks per rank tried, 2..this
    max_microbatches: Optional[int] = None  # microbatch counts tried: divisors of the batch per replica, stages..this (null: the batch)
    top: int = 5  # alternatives shown beside the choice (and kept in plan.json)
    tensor_parallel: Optional[List[int]] = None  # tp degrees the search may choose, data_parallel x tensor_parallel GPUs per stage held (Llama-style HF models); null = pipeline.tensor_parallel only
    zero_stages: Optional[List[int]] = None  # ZeRO stages the search may choose (0-3); null = optimizer.zero_stage only


@dataclass
class PartitionerConfig:
    """`partitioner`: how layers are profiled and split into stages."""

    method: PartitionMethod = PartitionMethod["optimal"]  # optimal | uniform | parameters | greedy
    profile: ProfileMode = ProfileMode["measure"]  # measure (time layers here) | analytic (FLOPs on meta)
    memory_limit: Optional[str] = None  # per-stage cap like 24GiB, or comma list per stage; null = none
    repeats: int = 5  # measure: timed repeats per layer (median is used)
    warmup: int = 2  # measure: untimed repeats before timing
    sweeps: int = 3  # measure: profile the model this many times, median per layer (a slow spell of the machine hits one sweep)
    caches: ProfileCaches = ProfileCaches["hot"]  # measure: hot (each layer timed as it repeats: what plans use) | cold (other data read through the caches before each timed phase: an upper bound on what the caches cost a step, engine.caches)
    device_spec: Optional[str] = None  # analytic: device preset (partitioner.DEVICE_PRESETS, e.g. h100); null = this CPU
    attention: Optional[AttentionBackend] = None  # analytic: SDPA kernel attention is costed through: flash | efficient | math | unfused (Megatron legacy core attention); null = the device spec's (flash)
    link_bytes_per_s: Optional[float] = None  # stage-to-stage bandwidth for transfer costs, every boundary (wins over the others); null = the link measured with the fixed costs, else the device spec's NVLink / NIC by whether neighbouring ranks share a node (analytic GPU presets, partitioner.gpus_per_node per node), else free
    gpus_per_node: Optional[int] = None  # analytic on a GPU preset: GPUs per node (its NVLink domain; nodes are consecutive ranks in the engine's order), which decides whether each tp group, dp group and pipeline boundary runs on NVLink or the NIC; null = the device spec's own (8 on the GPU presets); refused where the plan has no device-spec links to apply it to (a measured profile, the CPU)
    calibrate: bool = False  # analytic: time a fixed kernel set on the device at hand, fit the device model, cache it per device name
    fixed_costs: bool = True  # measure: charge the runtime's fixed costs (per action, message, step) measured on this machine (cached; CPU runs)
    search: SearchConfig = field(default_factory=SearchConfig)  # pipeline.schedule=auto / microbatches=auto


@dataclass
class OptimConfig:
    """`optimizer`: mirrors `engine.OptimizerConfig` (see `optimizer_kwargs`)."""

    name: OptimizerName = OptimizerName["adamw"]  # sgd | adam | adamw
    lr: float = 3e-3  # peak learning rate
    momentum: float = 0.0  # sgd momentum
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # adam / adamw (beta1, beta2)
    weight_decay: float = 0.1  # decoupled for adamw, L2 for sgd / adam
    eps: float = 1e-8  # adam / adamw epsilon
    warmup_steps: int = 20  # linear warm-up from 0 to lr over this many steps
    decay_steps: Optional[int] = None  # cosine decay to min_lr_ratio * lr over this many steps; null = constant (the optimizer options set ${train.steps})
    min_lr_ratio: float = 0.1  # floor of the cosine decay, as a fraction of lr
    grad_clip: Optional[float] = 1.0  # clip the global gradient norm (whole pipeline); null = off
    zero_stage: int = 0  # ZeRO stage over each stage's data-parallel group: 0, 1 or 2 (DeepSpeed), 3 (torch FSDP2: parameters, gradients and optimizer state sharded)
    backend: OptimizerBackend = OptimizerBackend["auto"]  # auto | torch | deepspeed (auto: deepspeed iff zero_stage > 0 or 16-bit weights)
    grad_accum_dtype: GradAccumDtype = GradAccumDtype["fp32"]  # gradients accumulated over microbatches in: fp32 | bf16 | fp16 (= the 16-bit weights')
    overlap_grad_reduce: bool = True  # torch backend, data_parallel > 1: all-reduce each gradient bucket over the replicas during the last backward, as soon as it is final (DDP's overlap); false: one reduction after the schedule
    grad_bucket_mb: float = GRAD_BUCKET_MB  # size of a data-parallel all-reduce bucket (DDP's bucket_cap_mb)
    reshard_after_forward: str = "auto"  # zero_stage=3: free each layer's gathered weights after its forward and backward (true), keep them for the whole step (false: one all-gather per layer per step), or auto (true iff partitioner.memory_limit is set)
    step_sync: StepSync = StepSync["global"]  # global: every rank waits for the global norm / non-finite flags / fp16 scale before it steps | post_validate: each rank steps at once assuming no clipping and no overflow, validates one step later and rolls back (torch backend, zero_stage=0; docs/schedules.md)


@dataclass
class DataConfig:
    """Base of the `data` group; `name` selects the dataset in `experiments.data.make_dataset`."""

    name: str = MISSING  # text | synthetic | hf (set by the option's schema)


@dataclass
class TextDataConfig(DataConfig):
    """`data=text`: byte-level LM on the Python standard library's own source (no download)."""

    name: str = "text"
    root: Optional[str] = None  # directory of text files; null = this Python's stdlib
    suffix: str = ".py"  # files read under root (sorted, recursive)
    max_bytes: int = 8_000_000  # corpus size budget in bytes (files read in order until reached)
    holdout_fraction: float = 0.05  # last fraction of the bytes held out for the evaluation loss


@dataclass
class SyntheticDataConfig(DataConfig):
    """`data=synthetic`: random tokens (language models) or teacher-labelled features (mlp)."""

    name: str = "synthetic"
    holdout_seed_offset: int = 1_000_003  # evaluation batches use seed + this (disjoint stream)


@dataclass
class HFDataConfig(DataConfig):
    """`data=hf`: your own files, tokenized with the model's tokenizer (`experiments.hfdata`)."""

    name: str = "hf"
    files: Any = None  # a file, directory or glob (.txt .md .jsonl .json .parquet), or a list of them
    text_field: str = "text"  # the field holding each document's text (JSON lines, parquet)
    sample_by: TextUnit = TextUnit["line"]  # plain text: one document per line | paragraph | document (file)
    tokenizer: Optional[str] = None  # tokenizer directory (save_pretrained); null = model.pretrained's
    eval_fraction: float = 0.05  # share of the documents held out (evenly spread) for the evaluation loss
    streaming: bool = False  # read and tokenize while training (corpora larger than memory)
    shards: Optional[int] = None  # document shards (a multiple of data_parallel, dividing the batch); null = data_parallel
    shuffle: bool = False  # permute each shard's blocks every epoch (not with streaming: files are read in order)
    prefetch: int = 2  # streaming: steps read ahead in a background thread
    cache_dir: Optional[str] = None  # datasets' cache (Arrow copy + tokenized ids); null = HF_DATASETS_CACHE


@dataclass
class LoggerConfig:
    """`logger`: Weights & Biases and the console."""

    mode: LoggerMode = LoggerMode["offline"]  # offline (no account) | online | disabled
    project: str = "pipeshard"  # W&B project
    entity: Optional[str] = None  # W&B entity (team or user); null = your default
    run_name: Optional[str] = None  # W&B run name; null = the experiment name and schedule
    group: Optional[str] = None  # W&B group (e.g. a sweep); null = none
    tags: List[str] = field(default_factory=list)  # W&B tags
    progress: bool = True  # show a progress bar with loss and throughput
    timeline: bool = True  # log the predicted vs measured timeline picture


@dataclass
class TrainConfig:
    """`train`: the training loop."""

    steps: int = 800  # optimizer steps (the default job trains ~100 s on 2 idle CPU cores)
    batch_size: int = 16  # global batch (all replicas, all microbatches)
    seed: int = 0  # model init (layer i under seed + i) and the data stream
    log_every: int = 10  # console / progress refresh interval in steps (metrics.jsonl gets every step)
    eval_every: int = 100  # held-out loss every this many steps; 0 = only at the end
    eval_batches: int = 4  # batches per evaluation
    device: Device = Device["auto"]  # auto (cuda if available) | cpu | cuda
    timeout_s: Optional[float] = None  # whole-job limit for the local launcher; null = none
    max_restarts: int = 0  # local launcher: restart all ranks after a failure, up to N times (resume from the newest checkpoint)
    memory_every: int = 100  # measure each rank's peak memory (torch MemTracker) on the first 2 steps and every this many; 0 = off


@dataclass
class CheckpointConfig:
    """`checkpoint`: layer-keyed checkpoints that can be resumed with another split."""

    every_steps: int = 0  # save every this many steps; 0 = off
    dir: Optional[str] = None  # where to write; null = <run dir>/checkpoints
    keep_last: int = 2  # checkpoints kept (older ones deleted)
    resume: Optional[str] = "true"  # true: resume from this run's newest checkpoint if any | false: fresh start | a checkpoint path
    async_save: bool = True  # write in the background (the step loop waits only for a copy to host memory)


@dataclass
class BenchConfig:
    """`bench`: `python -m experiments.bench` settings."""

    warmup_steps: int = 2  # steps run before timing (excluded)
    steps: int = 5  # timed steps; the median is reported
    systems: List[str] = field(
        default_factory=lambda: ["single", "pipeshard", "torch-pipelining", "deepspeed"]
    )  # systems to run
    schedules: List[str] = field(default_factory=lambda: list(SCHEDULES))  # pipeshard / torch schedules to run
    methods: List[str] = field(default_factory=lambda: ["optimal", "uniform", "parameters"])  # splits compared
    timeout_s: float = 600.0  # per-system limit
    rounds: int = 1  # repeat every system this many times in alternating order (pools timings)
    auto: bool = True  # also run the planner's choice (partitioner.search: schedule, chunks, microbatches, max_inflight, recompute, split)
    sweep: bool = False  # also run every layout the search solved, to compare the choice with the fastest measured
    sweep_max: Optional[int] = None  # sweep only the best-predicted N layouts; null = all
    sweep_confirm: int = 3  # after the sweep, run auto's choice and the N fastest sweep layouts again head to head (`rounds` fresh rounds) and compare those medians; 0 = off
    overhead: bool = False  # true: the overhead benchmark instead (near-free layers, m=32, p=2 and 4: cost per action)
    overhead_blocks: int = 20  # with overhead: also run pipeshard and torch 1F1B in the same processes, this many alternating blocks of `steps` steps (median per-block ratio); 0 = off
    trace: bool = False  # true: every rank writes a torch.profiler trace of its timed steps (outputs/traces/) and a time-per-category table


@dataclass
class GenerateConfig:
    """`generate`: `python -m experiments.generate` (pipelined generation with a KV cache per stage)."""

    prompts: Any = None  # token-id lists inline ([[1,2,3],[4,5]]) or a file: JSON list, or JSONL of lists / {"prompt": [...]}
    max_new_tokens: int = 32  # tokens generated per prompt
    microbatches: Optional[int] = None  # lanes decoded concurrently, each with its own KV cache per stage; null = pipeline.stages
    microbatch_size: Optional[int] = None  # most prompts in a lane at once (the others enter as prompts finish); null = all fit
    do_sample: bool = False  # false: greedy; true: sample with temperature / top_k / top_p
    temperature: float = 1.0  # sampling temperature (> 0)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with this probability mass; 1.0 = off
    seed: int = 0  # sampling seed (prompt j draws from its own generator: the tokens do not depend on the split)
    eos_token_id: Optional[int] = None  # stop token (the output is cut after it); null = the model's; -1 = none
    pad_token_id: Optional[int] = None  # id used for left padding (masked out); null = the model's pad, else eos, else 0
    dtype: WeightDtype = WeightDtype["fp32"]  # weights (and so activations) of the pipeline and of the baseline: fp32 | bf16 | fp16
    compare: bool = True  # also time transformers' model.generate in one process on the same prompts


@dataclass
class ExportConfig:
    """`python -m experiments.export_hf` (`conf/export_hf.yaml`)."""

    checkpoint: str = MISSING  # a checkpoint (step_N dir), a checkpoint root, or a run directory (its newest)
    out: str = MISSING  # the Hugging Face directory to write (config.json + safetensors)
    max_shard_size: str = "5GB"  # shard the weights above this size (transformers' save_pretrained)
    dtype: Optional[str] = None  # fp32 | bf16 | fp16 for the written weights; null: the checkpoint's (fp32 masters)


@dataclass
class Config:
    """The whole experiment (`conf/config.yaml`)."""

    model: ModelConfig = MISSING  # model group: gpt | mlp | hf_gpt2 | hf_llama
    data: DataConfig = MISSING  # data group: text | synthetic | hf
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # how the model is pipelined and replicated
    partitioner: PartitionerConfig = field(default_factory=PartitionerConfig)  # how layers are profiled and split
    optimizer: OptimConfig = field(default_factory=OptimConfig)  # optimizer group: adamw | adam | sgd
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # Weights & Biases and the console
    train: TrainConfig = field(default_factory=TrainConfig)  # the training loop
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # checkpoints and resuming
    bench: BenchConfig = field(default_factory=BenchConfig)  # python -m experiments.bench
    generate: GenerateConfig = field(default_factory=GenerateConfig)  # python -m experiments.generate
    precision: Precision = Precision["fp32"]  # fp32 | bf16 | fp16 (16-bit weights, fp32 masters in the optimizer) | bf16-autocast | fp16-autocast (fp32 weights)
    name: str = "default"  # experiment name (run directory, W&B run name)


_REGISTERED = False


def compose_config(*overrides: str) -> Any:
    """Compose ``conf/config.yaml`` with command-line style overrides, without running an app.

    >>> cfg = compose_config("pipeline.stages=4", "experiment=smoke")   # doctest: +SKIP
    """
    from hydra import compose, initialize_config_dir

    from hydra.errors import ConfigCompositionException

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    try:  # a bool-or-"auto" field: the one value OmegaConf's types cannot hold to its choices
        checkpointing_mode(cfg.pipeline.activation_checkpointing)
    except ConfigError as err:
        raise ConfigCompositionException(str(err)) from None
    return cfg


def load_config(*overrides: str) -> Config:
    """`compose_config`, turned into the typed `Config` once (`as_config`) and validated
    (`validate_config`): what every entry point runs on.

    >>> load_config("pipeline.stages=4", "experiment=smoke").pipeline.stages   # doctest: +SKIP
    4
    """
    return validate_config(as_config(compose_config(*overrides)))


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent; call before composing).

    Names: `pipeshard_schema` (primary), `model/{gpt,mlp,hf}_schema`, `data/{text,synthetic,hf}_schema`.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="pipeshard_schema", node=Config)
    cs.store(name="export_hf_schema", node=ExportConfig)
    cs.store(group="model", name="gpt_schema", node=GPTConfig)
    cs.store(group="model", name="mlp_schema", node=MLPConfig)
    cs.store(group="model", name="hf_schema", node=HFModelConfig)
    cs.store(group="data", name="text_schema", node=TextDataConfig)
    cs.store(group="data", name="synthetic_schema", node=SyntheticDataConfig)
    cs.store(group="data", name="hf_schema", node=HFDataConfig)
    _REGISTERED = True


register_configs()


# --------------------------------------------------------------------------- helpers
_UNITS = {
    "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Bytes in a size like `24GiB`, `1.5 GB`, `512MiB`, `4096` or `4096B`.

    Units: B, KiB, MiB, GiB, TiB (powers of 1024) and KB, MB, GB, TB (powers of 1000).

    >>> parse_size("24GiB"), parse_size("1.5KB"), parse_size(4096)
    (25769803776, 1500, 4096)
    """
    if isinstance(value, bool):
        raise ConfigError(f"size {value!r} is not a size; write e.g. 24GiB, 512MiB or a number of bytes")
    if isinstance(value, (int, float)):
        number, unit = float(value), "b"
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise ConfigError(
                f"cannot parse size {value!r}; write a number and a unit, e.g. 24GiB, 512MiB, 80GB or 4096B"
            )
        number, unit = float(match.group(1)), (match.group(2) or "b").lower()
    if unit not in _UNITS:
        raise ConfigError(
            f"unknown size unit in {value!r}; use one of B, KiB, MiB, GiB, TiB, KB, MB, GB, TB (e.g. 24GiB)"
        )
    size = number * _UNITS[unit]
    if size <= 0:
        raise ConfigError(f"size {value!r} must be positive; e.g. 24GiB")
    return int(size)


def parse_memory_limit(value: Any) -> int | list[int] | None:
    """`partitioner.memory_limit` in bytes: None, one size, or a comma-separated size per stage.

    >>> parse_memory_limit(None), parse_memory_limit("1KiB"), parse_memory_limit("1KiB, 2KiB")
    (None, 1024, [1024, 2048])
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none")):
        return None
    if isinstance(value, str) and "," in value:
        return [parse_size(part) for part in value.split(",")]
    return parse_size(value)


def count_pipeline_layers(model: Any) -> int:
    """Pipeline layers of a model config without building it (embedding + blocks + head).

    >>> count_pipeline_layers({"name": "gpt", "layers": 4})
    6
    """
    model = model_config(model)
    if isinstance(model, MLPConfig):
        return (len(model.widths) if model.widths else int(model.depth)) + 2
    facts = pretrained_facts(model)
    if facts is not None:
        return facts["num_layers"] + 2
    return int(model.layers) + 2


def pretrained_facts(model: Any) -> dict | None:
    """For a Hugging Face model config with `pretrained` set: the directory's facts
    (`num_layers`, `vocab`, `tie`, `model_type`, `learned_positions`), read from its
    config.json without loading weights; None for other models. A bad directory is a ConfigError."""
    model = model_config(model)
    if not isinstance(model, HFModelConfig) or not model.pretrained:
        return None
    from experiments.models.hf_load import pretrained_facts as facts

    try:
        return facts(str(model.pretrained))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"model.pretrained: {exc}") from None


HF_MODELS = ("hf", "hf_gpt2", "hf_llama")

MODEL_SCHEMAS: dict[str, type[ModelConfig]] = {"gpt": GPTConfig, "mlp": MLPConfig,
                                               **{name: HFModelConfig for name in HF_MODELS}}
"""The schema of each `model` option, by `model.name`."""
DATA_SCHEMAS: dict[str, type[DataConfig]] = {"text": TextDataConfig, "synthetic": SyntheticDataConfig,
                                             "hf": HFDataConfig}
"""The schema of each `data` option, by `data.name`."""


# --------------------------------------------------------------------------- the typed object
def as_config(cfg: Any) -> Config:
    """The typed `Config`: a composed `DictConfig` turned into the schema's dataclasses once
    (`OmegaConf.to_object`), a `Config` as it is, or nested plain dicts (a saved config, a test's)
    built into the dataclasses (groups missing from them get the schema's defaults).

    >>> as_config({"model": {"name": "gpt", "layers": 2}, "data": {"name": "text"}}).model.layers
    2
    """
    return _typed(Config, cfg, "")


def model_config(model: Any, schema: type[ModelConfig] = ModelConfig) -> ModelConfig:
    """The typed `model` group (`GPTConfig`, `MLPConfig` or `HFModelConfig`, chosen by `name`, or
    the given `schema`) of a `DictConfig`, a dataclass or a plain dict (a checkpoint's manifest, a
    test's); a mapping's missing fields take the schema's defaults.

    >>> model_config({"name": "mlp", "depth": 3}).depth, model_config({"layers": 2}, GPTConfig).dim
    (3, 128)
    """
    return _typed(schema, model, "model")


def _typed(cls: type, value: Any, where: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, DictConfig):
        value = OmegaConf.to_object(value)
        if isinstance(value, cls):
            return value
    return _build(cls, value, where)


def _build(cls: type, mapping: Any, where: str) -> Any:
    """`cls(**mapping)` with nested groups built too, choices made members where they name one
    (an unknown one is left for `validate_config` to name), and unknown keys refused."""
    import typing
    from collections.abc import Mapping

    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{where or 'the config'} must be a mapping of keys, got {mapping!r}")
    schemas = {ModelConfig: MODEL_SCHEMAS, DataConfig: DATA_SCHEMAS}.get(cls)
    if schemas is not None:  # the option's schema, by its name
        name = choice_text(mapping.get("name"))
        if name not in schemas:
            raise ConfigError(f"unknown {where}={name!r}; choose one of {sorted(schemas)}")
        cls = schemas[name]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(mapping) - set(hints))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{where}.{k}'.lstrip('.') for k in unknown)}; "
                          f"{where or 'the config'} has {', '.join(sorted(hints))}")
    return cls(**{k: _member(hints[k], v, f"{where}.{k}".lstrip(".")) for k, v in mapping.items()})


def _member(hint: Any, value: Any, where: str) -> Any:
    import dataclasses
    import typing

    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for kind in kinds:
        if dataclasses.is_dataclass(kind) and not isinstance(value, kind) and value is not None:
            return _typed(kind, value, where)
        if isinstance(kind, type) and issubclass(kind, Choice) and isinstance(value, str):
            return kind(value) if value in kind._value2member_map_ else value
    return value


def _plain(value: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return choice_text(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_plain_dict(cfg: Any) -> dict:
    """The resolved config as plain Python (choices as strings): for W&B, JSON and `plan.json`.

    >>> to_plain_dict(PipelineConfig())["schedule"]
    '1f1b'
    """
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
    return _plain(cfg)


def optimizer_kwargs(cfg: Any) -> dict:
    """Keyword arguments for `engine.OptimizerConfig` from the `optimizer` group (or the whole config).

    >>> optimizer_kwargs({"name": "sgd", "lr": 0.1})["name"]
    'sgd'
    """
    if isinstance(cfg, OptimConfig):
        opt = cfg
    elif isinstance(cfg, Config) or (isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is Config):
        whole = as_config(cfg)  # the whole config
        opt = whole.optimizer
        if str(opt.reshard_after_forward).lower() == "auto":  # auto: reshard iff memory-limited
            limited = whole.partitioner.memory_limit not in (None, "")
            opt = dataclasses.replace(opt, reshard_after_forward="true" if limited else "false")
    else:
        opt = _typed(OptimConfig, cfg, "optimizer")
    return {**_plain(opt), "betas": None if opt.betas is None else tuple(float(b) for b in opt.betas)}


def validate_config(cfg: Any) -> Config:
    """Cross-field checks run before any worker starts; raises `ConfigError` saying how to fix it.

    Takes the typed `Config` (a composed `DictConfig` or nested dicts are turned into it first,
    `as_config`) and returns it. The schedule, precision, optimizer and ZeRO rules are the
    engine's (`engine.schedules`, `engine.choices`); this function names the config keys that
    break them.
    """
    cfg = as_config(cfg)
    _check_counts(cfg)
    _check_tensor_parallel(cfg)
    _check_batch(cfg)
    _check_schedule(cfg)
    _check_layers(cfg)
    _check_precision(cfg)
    _check_memory_limit(cfg)
    _check_node_size(cfg)
    _check_optimizer(cfg)
    _check_checkpointing(cfg)
    _check_model_and_data(cfg)
    _check_intervals(cfg)
    return cfg


def _check_intervals(cfg: Config) -> None:
    train = cfg.train
    for key, value in (("train.log_every", train.log_every), ("train.eval_every", train.eval_every),
                       ("checkpoint.every_steps", cfg.checkpoint.every_steps),
                       ("train.max_restarts", train.max_restarts)):
        if value is not None and int(value) < 0:
            raise ConfigError(f"{key}={value}; it must be >= 0 (0 turns it off)")
    if int(train.max_restarts or 0) > 0 and not int(cfg.checkpoint.every_steps or 0):
        raise ConfigError(f"train.max_restarts={train.max_restarts} restarts a failed job from its newest "
                          "checkpoint, but checkpoint.every_steps=0 writes none; set checkpoint.every_steps (e.g. 50)")


def configured_microbatches(cfg: Any) -> int | None:
    """`pipeline.microbatches` as a count, or None for `auto` (the planner chooses).

    >>> configured_microbatches(Config(pipeline=PipelineConfig(microbatches="auto")))
    >>> configured_microbatches(Config(pipeline=PipelineConfig(microbatches=8)))
    8
    """
    value = as_config(cfg).pipeline.microbatches
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise ConfigError(f"pipeline.microbatches={value!r}; give a count (e.g. pipeline.microbatches=8) or "
                          "pipeline.microbatches=auto to let the planner choose")
    return int(value)


def searches(cfg: Any) -> bool:
    """Whether the planner chooses the layout: `pipeline.schedule=auto`, `pipeline.microbatches=auto`,
    `pipeline.recompute_granularity=auto` or `model.sequence_parallel=auto` (`partitioner.search`)."""
    cfg = as_config(cfg)
    return (choice_text(cfg.pipeline.schedule) == AUTO or configured_microbatches(cfg) is None
            or choice_text(cfg.pipeline.recompute_granularity) == AUTO or sequence_parallel_setting(cfg.model) == AUTO)


def sequence_parallel_setting(model: Any) -> bool | str:
    """`model.sequence_parallel` as True, False or "auto" (ConfigError otherwise; False for a model
    group without it)."""
    try:
        return sequence_parallel_mode(getattr(model, "sequence_parallel", False))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def sequence_parallel_problem_at(model: Any, tp: int) -> str | None:
    """Why the model cannot run sequence parallelism over `tp` ranks, or None: the one rule for
    `model.sequence_parallel` (true is refused with it, auto plans it only where it is None): more
    than one tp rank, the GPT or a Hugging Face family whose plan allows it
    (`experiments.models.hf.sequence_parallel_problem`), `model.seq_len` divisible by tp."""
    if int(tp) <= 1:
        return "it needs pipeline.tensor_parallel > 1"
    if not isinstance(model, (GPTConfig, HFModelConfig)):
        return f"model={choice_text(model.name)} has no tensor-parallel plan"
    if isinstance(model, HFModelConfig):
        from experiments.models.hf import sequence_parallel_problem

        problem = sequence_parallel_problem(_hf_transformers_config(model))
        if problem is not None:
            return problem
    if int(model.seq_len) % int(tp):
        return f"pipeline.tensor_parallel={tp} does not divide model.seq_len={model.seq_len}"
    return None


def _layout(cfg: Config) -> tuple[int, int | None, int, int]:
    """(stages, microbatches or None for auto, virtual stages, replicas) of `pipeline`."""
    p = cfg.pipeline
    return int(p.stages), configured_microbatches(cfg), int(p.virtual_stages), int(p.data_parallel)


def _check_counts(cfg: Config) -> None:
    stages, micro, virtual, dp = _layout(cfg)
    for key, value in (("pipeline.stages", stages), ("pipeline.microbatches", 1 if micro is None else micro),
                       ("pipeline.virtual_stages", virtual), ("pipeline.data_parallel", dp),
                       ("train.batch_size", int(cfg.train.batch_size)),
                       ("train.steps", int(cfg.train.steps))):
        if value < 1:
            raise ConfigError(f"{key}={value}; it must be at least 1")


def _check_tensor_parallel(cfg: Config) -> None:
    """`pipeline.tensor_parallel` > 1 (`engine.tp`): a model with a plan whose sizes it divides, on
    the torch optimizer backend (ZeRO 0, fp32 weights), untied, full loss, a fixed layout."""
    tp = int(cfg.pipeline.tensor_parallel)
    if tp < 1:
        raise ConfigError(f"pipeline.tensor_parallel={tp}; it must be at least 1")
    if tp == 1:
        return
    key, off = f"pipeline.tensor_parallel={tp}", "or set pipeline.tensor_parallel=1"
    name = choice_text(cfg.model.name)
    if name not in ("gpt", *HF_MODELS):
        raise ConfigError(f"{key}: model={name} has no tensor-parallel plan; use model=gpt or a Hugging Face "
                          f"model, {off}")
    zero, backend = int(cfg.optimizer.zero_stage), choice_text(cfg.optimizer.backend)
    if zero in (1, 2) or backend != "auto":
        raise ConfigError(f"{key} with optimizer.zero_stage={zero} (backend {backend}) is not built: tensor "
                          "parallelism runs on the torch optimizer backend (zero_stage=0) or FSDP2 (zero_stage=3, "
                          f"Hugging Face models); set optimizer.backend=auto and optimizer.zero_stage=0 or 3, {off}")
    if zero == 3 and name == "gpt":
        raise ConfigError(f"{key} with optimizer.zero_stage=3 is not built for model=gpt (FSDP2 cannot re-shard "
                          "its fused q/k/v, split over tp part by part); set optimizer.zero_stage=0, or use a "
                          f"Hugging Face model (separate q/k/v projections), {off}")
    from engine.choices import weight_bytes

    precision = choice_text(cfg.precision)
    if precision in PRECISIONS and weight_bytes(precision) < 4:
        raise ConfigError(f"{key} with precision={precision} (16-bit weights, DeepSpeed's fp32 masters) is not "
                          f"built; use precision={precision}-autocast or fp32, {off}")
    if choice_text(cfg.model.loss) != "full":
        raise ConfigError(f"{key} with model.loss=chunked is not built; use model.loss=full (the "
                          f"vocabulary-parallel loss never gathers the logits), {off}")
    if choice_text(cfg.optimizer.step_sync) == "post_validate":
        raise ConfigError(f"{key} with optimizer.step_sync=post_validate is not built (its rank-local norm does "
                          f"not sum the tp shards); set optimizer.step_sync=global, {off}")
    # (the GPT under ZeRO-3 is refused above: its fused q/k/v; with sequence parallelism its
    # position table's gradient is also summed over tp by the engine)
    if zero == 3 and "replicated_with_grad_allreduce" in {
            str(v) for v in (getattr(_hf_transformers_config(cfg.model), "base_model_tp_plan", None) or {}).values()}:
        raise ConfigError(f"{key} with optimizer.zero_stage=3 does not support weights whose gradient is summed "
                          "over the tp ranks (a plan's replicated_with_grad_allreduce norms); "
                          f"set optimizer.zero_stage=0, {off}")
    for what, size in _tp_sizes(cfg.model).items():
        if size is not None and int(size) % tp:
            raise ConfigError(f"{key} does not divide {what}={size}; choose a tensor_parallel that divides the "
                              "attention heads, key/value heads, hidden size, MLP width and vocabulary")
    problem = sequence_parallel_problem_at(cfg.model, tp) if sequence_parallel_setting(cfg.model) is True else None
    if problem is not None:
        raise ConfigError(f"model.sequence_parallel=true: {problem}; set model.sequence_parallel=false "
                          "(or auto: the planner plans it where it runs)")


def _hf_transformers_config(model: HFModelConfig) -> Any:
    """The transformers config of an `hf` model group: the pretrained directory's, else the random
    model's (`experiments.models.hf.hf_config`)."""
    if model.pretrained:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(model.pretrained))
    from experiments.models.hf import hf_config

    return hf_config(model)


def _tp_sizes(model: Any) -> dict[str, Any]:
    """The sizes tensor parallelism splits (heads, KV heads, hidden, MLP width, vocabulary), by
    the config key (or the pretrained config.json field) that sets them. A tied model, a model
    without transformers' `base_model_tp_plan` or a mixture-of-experts one is a ConfigError."""
    if isinstance(model, GPTConfig):
        if model.tie_embeddings:
            raise ConfigError("pipeline.tensor_parallel > 1 does not support tied weights; set "
                              "model.tie_embeddings=false, or pipeline.tensor_parallel=1")
        return {"model.heads": model.heads, "model.dim": model.dim, "model.vocab": model.vocab,
                "model.dim x model.mlp_ratio": model.dim * model.mlp_ratio}
    config = _hf_transformers_config(model)
    where = f"{model.pretrained}'s " if model.pretrained else "model."
    mtype = getattr(config, "model_type", "?")
    if not getattr(config, "base_model_tp_plan", None):
        raise ConfigError(f"pipeline.tensor_parallel > 1: model type {mtype!r} ships no base_model_tp_plan in "
                          "transformers; use a family that does (llama, mistral, qwen2, qwen3, phi3, gpt_neox, "
                          "...), or pipeline.tensor_parallel=1")
    if any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ConfigError(f"pipeline.tensor_parallel > 1 does not support mixture-of-experts models ({mtype}); "
                          "set pipeline.tensor_parallel=1")
    if getattr(config, "tie_word_embeddings", False):
        raise ConfigError("pipeline.tensor_parallel > 1 does not support tied weights; set "
                          "model.tie_embeddings=false (a random model), or pipeline.tensor_parallel=1")
    heads = getattr(config, "num_attention_heads", None)
    return {f"{where}heads": heads, f"{where}kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            f"{where}dim": getattr(config, "hidden_size", None),
            f"{where}intermediate": getattr(config, "intermediate_size", None),
            f"{where}vocab": getattr(config, "vocab_size", None)}


def _check_batch(cfg: Config) -> None:
    stages, micro, _, dp = _layout(cfg)
    batch = int(cfg.train.batch_size)
    if micro is None:  # auto: the batch per replica must hold at least one microbatch per stage
        if batch % dp or batch // dp < stages:
            fixed = dp * stages * max(1, -(-batch // (dp * stages)))
            raise ConfigError(
                f"pipeline.microbatches=auto chooses a divisor of the batch per replica that is at least "
                f"pipeline.stages={stages}, but train.batch_size={batch} over pipeline.data_parallel={dp} replicas "
                f"does not allow one; set train.batch_size to a multiple of {dp * stages} (e.g. train.batch_size={fixed})")
        return
    per_step = dp * micro
    if batch % per_step:
        fixed = max(per_step, round(batch / per_step) * per_step)
        raise ConfigError(
            f"train.batch_size={batch} does not split into pipeline.data_parallel={dp} replicas x "
            f"pipeline.microbatches={micro} microbatches; set train.batch_size to a multiple of {per_step} "
            f"(e.g. train.batch_size={fixed}) or change pipeline.microbatches"
        )


def _check_schedule(cfg: Config) -> None:
    """The schedule's own rules (`engine.schedules.build_schedule`), with the config keys named."""
    from engine.schedules import SCHEDULES, build_schedule

    stages, micro, virtual, _ = _layout(cfg)
    schedule = choice_text(cfg.pipeline.schedule)
    if schedule not in (*SCHEDULES, AUTO):
        raise ConfigError(f"pipeline.schedule={schedule!r}; choose one of {list(SCHEDULES)} or {AUTO!r}")
    cap = cfg.pipeline.max_inflight
    _check_search(cfg, schedule, cap, stages)
    if schedule == AUTO:
        return
    try:  # with microbatches=auto, a count the schedule surely takes: one it may refuse is not searched
        build_schedule(schedule, stages, stages if micro is None else micro, virtual,
                       max_inflight=None if cap is None else int(cap))
    except ValueError as err:
        raise ConfigError(
            f"pipeline.schedule={schedule} cannot run pipeline.stages={stages}, pipeline.microbatches="
            f"{'auto' if micro is None else micro}, pipeline.virtual_stages={virtual}"
            + ("" if cap is None else f", pipeline.max_inflight={cap}") + f": {err}") from None


def _check_search(cfg: Config, schedule: str, cap: Any, stages: int) -> None:
    """`partitioner.search` (read only when the planner chooses), and `pipeline.max_inflight` under auto."""
    from engine.schedules import SCHEDULE_INFO, build_schedule

    listed = cfg.partitioner.search.schedules
    unknown = sorted(set(map(choice_text, listed or ())) - set(SCHEDULES))
    if unknown:
        raise ConfigError(f"partitioner.search.schedules has unknown schedules {unknown}; choose from {list(SCHEDULES)}")
    if int(cfg.partitioner.search.max_virtual_stages) < 2:
        raise ConfigError("partitioner.search.max_virtual_stages must be >= 2 (interleaved-1f1b runs 2 or more "
                          "chunks per rank)")
    if schedule != AUTO or cap is None:
        return
    knobs = [n for n, i in SCHEDULE_INFO.items() if i.memory_knob]
    if listed and not set(knobs) & set(map(choice_text, listed)):
        raise ConfigError(f"pipeline.max_inflight={cap} only applies to {', '.join(knobs)}, which "
                          "partitioner.search.schedules leaves out; add it or set pipeline.max_inflight=null")
    try:
        build_schedule(knobs[0], stages, stages, max_inflight=int(cap))
    except ValueError as err:
        raise ConfigError(f"pipeline.max_inflight={cap}: {err}") from None


def _check_layers(cfg: Config) -> None:
    stages, _, virtual, _ = _layout(cfg)
    if choice_text(cfg.pipeline.schedule) == AUTO:
        virtual = 1  # chosen by the search, which needs one layer per chunk of the layouts it tries
    layers, chunks = count_pipeline_layers(cfg.model), stages * virtual
    if layers < chunks:
        raise ConfigError(
            f"the model has {layers} pipeline layers but pipeline.stages x pipeline.virtual_stages = {chunks} "
            f"chunks need at least one layer each; use fewer stages (pipeline.stages<={layers // virtual}) "
            f"or a deeper model"
        )


def _check_precision(cfg: Config) -> None:
    from engine.choices import PRECISIONS, precision_problem

    precision = choice_text(cfg.precision)
    problem = precision_problem(precision)
    if problem is not None:
        raise ConfigError(f"precision={precision!r}; choose exactly one of {list(PRECISIONS)} "
                          f"(e.g. precision=bf16); {problem}")


def _check_memory_limit(cfg: Config) -> None:
    stages = _layout(cfg)[0]
    try:
        limit = parse_memory_limit(cfg.partitioner.memory_limit)
    except ConfigError as err:
        raise ConfigError(f"partitioner.memory_limit: {err}") from None
    if isinstance(limit, list) and len(limit) != stages:
        raise ConfigError(
            f"partitioner.memory_limit gives {len(limit)} per-stage sizes for pipeline.stages={stages}; "
            f"give one size for all stages or exactly {stages} comma-separated sizes"
        )


def _check_node_size(cfg: Config) -> None:
    """`partitioner.gpus_per_node`: a count >= 1, set only where the plan prices its collectives and
    transfers on a GPU preset's links (`experiments.wiring.device_links`): elsewhere it would
    change nothing, so it is refused rather than ignored."""
    part = cfg.partitioner
    value = part.gpus_per_node
    if value is None:
        return
    if isinstance(value, bool) or int(value) < 1:
        raise ConfigError(f"partitioner.gpus_per_node={value!r}; give the GPUs one node holds (e.g. "
                          "partitioner.gpus_per_node=8), or null for the device spec's own (8 on the GPU presets)")
    from partitioner.devices import DEVICE_PRESETS

    mode, name = choice_text(part.profile), part.device_spec
    spec = DEVICE_PRESETS.get(str(name).lower()) if name is not None else None
    if mode != "analytic" or spec is None or spec.links is None:
        why = (f"partitioner.profile={mode} (measured layers: no device-spec links)" if mode != "analytic" else
               "partitioner.device_spec=null (this CPU, measured: no links)" if name is None else
               f"partitioner.device_spec={name} has no links (the presets with links: "
               f"{', '.join(k for k, v in DEVICE_PRESETS.items() if v.links is not None)})")
        raise ConfigError(f"partitioner.gpus_per_node={value} sets the node size of a GPU preset's links, but {why}, "
                          "so it would change nothing; set partitioner.gpus_per_node=null, or plan on a GPU preset "
                          "(partitioner.profile=analytic partitioner.device_spec=h100)")


def _check_optimizer(cfg: Config) -> None:
    from engine.choices import FSDP_ZERO_STAGE, ZERO_STAGES, check_grad_accum_dtype, resolve_backend

    zero = int(cfg.optimizer.zero_stage)
    if zero not in ZERO_STAGES + (FSDP_ZERO_STAGE,):
        raise ConfigError(f"optimizer.zero_stage={zero}; choose 0 (off), 1 (optimizer state), 2 (+ gradients) "
                          "or 3 (+ parameters, on torch's FSDP2)")
    if str(cfg.optimizer.reshard_after_forward).lower() not in ("auto", "true", "false"):
        raise ConfigError(f"optimizer.reshard_after_forward={cfg.optimizer.reshard_after_forward!r}; "
                          "choose auto, true or false")
    if zero == FSDP_ZERO_STAGE and choice_text(cfg.optimizer.backend) != "auto":
        raise ConfigError(f"optimizer.zero_stage=3 runs on torch's FSDP2, not optimizer.backend="
                          f"{choice_text(cfg.optimizer.backend)} (DeepSpeed's ZeRO-3 cannot run pipeline "
                          "stages); set optimizer.backend=auto, or use optimizer.zero_stage=1 or 2")
    if float(cfg.optimizer.lr) <= 0:
        raise ConfigError("optimizer.lr must be positive, e.g. optimizer.lr=3e-3")
    precision = choice_text(cfg.precision)
    backend = choice_text(cfg.optimizer.backend)
    if backend == "torch" and zero > 0:
        raise ConfigError(
            f"optimizer.zero_stage={zero} needs DeepSpeed; set optimizer.backend=auto (or deepspeed), "
            "or optimizer.zero_stage=0")
    try:
        resolved = resolve_backend(backend, zero, precision)
        check_grad_accum_dtype(choice_text(cfg.optimizer.grad_accum_dtype), precision)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    sync = choice_text(cfg.optimizer.step_sync)
    if sync == "post_validate" and resolved != "torch":
        raise ConfigError(
            f"optimizer.step_sync=post_validate rolls back a rank's update, which only the torch "
            f"optimizer backend can do; this run resolves to the {resolved} backend "
            f"(optimizer.zero_stage={zero}, precision={precision}): set optimizer.step_sync=global, "
            "or optimizer.zero_stage=0 with fp32 weights (precision fp32, bf16-autocast or fp16-autocast)")


def checkpointing_mode(value: Any) -> bool | str:
    """`pipeline.activation_checkpointing` as False, True or "auto" (ConfigError otherwise); what
    each means is the partitioner's rule (`partitioner.planner.CHECKPOINTING`).

    >>> checkpointing_mode("auto"), checkpointing_mode(False), checkpointing_mode("true")
    ('auto', False, True)
    """
    try:
        mode = _recompute_mode(choice_text(value))
    except ValueError:
        raise ConfigError(f"pipeline.activation_checkpointing={value!r}; choose false (no chunk recomputes), true "
                          "(every chunk recomputes) or auto (the partitioner recomputes per chunk only where the "
                          "memory limit needs it)") from None
    return {"off": False, "on": True}.get(mode, mode)


def _check_checkpointing(cfg: Config) -> None:
    checkpointing_mode(cfg.pipeline.activation_checkpointing)
    sequence_parallel_setting(cfg.model)
    if choice_text(cfg.pipeline.recompute_granularity) != AUTO:
        try:
            check_recompute_granularity(cfg.pipeline.recompute_granularity)
        except ValueError as exc:
            raise ConfigError(f"pipeline.{exc} (or auto: the planner chooses)") from None
    if int(cfg.train.memory_every or 0) < 0:
        raise ConfigError("train.memory_every must be >= 0 (0 turns the memory measurement off)")


def _check_model_and_data(cfg: Config) -> None:
    model, stages = cfg.model, _layout(cfg)[0]
    model_name = choice_text(model.name)
    facts = pretrained_facts(model)
    tied = facts["tie"] if facts else (not isinstance(model, MLPConfig) and bool(model.tie_embeddings))
    if int(cfg.optimizer.zero_stage) == 2 and tied and stages > 1:
        raise ConfigError(
            f"optimizer.zero_stage=2 cannot be used with model.tie_embeddings=true over pipeline.stages={stages}: "
            "the embedding (first stage) and the head (last stage) share a weight whose gradients are summed "
            "between stages, but ZeRO-2 shards gradients during backward; set optimizer.zero_stage=1, or "
            "model.tie_embeddings=false"
        )
    if int(cfg.optimizer.zero_stage) == 3 and tied:
        raise ConfigError(
            "optimizer.zero_stage=3 (FSDP2) does not support tied weights yet (model.tie_embeddings=true); "
            "set model.tie_embeddings=false, or use optimizer.zero_stage=1"
        )
    data_name = choice_text(cfg.data.name)
    if model_name == "mlp" and data_name != "synthetic":
        raise ConfigError(f"model=mlp takes feature vectors, not text; use data=synthetic (got data={data_name})")
    if data_name == "hf":
        _check_hf_data(cfg)
    if facts is not None:
        _check_pretrained(model, facts, data_name)
    elif model_name in ("gpt", *HF_MODELS):
        vocab = int(model.vocab)
        if data_name == "text" and vocab < 256:
            raise ConfigError(f"data=text is byte-level (256 symbols) but model.vocab={vocab}; set model.vocab>=256")
        dim, heads = int(model.dim), int(model.heads)
        if dim % heads:
            raise ConfigError(f"model.dim={dim} is not divisible by model.heads={heads}; choose heads dividing dim")


def _check_hf_data(cfg: Config) -> None:
    """`data=hf` settings that need no file access (the files are checked by `hfdata.prepare`)."""
    from experiments.hfdata.layout import DataError, Holdout, ShardLayout
    from experiments.hfdata.tokens import tokenizer_dir

    data = cfg.data
    if data.files in (None, "", []):
        raise ConfigError("data=hf needs data.files: a file, directory or glob of your text, e.g. "
                          "data.files='corpus/*.jsonl' (or a list: data.files=[a.txt,b.jsonl])")
    dp = int(cfg.pipeline.data_parallel)
    shards = data.shards
    try:
        tokenizer_dir(data.tokenizer, (cfg.model.pretrained if isinstance(cfg.model, HFModelConfig) else None))
        Holdout(float(data.eval_fraction))
        ShardLayout(int(shards) if shards is not None else dp, int(cfg.train.batch_size), dp)
    except DataError as err:
        raise ConfigError(str(err)) from None
    if bool(data.streaming) and bool(data.shuffle):
        raise ConfigError("data.shuffle=true cannot be used with data.streaming=true (streaming reads the "
                          "files in order); shuffle the files beforehand, or set data.streaming=false")
    if int(data.prefetch) < 1:
        raise ConfigError(f"data.prefetch={data.prefetch}; it must be at least 1")


def _check_pretrained(model: HFModelConfig, facts: dict, data_name: str) -> None:
    """A pretrained model against the data and sequence length."""
    where = f"the model in model.pretrained={model.pretrained}"
    if data_name == "text" and facts["vocab"] < 256:
        raise ConfigError(f"data=text is byte-level (256 symbols) but {where} has a vocabulary of {facts['vocab']}")
    if data_name == "synthetic" and int(model.vocab) > facts["vocab"]:
        raise ConfigError(f"data=synthetic draws tokens below model.vocab={model.vocab} but {where} has a "
                          f"vocabulary of {facts['vocab']}; set model.vocab={facts['vocab']}")
    if facts.get("logit_softcap") is not None and choice_text(model.loss) == "chunked":
        raise ConfigError(f"model.loss=chunked cannot soft-cap the logits of {where} (final_logit_softcapping="
                          f"{facts['logit_softcap']}); set model.loss=full")
    learned = facts["learned_positions"]
    if learned is not None and int(model.seq_len) > learned:
        raise ConfigError(f"model.seq_len={model.seq_len} exceeds the {learned} positions of {where}; "
                          f"set model.seq_len<={learned}")
