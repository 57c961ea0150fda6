"""`build_hf(cfg)`: a Hugging Face causal LM as a `ModelSpec` (`model=hf`, `hf_gpt2`, `hf_llama`).

The top of the Hugging Face adapter: the layers and layout (`experiments.models.hf`), the
per-layer loading from a `save_pretrained` directory (`hf_load`) and the cached chunk for
generation (`hf_cache`) below it, so that none of them imports another in a circle.

Example:
    >>> from experiments.config import HFModelConfig
    >>> spec = build_hf(HFModelConfig(arch="llama", layers=2, dim=32, heads=4, vocab=300,
    ...                               seq_len=16))                    # doctest: +SKIP
    >>> len(spec.layers)                                              # doctest: +SKIP
    4
"""

from __future__ import annotations

from functools import partial
from typing import Any

from experiments.fields import sequence_parallel_mode
from experiments.models.gpt import lm_spec
from experiments.models.loss import loss_settings
from experiments.models.hf import (build_hf_layer, config_from_json, hf_config, meta_reference,
                                   with_sequence_parallel)
from experiments.models.hf_cache import HFCachedChunk
from experiments.models.hf_moe import RouterLoss, RouterSpec, moe_summary, router_spec
from experiments.models.spec import ModelSpec

__all__ = ["build_hf"]


def _tie_pair(num_layers: int) -> tuple[str, str]:
    return ("0.wte.weight", f"{num_layers + 1}.lm_head.weight")


def build_hf(cfg: Any, head_dim: int | None = None) -> ModelSpec:
    """Layer factories for a Hugging Face causal LM: from `cfg.pretrained` (a save_pretrained
    directory; each factory loads only its own tensors) or random weights of family `cfg.arch`.

    Fields: pretrained, arch, layers, dim, heads, vocab, seq_len, dropout, tie_embeddings,
    kv_heads, intermediate, sequence_parallel (the size fields are ignored with `pretrained`, which brings its own).
    ``head_dim``: the attention head size of a random model (default dim / heads; a tensor-parallel
    rank's shapes keep the whole model's, `experiments.wiring.tp_model_spec`).
    """
    pretrained = cfg.pretrained
    seq_len = int(cfg.seq_len)
    if pretrained:
        from experiments.models.hf_load import load_hf_layer, pretrained_config_json

        config_json = pretrained_config_json(str(pretrained))
        config = config_from_json(config_json)
        _, lay = meta_reference(config_json)
        factories = [partial(load_hf_layer, str(pretrained), i) for i in range(lay.num_layers + 2)]
        name = f"hf-{lay.model_type}-{str(pretrained).rstrip('/').split('/')[-1]}"
    else:
        config = hf_config(cfg)
        if head_dim is not None:
            if not hasattr(config, "head_dim"):
                raise ValueError(f"model.arch={cfg.arch}: its config has no head_dim; a tensor-parallel rank's "
                                 "shapes need one (use a Llama-style family)")
            config.head_dim = int(head_dim)
        config_json = config.to_json_string(use_diff=False)
        _, lay = meta_reference(config_json)
        factories = [partial(build_hf_layer, lay.model_type, config_json, i) for i in range(lay.num_layers + 2)]
        name = f"hf-{lay.model_type}-L{lay.num_layers}-d{cfg.dim}"
    if sequence_parallel_mode(getattr(cfg, "sequence_parallel", False)) is True:   # auto: resolved by the planner first
        factories = [partial(with_sequence_parallel, f) for f in factories]
    n = lay.num_layers
    ties = [_tie_pair(n)] if getattr(config, "tie_word_embeddings", False) else []
    loss, chunk = loss_settings(cfg)
    spec = lm_spec(factories, ties, seq_len=seq_len, vocab=config.vocab_size, name=name, loss=loss, loss_chunk=chunk,
                   arch=lay.model_type, hf_config_json=config_json,
                   pretrained=str(pretrained) if pretrained else None)
    spec.cached_chunk = HFCachedChunk
    _add_router_loss(spec, router_spec(meta_reference(config_json)[0]))
    return spec


def _add_router_loss(spec: ModelSpec, router: RouterSpec | None) -> None:
    """An MoE model's losses (the chosen one and the other head's) add the router auxiliary
    loss from the stats the layers carry (`experiments.models.hf_moe`)."""
    if router is None:
        return
    wrap = partial(RouterLoss, num_experts=router.num_experts, coef=router.coef)
    spec.loss_fn = wrap(spec.loss_fn)
    spec.extra["loss_heads"] = {k: (head, wrap(fn)) for k, (head, fn) in spec.extra["loss_heads"].items()}
    spec.extra.update(moe_summary(router))
