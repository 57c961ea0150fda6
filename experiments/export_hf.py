"""`python -m experiments.export_hf checkpoint=<dir> out=<dir>`: a pipeshard checkpoint of a
Hugging Face model (written with any split) becomes a directory that
`AutoModelForCausalLM.from_pretrained(out)` loads.

The checkpoint's manifest carries the run's model config (`model=hf` with `pretrained`, or a
random `hf` / `hf_gpt2` / `hf_llama` model); its layers (keyed by global layer index) are renamed
to the model's own parameter names with the same rule that loads them
(`experiments.models.hf.layer_prefixes`), assigned into the model built on the meta device, and
written by transformers' `save_pretrained` (config.json, safetensors, sharded above
`max_shard_size`, tied weights stored once). Tokenizer and generation files of the pretrained
directory are copied along, so the result replaces it.

Checkpoints are read only through `read_checkpoint`, from this one process: the checkpoint's
DCP files are read directly, whatever split and replica count wrote them.

Example:
    python -m experiments.export_hf checkpoint=outputs/ft/2026-01-01_00-00-00 out=/models/ft
    >>> export("outputs/ft/run/checkpoints", "/models/ft")    # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

from experiments.config import HF_MODELS, ConfigError, HFModelConfig, model_config

__all__ = ["resolve_checkpoint", "read_checkpoint", "hf_model_from_layers", "export", "main"]

_NOT_COPIED = ("config.json", "model.safetensors.index.json")


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint, a checkpoint root or a run directory (newest)."""
    from engine.checkpoint import MANIFEST, latest_checkpoint

    p = Path(path).expanduser()
    if (p / MANIFEST).is_file():
        return p
    for root in (p, p / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise ConfigError(f"checkpoint={str(path)!r} holds no complete pipeshard checkpoint; give a step_N "
                      "directory, a checkpoint root or a run directory with checkpoint.every_steps > 0")


def read_checkpoint(path: str | Path) -> tuple[dict, dict[int, dict[str, Any]]]:
    """(run meta, every layer's tensors by global index) of a checkpoint, through
    `engine.checkpoint.load_checkpoint`."""
    from engine.checkpoint import load_checkpoint

    head = load_checkpoint(path, [])
    n = int(head.manifest["num_layers"])
    ckpt = load_checkpoint(path, range(n), num_layers=n)
    return ckpt.meta, ckpt.layers


def _hf_model(model_cfg: Any) -> HFModelConfig:
    """The typed model group of a checkpoint's manifest (or a run's config); Hugging Face models only."""
    model = model_config(model_cfg)
    if not isinstance(model, HFModelConfig):
        raise ConfigError(f"the checkpoint is of model={model.name}; only Hugging Face models "
                          f"({', '.join(HF_MODELS)}) export to a Hugging Face directory")
    return model


def _config_json(model_cfg: Any) -> str:
    from experiments.models.hf import hf_config

    model = _hf_model(model_cfg)
    if model.pretrained:
        from experiments.models.hf_load import pretrained_config_json

        try:
            return pretrained_config_json(str(model.pretrained))
        except OSError as exc:
            raise ConfigError(f"the checkpoint's model.pretrained directory is needed for its config: {exc}") from None
    return hf_config(model).to_json_string(use_diff=False)


def hf_model_from_layers(model_cfg: Any, layers: Mapping[int, Mapping[str, Any]]) -> Any:
    """The transformers model (on the CPU) holding these pipeline layers' tensors."""
    import torch

    from experiments.models.hf import config_from_json, layer_prefixes, meta_reference, model_class
    from partitioner.meta import meta_device

    config_json = _config_json(model_cfg)
    config = config_from_json(config_json)
    _, lay = meta_reference(config_json)
    if sorted(layers) != list(range(lay.num_layers + 2)):
        raise ConfigError(f"the checkpoint has layers {sorted(layers)[:3]}..{max(layers)} but the model has "
                          f"{lay.num_layers + 2}; it was written for another model")
    state = {f"{layer_prefixes(lay, i)[k.partition('.')[0]]}.{k.partition('.')[2]}": t
             for i, params in layers.items() for k, t in params.items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head_key = f"{lay.head}.weight"
    if tied:
        head = state.pop(head_key)
        if not torch.equal(head, state[f"{lay.embed}.weight"]):
            raise ConfigError("the checkpoint's LM head and embedding differ although the model ties them")
    with meta_device():
        model = model_class(config)(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or [k for k in missing if not (tied and k == head_key)]:
        raise ConfigError(f"the checkpoint does not fit {type(model).__name__}: missing {missing}, "
                          f"unexpected {unexpected}")
    if lay.rotary:  # parameter-free: its buffers are computed, not stored
        parent, _, leaf = lay.rotary.rpartition(".")
        with torch.device("cpu"):
            setattr(model.get_submodule(parent), leaf, type(model.get_submodule(lay.rotary))(config=config))
    if tied:
        model.tie_weights()
    from experiments.models.hf_load import rebuild_buffers

    left = rebuild_buffers(model, model)   # computed at construction (gemma's embed_scale, GPT-Neo's mask)
    left += [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ConfigError(f"{type(model).__name__}: {left} are neither stored nor computable; cannot export")
    return model.eval()


_EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export(checkpoint: str | Path, out: str | Path, *, max_shard_size: str | int = "5GB",
           dtype: str | None = None) -> Path:
    """Write the Hugging Face directory `out` from a pipeshard checkpoint; returns `out`.

    `dtype`: fp32 | bf16 | fp16 for the written weights; None keeps the checkpoint's (fp32: a
    16-bit run's checkpoint holds its fp32 master weights)."""
    if dtype is not None and dtype not in _EXPORT_DTYPES:
        raise ConfigError(f"dtype={dtype!r}; choose one of {sorted(_EXPORT_DTYPES)} or null (the checkpoint's fp32)")
    path = resolve_checkpoint(checkpoint)
    meta, layers = read_checkpoint(path)
    model_cfg = meta.get("model")
    if not isinstance(model_cfg, Mapping):
        raise ConfigError(f"{path} records no model config (written by an older pipeshard?); cannot export")
    model = hf_model_from_layers(model_cfg, layers)
    if dtype is not None:
        import torch

        model = model.to(getattr(torch, _EXPORT_DTYPES[dtype]))
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    source = _hf_model(model_cfg).pretrained
    if source:
        for f in Path(source).iterdir():  # tokenizer, generation config, ...
            if f.is_file() and f.name not in _NOT_COPIED and f.suffix not in (".safetensors", ".bin"):
                shutil.copy2(f, out / f.name)
    (out / "pipeshard_export.json").write_text(json.dumps(
        {"checkpoint": str(path.resolve()), "step": meta.get("step"), "model": model_cfg}, indent=1))
    return out


def main() -> None:
    """The Hydra entry point (`conf/export_hf.yaml`)."""
    import hydra

    from omegaconf import MissingMandatoryValue, OmegaConf

    from experiments.app import refuse_bad_input
    from experiments.config import CONF_DIR, ExportConfig, register_configs

    register_configs()

    @hydra.main(config_path=str(CONF_DIR), config_name="export_hf", version_base="1.3")
    def _task(composed: Any) -> None:
        with refuse_bad_input():
            try:
                cfg: ExportConfig = OmegaConf.to_object(composed)  # type: ignore[assignment]
            except MissingMandatoryValue as err:
                raise ConfigError(f"{err.full_key} is required: python -m experiments.export_hf "
                                  "checkpoint=<checkpoint, checkpoint root or run dir> out=<dir>") from None
            out = export(cfg.checkpoint, cfg.out, max_shard_size=cfg.max_shard_size, dtype=cfg.dtype)
            print(f"exported {resolve_checkpoint(cfg.checkpoint)} -> {out} "
                  "(load it with AutoModelForCausalLM.from_pretrained)", flush=True)

    _task()


if __name__ == "__main__":
    main()
