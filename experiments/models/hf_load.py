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

import copy
import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.models.hf import (_ambient_meta, config_from_json, layer_prefixes, logit_softcap, meta_layer,
                                   meta_reference, position_offset)
from experiments.models.hf_cache import generation_refusal
from experiments.models.hf_moe import router_spec

__all__ = ["resolve_pretrained", "pretrained_config_json", "pretrained_facts", "weight_map",
           "checkpoint_names", "check_loadable", "rebuild_buffers", "layer_tensors", "load_hf_layer", "read_tensors", "INDEX", "SINGLE"]

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
    positions for models with a learned position table, else None), `logit_softcap` (the final
    logit soft-capping, or None), `generation` (why `experiments.generate` cannot run it, or None). A directory a worker could
    not load is refused here (:func:`check_loadable`)."""
    config_json = pretrained_config_json(str(path))
    _, lay = meta_reference(config_json)
    check_loadable(str(path))
    config = config_from_json(config_json)
    learned = None
    if lay.positions:
        model, _ = meta_reference(config_json)
        wpe = model.get_submodule(lay.positions)
        learned = wpe.num_embeddings - position_offset(wpe)
    return {"num_layers": lay.num_layers, "vocab": int(config.vocab_size), "model_type": lay.model_type,
            "tie": bool(getattr(config, "tie_word_embeddings", False)), "learned_positions": learned,
            "logit_softcap": logit_softcap(config),
            "generation": generation_refusal(meta_reference(config_json)[0], lay.layers)}


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
def checkpoint_names(path: str) -> dict[str, tuple[str, str | None]]:
    """Stored tensor name -> (the model parameter it loads into, the matched source pattern of
    the weight converter that builds it, or None for a plain rename).

    Files may name tensors differently from the modules (older layouts, e.g. GPT-NeoX's
    `embed_out`, a checkpoint saved from the base model without its prefix) or store weights
    that transformers converts on load (Mixtral's and Qwen-MoE's per-expert matrices, stacked
    into one `[experts, ...]` parameter). transformers' own conversion mapping for the model
    type (`get_model_conversion_mapping`) and its `rename_source_key` translate every name, as
    `from_pretrained` does; for a converted weight the name is the converter's first target.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    model, _ = meta_reference(pretrained_config_json(path))
    renamings, converters = _transforms(get_model_conversion_mapping(model), WeightRenaming, WeightConverter)
    meta_sd = model.state_dict()
    out: dict[str, tuple[str, str | None]] = {}
    for key in weight_map(path):
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_sd)
        if name not in meta_sd and key in meta_sd:  # as from_pretrained: a name already right stays
            name, pattern = rename_source_key(key, [], [], model.base_model_prefix, meta_sd)
        out[key] = (name, pattern)
    return out


def _transforms(conversions: list, renaming: type, converter: type) -> tuple[list, list]:
    return ([c for c in conversions if isinstance(c, renaming)],
            [c for c in conversions if isinstance(c, converter)])


def read_tensors(path: str | Path, names: dict[str, str], dtypes: dict[str, torch.dtype] | None = None,
                 meta: bool = False) -> dict[str, torch.Tensor]:
    """Read `{local: hf_name}` from the directory's safetensors files, each file opened once,
    cast to `dtypes[local]` when given; `meta`: tensors on the meta device with the stored
    shapes and dtypes (from the files' headers, no data read)."""
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
                t = _header_tensor(f, names[local]) if meta else f.get_tensor(names[local])
                out[local] = t if dtypes is None else t.to(dtypes[local])
    return out


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _header_tensor(f: Any, name: str) -> torch.Tensor:
    """A meta tensor of the stored tensor's shape and dtype (its header; no data read)."""
    part = f.get_slice(name)
    return torch.empty(part.get_shape(), dtype=_ST_DTYPES[part.get_dtype()], device="meta")


def _owner(name: str, prefixes: dict[str, str]) -> str | None:
    """The layer-local name of model parameter `name`, or None when the layer does not hold it."""
    for local, full in prefixes.items():
        if name.startswith(full + "."):
            return f"{local}.{name[len(full) + 1:]}"
    return None


