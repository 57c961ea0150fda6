"""Load one pipeline layer of a Hugging Face `save_pretrained` directory, and nothing else.

A directory holds `config.json` and the weights as `model.safetensors`, or as shards listed in
`model.safetensors.index.json`. `load_hf_layer(dir, i)` builds pipeline layer `i` on the meta
device (no memory), reads only that layer's tensors (`safetensors.safe_open`, opening only the
shards that hold them) and assigns them in place, so a rank holds its own layers and never the
whole model. Under an ambient meta device (`with torch.device("meta")`: parameter counting,
analytic profiling) nothing is read.

With tied input/output embeddings the file usually has no LM-head tensor: the head loads the
embedding's. Tensors are cast to the layer's dtype (fp32: the pipeline keeps fp32 parameters and
runs lower precisions under autocast).

Example:
    >>> layer = load_hf_layer("/path/to/llama_dir", 3)      # doctest: +SKIP
    >>> facts = pretrained_facts("/path/to/llama_dir")       # doctest: +SKIP
    >>> facts["num_layers"], facts["vocab"], facts["tie"]    # doctest: +SKIP
    (4, 256, False)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.models.hf import (_ambient_meta, config_from_json, layer_prefixes, meta_layer,
                                   meta_reference)

__all__ = ["resolve_pretrained", "pretrained_config_json", "pretrained_facts", "weight_map",
           "checkpoint_names", "load_hf_layer", "read_tensors", "INDEX", "SINGLE"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def resolve_pretrained(path: str | Path) -> Path:
    """The directory, checked: it must hold config.json and safetensors weights."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"model.pretrained={str(path)!r} is not a directory; give the folder "
                                "that model.save_pretrained(...) wrote (config.json + *.safetensors)")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json; give a directory written by "
                                "model.save_pretrained(...)")
    if not ((root / INDEX).is_file() or (root / SINGLE).is_file()):
        bins = sorted(p.name for p in root.glob("*.bin"))
        hint = (f" (it has {bins}: convert with AutoModelForCausalLM.from_pretrained(dir)"
                ".save_pretrained(new_dir), which writes safetensors)") if bins else ""
        raise FileNotFoundError(f"{root} has neither {SINGLE} nor {INDEX}{hint}")
    return root.resolve()


@functools.lru_cache(maxsize=8)
def pretrained_config_json(path: str) -> str:
    """The directory's full config as JSON (class defaults filled in by transformers)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(resolve_pretrained(path)))
    return config.to_json_string(use_diff=False)


def pretrained_facts(path: str | Path) -> dict[str, Any]:
    """What the configuration checks need from a directory, without loading weights:
    `num_layers` (decoder layers), `vocab`, `tie`, `model_type`, `learned_positions` (max
    positions for models with a learned position table, else None)."""
    config_json = pretrained_config_json(str(path))
    _, lay = meta_reference(config_json)
    config = config_from_json(config_json)
    learned = None
    if lay.positions:
        model, _ = meta_reference(config_json)
        learned = model.get_submodule(lay.positions).num_embeddings
    return {"num_layers": lay.num_layers, "vocab": int(config.vocab_size), "model_type": lay.model_type,
            "tie": bool(getattr(config, "tie_word_embeddings", False)), "learned_positions": learned}


@functools.lru_cache(maxsize=8)
def weight_map(path: str) -> dict[str, str]:
    """Tensor name -> the file holding it (from the shard index, or the single file's header)."""
    root = resolve_pretrained(path)
    if (root / INDEX).is_file():
        return dict(json.loads((root / INDEX).read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(root / SINGLE), framework="pt") as f:
        return {k: SINGLE for k in f.keys()}


@functools.lru_cache(maxsize=8)
def checkpoint_names(path: str) -> dict[str, str]:
    """Model parameter name -> the name it has in the directory's files.

    Files may name tensors differently from the modules (older layouts, e.g. GPT-NeoX's
    `embed_out`, or a checkpoint saved from the base model without its prefix); transformers'
    own renaming rules for the model type translate them, as `from_pretrained` does. Weights
    that need a tensor conversion (fused or split on load) are refused.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    model, _ = meta_reference(pretrained_config_json(path))
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta_sd = model.state_dict()
    out: dict[str, str] = {}
    for key in weight_map(path):
        name, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_sd)
        if converter is not None:
            raise ValueError(f"{path}: tensor {key!r} needs a weight conversion ({converter!r}) on load; "
                             "pipeshard loads tensors as stored, so this checkpoint layout is not supported")
        out.setdefault(name, key)
    return out


def read_tensors(path: str | Path, names: dict[str, str], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Read `{local: hf_name}` from the directory's safetensors files, each file opened once,
    cast to `dtypes[local]`."""
    from safetensors import safe_open

    root = resolve_pretrained(path)
    wmap = weight_map(str(path))
    by_file: dict[str, list[str]] = {}
    for local, hf in names.items():
        by_file.setdefault(wmap[hf], []).append(local)
    out: dict[str, torch.Tensor] = {}
    for fname, locals_ in sorted(by_file.items()):
        with safe_open(str(root / fname), framework="pt") as f:
            for local in locals_:
                out[local] = f.get_tensor(names[local]).to(dtypes[local])
    return out


def load_hf_layer(path: str, index: int) -> nn.Module:
    """Pipeline layer `index` of the directory's model, holding only its own tensors."""
    config_json = pretrained_config_json(path)
    layer = meta_layer(config_json, index)
    if _ambient_meta():
        return layer
    model, lay = meta_reference(config_json)
    prefixes = layer_prefixes(lay, index)
    stored = checkpoint_names(path)
    wanted = layer.state_dict(keep_vars=True)
    names: dict[str, str] = {}
    missing: list[str] = []
    for local in wanted:
        head, _, rest = local.partition(".")
        full = f"{prefixes[head]}.{rest}"
        if full not in stored and local == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
            full = f"{lay.embed}.weight"  # tied head: the file stores the embedding only
        if full in stored:
            names[local] = stored[full]
        else:
            missing.append(full)
    if missing:
        raise KeyError(f"{path} has no tensors {missing} for pipeline layer {index}; the weights do not "
                       "match config.json (re-save the model with save_pretrained)")
    tensors = read_tensors(path, names, {k: v.dtype for k, v in wanted.items()})
    layer.load_state_dict(tensors, strict=True, assign=True)
    left = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"pipeline layer {index} of {path}: {left} were not loaded (buffers that "
                           "are not saved and not computed by the layer); this model type is not supported")
    return layer
