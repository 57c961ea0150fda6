"""`python -m experiments.generate [overrides]`: pipelined generation with a KV cache per stage.

    python -m experiments.generate model=hf model.pretrained=DIR pipeline.stages=2 \\
        generate.prompts='[[1,2,3],[4,5,6,7]]' generate.max_new_tokens=32

The model is split over `pipeline.stages` ranks (balanced by each layer's decode-step time,
measured in the launcher one layer at a time: `decode_costs`), each rank builds (or loads)
only its own layers and `engine.generate.Generator` runs the forward-only schedule: the prompts,
left-padded, go through the stages in `generate.microbatches` microbatches, every stage keeps a
KV cache per microbatch, and the last stage samples (greedy, or temperature / top-k / top-p
with `generate.seed`) and hands the token back to the first.

Writes into the Hydra run directory:
    generations.jsonl   one `{"prompt": [...], "tokens": [...]}` per prompt, in order
    generation.json     tokens/s pipelined and with transformers' `model.generate` in one process
                        (`generate.compare`), their ratio, whether the tokens agree, per-rank times

Throughput: both sides run one thread per process and count the tokens they generated (fewer than
prompts x max_new_tokens where prompts stop at eos); `cpu_s` per rank and `single_cpu_s` are CPU
seconds (`time.process_time`), which a busy machine does not inflate as it does wall time.

Example:
    >>> read_prompts([[1, 2], [3]])
    [[1, 2], [3]]
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from experiments.config import Config, ConfigError, HFModelConfig, as_config, count_pipeline_layers

__all__ = ["GenerateJob", "read_prompts", "encode_prompts", "weight_dtype", "stage_split", "decode_costs", "token_ids", "generate_worker",
           "single_process_generate", "run", "main"]


@dataclass
class GenerateJob:
    """What every rank needs (picklable): the typed config, the prompts, the split and the ids."""

    config: Config
    prompts: list
    stage_ranges: list
    eos_token_id: Any
    pad_token_id: int


def read_prompts(value: Any) -> list[list[int]] | list[str]:
    """Prompts from `generate.prompts`: token-id lists or strings inline, or a file: a JSON list,
    JSONL lines (each a list, a string or `{"prompt": ...}`), or plain text, one prompt per line.
    Strings are text for the model's tokenizer (:func:`encode_prompts`)."""
    from omegaconf import ListConfig, OmegaConf

    if isinstance(value, ListConfig):
        value = OmegaConf.to_container(value)
    if value is None:
        raise ConfigError("generate.prompts is not set; give token-id lists, e.g. generate.prompts='[[1,2,3],[4,5]]', "
                          "strings for the model's tokenizer ('[\"Once upon a time\"]'), or a JSON / JSONL / text file")
    if isinstance(value, str):
        value = _prompts_file(value)
    if isinstance(value, list):
        value = [v["prompt"] if isinstance(v, dict) and "prompt" in v else v for v in value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        empty = [j for j, v in enumerate(value) if not v.strip()]
        if empty:
            raise ConfigError(f"generate.prompts: prompt {empty[0]} is an empty string; remove it")
        return value
    from engine.generate import check_prompts

    try:
        return check_prompts(value, 1)
    except ValueError as exc:
        raise ConfigError(f"generate.prompts: {exc}") from None


def _prompts_file(value: str) -> Any:
    path = Path(value).expanduser()
    try:
        text = path.read_text() if path.is_file() else value
    except OSError as exc:
        raise ConfigError(f"generate.prompts={value!r}: {exc}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        if path.is_file():  # plain text: one prompt per line
            return lines
    raise ConfigError(f"generate.prompts={value!r} is neither a file nor JSON; give token-id lists, a list of "
                      "strings ('[\"Once upon a time\"]') or a file (JSON, JSONL or text, one prompt per line)")


def encode_prompts(cfg: Config, texts: Sequence[str]) -> tuple[list[list[int]], Any]:
    """Text prompts as token ids through the model's own tokenizer (`model.pretrained`), with its
    special tokens (a BOS where the tokenizer adds one), as one would before `model.generate`.
    Returns (ids, tokenizer)."""
    from experiments.hfdata.layout import DataError
    from experiments.hfdata.tokens import load_tokenizer

    if not cfg.model.pretrained:
        raise ConfigError("text prompts need the model's tokenizer: use model.pretrained=DIR (a directory "
                          "with tokenizer files), or give token-id lists")
    try:
        tok = load_tokenizer(str(cfg.model.pretrained))
    except DataError as exc:
        raise ConfigError(f"generate.prompts are text: {exc}") from None
    ids = [list(map(int, t)) for t in tok(list(texts))["input_ids"]]
    empty = [j for j, t in enumerate(ids) if not t]
    if empty:
        raise ConfigError(f"generate.prompts: prompt {empty[0]} ({texts[empty[0]]!r}) has no tokens")
    return ids, tok


def stage_split(spec: Any, stages: int, costs: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Contiguous stage ranges balancing `costs` per pipeline layer (:func:`decode_costs`), or
    without them the parameters that compute (embedding lookups are free)."""
    from torch import nn

    from partitioner.meta import meta_device
    from partitioner.solve import Infeasible, parameter_split

    if costs is None:
        costs = []
        with meta_device():
            for factory in spec.layers:
                layer = factory()
                lookup = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Embedding))
                costs.append(max(1, sum(p.numel() for p in layer.parameters()) - lookup))
    try:
        return [tuple(r) for r in parameter_split(list(costs), stages)]
    except Infeasible as exc:
        raise ConfigError(f"pipeline.stages={stages}: {exc}") from None


def decode_costs(spec: Any, rows: int, prompt_len: int, dtype: Any, steps: int = 5) -> list[float]:
    """Seconds of one decode step of each pipeline layer (the median over `steps` steps), for
    `rows` prompts of `prompt_len` tokens, one thread: the layers, with random weights (the time
    does not depend on them), run in order through the model's cached chunk, a step at a time,
    so that the caches see what a real step sees. A parameter count misjudges decoding: a
    block's many small kernels cost more per parameter than the head's one large product."""
    import statistics

    import torch

    from engine.generate import cast_parameters

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    vocab = int(spec.extra["vocab"])
    with torch.no_grad():
        chunks = [spec.cached_chunk([cast_parameters(f().eval(), dtype)]) for f in spec.layers]
        caches = [c.new_cache(rows) for c in chunks]
        mask = torch.ones(rows, prompt_len, dtype=torch.int64)
        x = torch.randint(0, vocab, (rows, prompt_len), generator=gen)
        times: list[list[float]] = [[] for _ in chunks]
        try:
            for step in range(steps + 1):  # the prefill, then decode steps
                y = x
                for j, (chunk, cache) in enumerate(zip(chunks, caches)):
                    t = time.perf_counter()
                    y = chunk(y, cache, mask)
                    if step:
                        times[j].append(time.perf_counter() - t)
                x = y[:, -1].argmax(-1, keepdim=True)
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        finally:
            torch.set_num_threads(threads)
    return [statistics.median(t) for t in times]


def token_ids(cfg: Any, spec: Any) -> tuple[Any, int]:
    """(eos, pad) ids: `generate.eos_token_id` / `pad_token_id`, else the model's (its
    generation_config.json, then config.json), pad falling back to eos, then 0."""
    config = json.loads(spec.extra.get("hf_config_json") or "{}")
    pretrained = spec.extra.get("pretrained")
    gen_file = Path(pretrained) / "generation_config.json" if pretrained else None
    if gen_file is not None and gen_file.is_file():
        config = {**config, **{k: v for k, v in json.loads(gen_file.read_text()).items() if v is not None}}
    eos = cfg.generate.eos_token_id
    eos = config.get("eos_token_id") if eos is None else (None if int(eos) < 0 else int(eos))
    pad = cfg.generate.pad_token_id
    if pad is None:
        pad = config.get("pad_token_id")
    if pad is None:
        pad = eos[0] if isinstance(eos, list) and eos else eos
    return eos, int(pad) if pad is not None else 0


def weight_dtype(cfg: Config) -> Any:
    """The torch dtype of `generate.dtype`."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[str(cfg.generate.dtype)]


def _sampling(cfg: Config) -> Any:
    from engine.generate import SamplingConfig

    g = cfg.generate
    return SamplingConfig(do_sample=bool(g.do_sample), temperature=float(g.temperature),
                          top_k=int(g.top_k), top_p=float(g.top_p), seed=int(g.seed))


def generate_worker(job: GenerateJob) -> dict:
    """One rank: build its layers, run the pipelined generation; every rank returns the result."""
    import torch

    from engine.generate import Generator
    from experiments.models import build_model

    torch.set_num_threads(1)
    cfg = job.config
    spec = build_model(cfg.model)
    device = None if cfg.train.device == "auto" else str(cfg.train.device)
    gen = Generator(spec.layers, job.stage_ranges, chunk=spec.cached_chunk, seed=int(cfg.train.seed),
                    device=device, ties=spec.ties, comm_timeout_s=float(cfg.pipeline.comm_timeout_s),
                    dtype=weight_dtype(cfg))
    res = gen.generate(job.prompts, int(cfg.generate.max_new_tokens), sampling=_sampling(cfg),
                       microbatches=cfg.generate.microbatches,
                       microbatch_size=cfg.generate.microbatch_size, pad_token_id=job.pad_token_id,
                       eos_token_id=job.eos_token_id)
    return {"tokens": res.tokens, "wall_s": res.wall_s, "tokens_per_s": res.tokens_per_s,
            "new_tokens": res.new_tokens, "microbatches": res.microbatches, "stats": res.stats}


def _reference_model(cfg: Config, spec: Any) -> Any:
    """The whole model as a transformers model, with the weights the pipeline used."""
    from experiments.export_hf import hf_model_from_layers

    pretrained = cfg.model.pretrained
    if pretrained:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(pretrained, dtype=weight_dtype(cfg),
                                                    attn_implementation="sdpa").eval()
    from experiments.models import compose

    layers = {i: dict(m.state_dict()) for i, m in enumerate(compose(spec.layers, int(cfg.train.seed)))}
    for a, b in spec.ties:  # tied: the pipeline's second copy holds the first's value
        (la, _, na), (lb, _, nb) = a.partition("."), b.partition(".")
        layers[int(lb)][nb] = layers[int(la)][na]
    from engine.generate import cast_parameters

    return cast_parameters(hf_model_from_layers(cfg.model, layers), weight_dtype(cfg))


def single_process_generate(cfg: Config, spec: Any, prompts: Sequence[Sequence[int]], eos: Any, pad: int) -> dict:
    """transformers' `model.generate` on all prompts in one batch, one process, one thread (on
    `train.device`, like the pipeline)."""
    import torch

    from engine.generate import left_pad, trim_at_eos

    from experiments.wiring import resolve_device

    g = cfg.generate
    device = resolve_device(cfg)
    model = _reference_model(cfg, spec).to(device)
    ids, mask = (t.to(device) for t in left_pad(prompts, pad))
    kwargs: dict[str, Any] = {"do_sample": bool(g.do_sample)}
    if g.do_sample:
        kwargs.update(temperature=float(g.temperature), top_k=int(g.top_k), top_p=float(g.top_p))
        torch.manual_seed(int(g.seed))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0, cpu0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=int(g.max_new_tokens), use_cache=True,
                                 eos_token_id=eos, pad_token_id=pad, **kwargs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        torch.set_num_threads(threads)
    new = out[:, ids.shape[1]:].cpu()
    return {"tokens": [trim_at_eos(t, eos) for t in new.tolist()], "wall_s": wall, "cpu_s": cpu,
            "new_tokens": int(new.numel()), "tokens_per_s": new.numel() / wall}


def _report(run_dir: Path, prompts: list, res: dict, single: dict | None, cfg: Config, ranges: list,
            texts: Sequence[str] | None = None, tok: Any = None) -> dict:
    with open(run_dir / "generations.jsonl", "w") as f:
        for j, (p, t) in enumerate(zip(prompts, res["tokens"])):
            line: dict[str, Any] = {"prompt": p, "tokens": t}
            if texts is not None:
                line.update(prompt_text=texts[j], text=tok.decode(t, skip_special_tokens=True))
            f.write(json.dumps(line) + "\n")
    report: dict[str, Any] = {
        "stages": len(ranges), "stage_ranges": [list(r) for r in ranges], "microbatches": res["microbatches"],
        "prompts": len(prompts), "max_new_tokens": int(cfg.generate.max_new_tokens),
        "do_sample": bool(cfg.generate.do_sample), "dtype": str(cfg.generate.dtype), "threads_per_process": 1,
        "pipelined_tokens_per_s": res["tokens_per_s"], "pipelined_wall_s": res["wall_s"],
        "pipelined_new_tokens": res["new_tokens"], "per_rank": res["per_rank"],
        "layer_decode_ms": res.get("layer_decode_ms")}
    if single is not None:
        report.update(single_tokens_per_s=single["tokens_per_s"], single_wall_s=single["wall_s"],
                      single_cpu_s=single["cpu_s"],
                      single_new_tokens=single["new_tokens"],
                      ratio=res["tokens_per_s"] / single["tokens_per_s"],
                      tokens_match=single["tokens"] == res["tokens"])
    (run_dir / "generation.json").write_text(json.dumps(report, indent=1))
    line = f"pipelined ({len(ranges)} stages, {res['microbatches']} microbatches): {res['tokens_per_s']:,.1f} tokens/s"
    if single is not None:
        line += (f"; transformers model.generate, one process: {single['tokens_per_s']:,.1f} tokens/s; "
                 f"ratio {report['ratio']:.2f}; tokens {'match' if report['tokens_match'] else 'differ'}")
    print(line, flush=True)
    print(f"run directory: {run_dir}  (generations.jsonl, generation.json)", flush=True)
    return report


def run(cfg: Any, run_dir: str | os.PathLike) -> dict | None:
    """Check, launch the pipelined generation, write the outputs and compare (rank 0 only under
    torchrun). Returns the report written to generation.json."""
    import engine
    from engine.generate import check_prompts
    from experiments.config import pretrained_facts
    from experiments.models import build_model

    cfg = as_config(cfg)
    if not isinstance(cfg.model, HFModelConfig):
        raise ConfigError(f"model={cfg.model.name} cannot generate; use model=hf (model.pretrained=DIR)")
    stages = int(cfg.pipeline.stages)
    if int(cfg.pipeline.tensor_parallel) != 1:
        raise ConfigError(f"pipeline.tensor_parallel={cfg.pipeline.tensor_parallel}: generation runs without "
                          "tensor parallelism (a checkpoint of a tensor-parallel run holds whole tensors and "
                          "loads as it is); set pipeline.tensor_parallel=1")
    layers = count_pipeline_layers(cfg.model)  # also checks model.pretrained
    if not 1 <= stages <= layers:
        raise ConfigError(f"pipeline.stages={stages}; generation needs 1 <= stages <= {layers} (the model's "
                          "pipeline layers)")
    prompts, texts, tok = read_prompts(cfg.generate.prompts), None, None
    if prompts and isinstance(prompts[0], str):
        texts = prompts
        prompts, tok = encode_prompts(cfg, texts)
    spec = build_model(cfg.model)
    facts = pretrained_facts(cfg.model)
    if facts and facts.get("generation"):
        raise ConfigError(f"generate: model type {facts['model_type']!r} cannot generate through pipeshard: "
                          f"{facts['generation']}; train it with experiments.train instead")
    learned = facts["learned_positions"] if facts else (int(cfg.model.seq_len)
                                                        if spec.extra.get("arch") == "gpt2" else None)
    try:
        check_prompts(prompts, int(cfg.generate.max_new_tokens), vocab=int(spec.extra["vocab"]),
                      max_positions=learned)
        _sampling(cfg).check()
    except ValueError as exc:
        raise ConfigError(f"generate: {exc}") from None
    costs = None
    if stages > 1 and spec.cached_chunk is not None:
        lanes = max(1, min(int(cfg.generate.microbatches or stages), len(prompts)))
        rows = int(cfg.generate.microbatch_size or -(-len(prompts) // lanes))
        costs = decode_costs(spec, rows, round(sum(map(len, prompts)) / len(prompts)), weight_dtype(cfg))
    ranges = stage_split(spec, stages, costs)
    eos, pad = token_ids(cfg, spec)
    job = GenerateJob(cfg, prompts, [list(r) for r in ranges], eos, pad)
    results = engine.launch(generate_worker, len(ranges), job)
    mine = [r for r in results if r is not None]
    if "RANK" in os.environ and int(os.environ["RANK"]) != 0:
        return None
    res = dict(mine[-1], per_rank=[r["stats"] for r in results if r is not None])
    single = single_process_generate(cfg, spec, prompts, eos, pad) if cfg.generate.compare else None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    res["layer_decode_ms"] = [round(c * 1e3, 3) for c in costs] if costs else None
    return _report(run_dir, prompts, res, single, cfg, ranges, texts, tok)


def main() -> None:
    """The Hydra entry point (`python -m experiments.generate [overrides]`)."""
    from experiments.app import hydra_entry

    hydra_entry(run)


if __name__ == "__main__":
    main()