def layer_tensors(path: str, index: int, meta: bool = False) -> dict[str, torch.Tensor]:
    """Pipeline layer `index`'s tensors (layer-local names), read and converted exactly as
    `from_pretrained` converts them (transformers' `WeightConverter.convert` on this layer's
    stored tensors only): no other layer's tensor is read. `meta`: the same conversions on
    meta tensors of the stored shapes (a dry run: what the layer would get, no data read)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key

    config_json = pretrained_config_json(path)
    model, lay = meta_reference(config_json)
    prefixes = layer_prefixes(lay, index)
    plan = checkpoint_names(path)
    mine = sorted((k for k, (name, _) in plan.items() if _owner(name, prefixes)), key=dot_natural_key)
    stored = read_tensors(path, {k: k for k in mine}, meta=meta)
    if (index == lay.num_layers + 1 and getattr(model.config, "tie_word_embeddings", False)
            and not any(_owner(plan[k][0], {"lm_head": lay.head}) for k in mine)):
        embed = [k for k, (name, _) in plan.items() if name == f"{lay.embed}.weight"]
        stored.update(read_tensors(path, {k: k for k in embed}, meta=meta))  # tied head: the file has the embedding only
        mine += embed
        plan = {**plan, **{k: (f"{lay.head}.weight", None) for k in embed}}
    from transformers.conversion_mapping import get_model_conversion_mapping

    _, converters = _transforms(get_model_conversion_mapping(model), WeightRenaming, WeightConverter)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    mappings: dict[str, Any] = {}
    for key in mine:
        name, pattern = plan[key]
        if pattern is None:
            mapping = mappings.setdefault(name, WeightRenaming(key, name))
            pattern = key
        else:
            mapping = mappings.setdefault(name, copy.deepcopy(by_pattern[pattern]))
        mapping.add_tensor(name, key, pattern, stored.pop(key))
    out: dict[str, torch.Tensor] = {}
    for first, mapping in mappings.items():
        for target, value in mapping.convert(first, model=model, config=model.config).items():
            local = _owner(target, prefixes)
            if local is None:
                raise KeyError(f"{path}: converting {first!r} gave {target!r}, outside pipeline layer {index}")
            out[local] = value[0] if isinstance(value, list) else value
    return out


def _placeholder(buf: torch.Tensor) -> tuple[torch.Tensor, float | int]:
    """A real copy of a meta buffer filled with a value no computation leaves (NaN, or the
    integer minimum; a boolean buffer, e.g. GPT-Neo's causal mask, is held as uint8 2 until
    filled), and that value."""
    if buf.dtype == torch.bool:
        return torch.full(buf.shape, 2, dtype=torch.uint8, device="cpu"), 2
    mark = float("nan") if buf.is_floating_point() else torch.iinfo(buf.dtype).min
    return torch.full(buf.shape, mark, dtype=buf.dtype, device="cpu"), mark


def _unset(t: torch.Tensor, mark: float | int) -> bool:
    return bool(t.isnan().any()) if t.is_floating_point() else bool((t == mark).any())


def _restore_bools(layer: nn.Module, bools: list[str]) -> None:
    """Boolean buffers held as uint8 while filled (:func:`_placeholder`) back to bool."""
    for name in bools:
        owner, _, attr = name.rpartition(".")
        module = layer.get_submodule(owner) if owner else layer
        buf = module.get_buffer(attr)
        if buf.dtype != torch.bool and not _unset(buf, 2):
            module.register_buffer(attr, buf.bool(), persistent=False)


def rebuild_buffers(layer: nn.Module, reference: nn.Module) -> list[str]:
    """Buffers a module computes at construction (not stored: gemma's `embed_scale`, rotary
    `inv_freq`), made real and filled by the model class's own `_init_weights`, which leaves
    every other tensor alone (transformers' `_is_hf_initialized` flag, as in from_pretrained);
    returns the names of those it left unset. Works on a layer whose parameters are still on
    the meta device too (the launcher's check, :func:`check_loadable`)."""
    placed: dict[str, tuple[torch.Tensor, float | int]] = {}
    bools: list[str] = []
    for mname, module in layer.named_modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_meta and name in module._non_persistent_buffers_set:
                if buf.dtype == torch.bool:
                    bools.append(f"{mname}.{name}" if mname else name)
                real, mark = _placeholder(buf)
                module.register_buffer(name, real, persistent=False)
                placed[f"{mname}.{name}" if mname else name] = (real, mark)
    kept = [t for t in [*layer.parameters(), *layer.buffers()] if all(t is not r for r, _ in placed.values())]
    for t in kept:
        t._is_hf_initialized = True
    try:
        with torch.no_grad():
            layer.apply(reference._init_weights)
    finally:
        for t in kept:
            del t._is_hf_initialized
    left = [n for n, (_, mark) in placed.items() if _unset(layer.get_buffer(n), mark)]
    _restore_bools(layer, bools)
    return left


@functools.lru_cache(maxsize=8)
def check_loadable(path: str) -> None:
    """Refuse, in the launching process, a directory a worker could not load: for every
    pipeline layer, transformers' conversions run on meta tensors of the stored shapes
    (:func:`layer_tensors` with `meta`) must give exactly the layer's tensors with their
    shapes, every buffer not stored must be computed by the model class, and an MoE model's
    routers must be found. A ValueError names what is wrong."""
    config_json = pretrained_config_json(path)
    model, lay = meta_reference(config_json)
    router_spec(model)
    for index in range(lay.num_layers + 2):
        layer = meta_layer(config_json, index)
        try:
            got = layer_tensors(path, index, meta=True)
        except Exception as exc:  # a converter failing on these shapes: the worker would fail alike
            raise ValueError(f"{path}: converting the stored tensors of pipeline layer {index} fails "
                             f"({type(exc).__name__}: {exc})") from None
        _compare(path, index, lay, layer.state_dict(keep_vars=True), got)
        left = rebuild_buffers(layer, model)
        if left:
            raise ValueError(f"{path}: pipeline layer {index} has buffers {left} that are neither stored nor "
                             f"computed by {type(model).__name__}._init_weights; model type "
                             f"{lay.model_type!r} is not supported")


def _compare(path: str, index: int, lay: Any, wanted: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Raise naming the tensors (model names) a layer lacks, has too many of, or has in another shape."""
    prefixes = layer_prefixes(lay, index)

    def full(local: str) -> str:
        head, _, rest = local.partition(".")
        return f"{prefixes[head]}.{rest}"

    missing = [full(k) for k in wanted if k not in got]
    extra = [full(k) for k in got if k not in wanted]
    shapes = [f"{full(k)} {tuple(got[k].shape)} (model: {tuple(v.shape)})" for k, v in wanted.items()
              if k in got and tuple(got[k].shape) != tuple(v.shape)]
    if missing or extra or shapes:
        what = "; ".join(f"{name} {items}" for name, items in
                         (("missing", missing), ("unexpected", extra), ("wrong shape", shapes)) if items)
        raise ValueError(f"{path}: pipeline layer {index} would not load ({what}); the weights do not match "
                         "config.json (re-save the model with save_pretrained)")


def load_hf_layer(path: str, index: int) -> nn.Module:
    """Pipeline layer `index` of the directory's model, holding only its own tensors."""
    config_json = pretrained_config_json(path)
    layer = meta_layer(config_json, index)
    if _ambient_meta():
        return layer
    model, lay = meta_reference(config_json)
    tensors = layer_tensors(path, index)
    wanted = layer.state_dict(keep_vars=True)
    try:
        _compare(path, index, lay, wanted, tensors)
    except ValueError as exc:
        raise KeyError(str(exc)) from None
    layer.load_state_dict({k: v.to(wanted[k].dtype) for k, v in tensors.items()}, strict=False, assign=True)
    left = rebuild_buffers(layer, model)
    left += [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"pipeline layer {index} of {path}: {left} were not loaded (buffers that "
                           "are not saved and not computed by the layer); this model type is not supported")
    return layer

