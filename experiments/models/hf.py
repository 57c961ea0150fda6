"""Hugging Face transformers decoder-only causal LMs as pipeshard layers.

Any causal LM with the usual layout works: a token embedding (plus, optionally, learned
positions and an embedding dropout), a list of decoder layers, a final norm and an LM head; the
pieces are found on the model itself (`HFLayout`), so Llama, Mistral, Qwen2/3, Phi-3, GPT-2,
GPT-NeoX and their many look-alikes share one adapter. The pipeline layers are:

    0        HFTokenEmbedding  token ids [b, t] -> hidden [b, t, d]
    1..n     HFBlock           one decoder layer, hidden -> hidden (causal; rotary models carry
                               their own, parameter-free rotary module)
    n + 1    HFHead            final norm + LM head -> logits [b, t, vocab]

Ways in:
    * `experiments.models.hf_build.build_hf(cfg)`: layer factories. With `cfg.pretrained` (a `save_pretrained` directory)
      each factory builds its layer on the meta device and loads only that layer's tensors from
      the safetensors files (`experiments.models.hf_load`); otherwise it builds a random layer of
      the family `cfg.arch`, initialised by the model class's own `_init_weights`.
    * `layers_from_hf(model)`: wrap an existing model's own submodules (weights shared).

Example:
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=16))
    >>> layers = layers_from_hf(model)          # embedding, 2 blocks, head
    >>> len(layers)
    4
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partitioner.meta import meta_device

from experiments.models.hf_moe import RouterSpec, layer_stats, meta_experts, router_spec, routers_in


__all__ = [
    "ARCHS",
    "TESTED",
    "HFLayout",
    "HFTokenEmbedding",
    "HFBlock",
    "HFHead",
    "hf_config",
    "config_from_json",
    "discover_layout",
    "layer_prefixes",
    "layers_from_hf",
    "build_hf_layer",
    "SP_FAMILIES",
    "sequence_parallel_problem",
    "with_sequence_parallel",
    "meta_reference",
    "meta_layer",
    "model_class",
    "attention_mask",
    "attention_implementation",
    "family_scales",
    "logit_softcap",
    "position_offset",
    "SCALED",
    "additive_mask",
]

ARCHS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox")
"""Families `model.arch` builds with random weights; each is tested against its HF forward."""

TESTED = (*ARCHS, "gemma", "gemma2", "gemma3_text", "opt", "falcon", "granite", "cohere", "mixtral", "qwen2_moe",
          "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3")
"""Families whose pretrained checkpoints the tests compare with transformers (tests/experiments/
test_hf_models.py, test_hf_families.py, test_hf_moe.py); docs/hf_families.md lists the others."""

# Model types whose forward does work outside the modules this adapter runs (it would silently
# compute something else): refused with the reason.
INCOMPATIBLE = {
    "bloom": "uses ALiBi position biases computed in its forward",
    "mpt": "uses ALiBi position biases computed in its forward",
    "ctrl": "scales the embeddings and adds sinusoidal positions in its forward",
    "doge": "builds a dynamic attention mask from the values in its forward",
    # Found by the family survey of issue 41 (docs/hf_families.md): the loss through pipeshard's
    # layers differed from transformers' for these, whose forward does work outside the modules.
    "gpt_bigcode": "does work outside its decoder layers (pipeshard's loss differed from transformers')",
    "gpt_neox_japanese": "does work outside its decoder layers (pipeshard's loss differed from transformers')",
    "inkling_text": "does work outside its decoder layers (pipeshard's loss differed from transformers')",
    "nanochat": "does work outside its decoder layers (pipeshard's loss differed from transformers')",
    "seed_oss": "does work outside its decoder layers (pipeshard's loss differed from transformers')",
    "phimoe": "routes differently in training than pipeshard reproduces (its loss differed from transformers' by 1e-5)",
    "biogpt": "computes its positions and scales its embeddings in its forward (pipeshard's layers failed)",
    "rwkv": "has blocks that take no attention arguments (pipeshard's layers failed)",
    "xlstm": "has no input embedding pipeshard can find",
    # Found by scripts/hf_families.py (transformers 5.25).
    "dory": "runs some of its decoder layers several times (recurrent loops) in its forward",
    "gemma4_unified_text": "gives its decoder layers per-layer inputs computed in its forward (pipeshard's layers failed)",
    "deepseek_v32": "runs a sparse-attention indexer (DSA) on the explicit mask its forward builds (pipeshard's layers failed)",
    "glm_moe_dsa": "runs a sparse-attention indexer (DSA) on the explicit mask its forward builds (pipeshard's layers failed)",
    "recurrent_gemma": "scales and soft-caps outside its layers (pipeshard's loss differed from transformers')",
    "axk2": "runs a sparse-attention indexer (DSA) on the explicit mask its forward builds (pipeshard's layers failed)",
    # Found with family-specific sizes in scripts/hf_families.py OVERRIDES (transformers 5.25).
    "zamba": "gives its hybrid layers the embedding output (original_hidden_states) and one attention block "
             "shared by all of them (tied weights) in its forward",
    "zamba2": "gives its hybrid layers the embedding output (original_hidden_states) in its forward "
              "(pipeshard's layers failed)",
    "kolibri1_1": "passes key/value states from one decoder layer to later ones (shared_kv_states) in its forward "
                  "(pipeshard's layers failed)",
    "zaya": "shifts and scales its embeddings and passes router states from layer to layer in its forward "
            "(pipeshard's loss differed from transformers')",
}

# What these families' forward does outside their modules, and the adapter reproduces: a factor
# on the embeddings, and a factor (or divisor) on the logits, read from the config.
SCALED = {
    "granite": ("embedding_multiplier", "logits_scaling", "divide"),
    "granitemoe": ("embedding_multiplier", "logits_scaling", "divide"),
    "cohere": (None, "logit_scale", "multiply"),
    "cohere2": (None, "logit_scale", "multiply"),
    "cohere2_moe": (None, "logit_scale", "multiply"),
    "minicpm3": (None, "logits_scaling", "divide"),   # hidden / c before a bias-free head: logits / c
}

log = logging.getLogger(__name__)


def family_scales(config: Any) -> tuple[float | None, float | None, bool]:
    """(embedding factor, logit factor, whether the logits are divided by it) of a family in
    `SCALED`, as its transformers forward applies them; Nones for the others.

    >>> from transformers import AutoConfig
    >>> family_scales(AutoConfig.for_model("granite", embedding_multiplier=12.0, logits_scaling=8.0))
    (12.0, 8.0, True)
    """
    embed, logit, how = SCALED.get(getattr(config, "model_type", ""), (None, None, "multiply"))
    return (float(getattr(config, embed)) if embed else None,
            float(getattr(config, logit)) if logit else None, how == "divide")


def attention_mask(padding: torch.Tensor | None, q_len: int, window: int | None = None,
                   explicit: bool = False) -> torch.Tensor | None:
    """The boolean attention mask `[b, 1, q, kv]` (True = attend) for the last `q_len` of the
    `kv` positions of `padding` (`[b, kv]`, 1 = token, 0 = left padding), causal, with an
    optional sliding window (key `j` visible from query `i` iff `i - window < j <= i`).

    None when SDPA's own causal flag gives the same result (no padding, no window cut, and
    `q == kv` or `q == 1`), the same rule transformers applies, so both run the same kernel.

    >>> attention_mask(torch.tensor([[0, 1, 1]]), 3)[0, 0].int().tolist()
    [[0, 0, 0], [0, 1, 0], [0, 1, 1]]
    """
    if padding is None:
        return None
    kv = padding.shape[1]
    if not explicit and (window is None or kv < window) and (q_len == 1 or q_len == kv) and bool(padding.all()):
        return None
    q_pos = torch.arange(kv - q_len, kv, device=padding.device)[:, None]
    k_pos = torch.arange(kv, device=padding.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed[None, None] & padding.bool()[:, None, None, :]


# --------------------------------------------------------------------------- the pipeline layers
def position_offset(wpe: nn.Module) -> int:
    """Rows a learned position table keeps before position 0 (OPT's `offset` of 2; else 0)."""
    return int(getattr(wpe, "offset", 0))


def _check_tp(size: int, tp: int, what: str) -> None:
    if size % tp:
        raise ValueError(f"pipeline.tensor_parallel={tp} does not divide {what} ({size}); choose a "
                         "tensor_parallel that divides it")


SP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_SP_COLWISE = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}
_SP_ROWWISE = {"self_attn.o_proj", "mlp.down_proj"}
_SP_CHILDREN = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


def sequence_parallel_problem(config: Any) -> str | None:
    """Why `model.sequence_parallel` cannot run on the model of transformers `config`, or None.

    The one rule (torchtitan's Llama plan, generic over the families whose decoder layer is
    input_layernorm / self_attn / post_attention_layernorm / mlp, listed in `SP_FAMILIES`):
    the layer's `base_model_tp_plan` is colwise q/k/v/gate/up and rowwise o/down (plus
    per-head norms replicated with summed gradients), so that the norms and the residual stream
    can be split on the sequence and all-gathered before the colwise projections.

    >>> from transformers import LlamaConfig, Phi3Config
    >>> sequence_parallel_problem(LlamaConfig()) is None
    True
    >>> "phi3" in sequence_parallel_problem(Phi3Config())
    True
    """
    mtype = getattr(config, "model_type", "?")
    if mtype not in SP_FAMILIES:
        return (f"model type {mtype!r} is not one whose decoder layer is input_layernorm / self_attn / "
                f"post_attention_layernorm / mlp (sequence parallelism runs {', '.join(SP_FAMILIES)})")
    plan = {k[len("layers.*."):]: str(v) for k, v in (getattr(config, "base_model_tp_plan", None) or {}).items()
            if k.startswith("layers.*.")}
    odd = sorted(f"{k}: {v}" for k, v in plan.items()
                 if not ((v == "colwise" and k in _SP_COLWISE) or (v == "rowwise" and k in _SP_ROWWISE)
                         or (v == "replicated_with_grad_allreduce" and k.startswith("self_attn."))))
    if odd or {k for k, v in plan.items() if v == "rowwise"} != _SP_ROWWISE:
        return (f"model type {mtype!r}: its base_model_tp_plan is not colwise q/k/v/gate/up and rowwise "
                f"o/down ({'; '.join(odd) or 'rowwise entries differ'})")
    return None


def with_sequence_parallel(factory: Any) -> nn.Module:
    """The pipeline layer `factory()` marked for sequence parallelism (its `tp_plan` then
    splits the norms and the residual stream on the sequence)."""
    layer = factory()
    layer.sequence_parallel = True
    return layer


def _sp_input_styles() -> dict[str, Any]:
    """The block's sequence-parallel styles around the model's colwise / rowwise ones: the norms
    on `Shard(1)`, the attention's and MLP's inputs all-gathered to `Replicate()`, the rowwise
    outputs reduce-scattered to `Shard(1)` (torchtitan's Llama plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    seq, rep = Shard(1), Replicate()
    return {"block.input_layernorm": SequenceParallel(), "block.post_attention_layernorm": SequenceParallel(),
            "block.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                  desired_input_kwarg_layouts={"hidden_states": rep}),
            "block.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,)),
            "block.self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            "block.mlp.down_proj": RowwiseParallel(output_layouts=seq)}


class HFTokenEmbedding(nn.Module):
    """Token embedding (+ a projection to the hidden size, + learned positions, + dropout):
    `[b, t]` int64 -> `[b, t, d]`. OPT: `proj` is its `project_in`, and its position table
    is read at `position + offset` (the table's own forward takes an attention mask instead)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding | None = None, drop: nn.Module | None = None,
                 scale: float | None = None, proj: nn.Module | None = None) -> None:
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop if drop is not None else nn.Identity()
        self.scale = scale   # granite's embedding_multiplier
        self.proj = proj

    sequence_parallel = False   # `with_sequence_parallel`

    def tp_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism (`engine.tp`): the token table split on the vocabulary (each rank
        looks up its rows, the vectors summed); learned positions replicated. With
        `sequence_parallel` the sum is reduce-scattered on the sequence (each rank its positions)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import RowwiseParallel

        _check_tp(self.wte.num_embeddings, tp, "the vocabulary (model.vocab)")
        if not self.sequence_parallel:
            return {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
        if self.wpe is not None or self.proj is not None:
            raise ValueError("model.sequence_parallel=true needs an embedding without learned positions or a "
                             "projection (a Llama-style family); set model.sequence_parallel=false")
        return {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.wte(input_ids)
        if self.scale is not None:
            h = h * self.scale
        if self.proj is not None:
            h = self.proj(h)
        if self.wpe is not None:
            offset = position_offset(self.wpe)
            if position_ids is None:
                t, rows = input_ids.shape[1], self.wpe.num_embeddings - offset
                if t > rows:
                    raise ValueError(f"sequence length {t} exceeds the model's {rows} "
                                     "learned positions; use shorter sequences (model.seq_len)")
                position_ids = torch.arange(t, device=input_ids.device)
            h = h + nn.Embedding.forward(self.wpe, position_ids + offset)
        return self.drop(h)


def _call_names(block: nn.Module) -> tuple[str | None, frozenset[str]]:
    """(name of the KV-cache argument, explicit argument names) of a decoder layer's forward."""
    params = inspect.signature(type(block).forward).parameters
    cache = next((n for n in ("cache", "layer_past", "past_key_values", "past_key_value") if n in params), None)
    return cache, frozenset(params)


class HFBlock(nn.Module):
    """One HF decoder layer: hidden states `[b, t, d]` in and out, causal.

    Rotary models compute their position embeddings once per model; here each block owns a
    (parameter-free) rotary module and computes them itself, so a block runs on any rank.
    `window`: the layer's sliding attention window (Mistral, Qwen2 sliding layers), or None.
    `layer_type`: the layer's entry of `config.layer_types`, given to a rotary module that keeps
    one table per layer type (gemma3's local and global rotary), else None.
    """

    def __init__(self, block: nn.Module, rotary: nn.Module | None = None, window: int | None = None,
                 router: RouterSpec | None = None, layer_type: str | None = None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.window = window
        self.layer_type = layer_type
        self.router = router
        self._routers = routers_in(block, router) if router is not None else []
        self._cache_arg, self._args = _call_names(block)
        config = getattr(getattr(block, "self_attn", None), "config", None)
        self.eager = getattr(config, "_attn_implementation", "sdpa") == "eager"

    def tp_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism (`engine.tp`): the decoder layer sharded by the model's own
        `base_model_tp_plan` (its `layers.*.` entries), translated by
        `engine.tp.styles_from_hf_plan`; attention then runs on its rank's heads (transformers
        infers the head count from the projections' widths)."""
        from engine.tp import styles_from_hf_plan

        config = next((m.config for m in self.block.modules() if hasattr(m, "config")), None)
        plan = getattr(config, "base_model_tp_plan", None)
        mtype = getattr(config, "model_type", type(self.block).__name__)
        if not plan:
            raise ValueError(f"model type {mtype!r} ships no base_model_tp_plan in transformers, so "
                             "pipeshard has no tensor-parallel plan for it; set pipeline.tensor_parallel=1")
        if self.router is not None:
            raise ValueError(f"tensor parallelism of mixture-of-experts layers ({mtype}) is not supported; "
                             "set pipeline.tensor_parallel=1")
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        for size, what in ((heads, "the attention heads"), (kv, "the key/value heads"),
                           (getattr(config, "hidden_size", None), "the hidden size"),
                           (getattr(config, "intermediate_size", None), "the MLP width")):
            if size is not None:
                _check_tp(int(size), tp, what)
        styles = {f"block.{name}": style for name, style in styles_from_hf_plan(plan, self.block, "layers.*.").items()}
        if not self.sequence_parallel:
            return styles
        problem = sequence_parallel_problem(config)
        children = {n for n, m in self.block.named_children() if any(True for _ in m.parameters())}
        if problem is None and children != _SP_CHILDREN:
            problem = f"its decoder layer holds {sorted(children)}, not {sorted(_SP_CHILDREN)}"
        if problem is not None:
            raise ValueError(f"model.sequence_parallel=true: {problem}; set model.sequence_parallel=false")
        self.seq_shards = int(tp)
        return {**styles, **_sp_input_styles()}

    sequence_parallel = False   # `with_sequence_parallel`
    seq_shards = 1   # the tp ranks the sequence is split over (sequence parallelism, set by tp_plan)

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
        """The layer's rotary (cos, sin) for `position_ids`, or None without rotary."""
        if self.rotary is None:
            return None
        if self.layer_type is not None:
            return self.rotary(hidden, position_ids, self.layer_type)
        return self.rotary(hidden, position_ids)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> Any:
        """Hidden states in and out; in an MoE model `(hidden, router stats)` in (or hidden
        alone into the first layer) and out, this layer's routing sums added
        (`experiments.models.hf_moe`)."""
        hidden, stats = (x if isinstance(x, tuple) else (x, None))
        t = hidden.shape[1] * self.seq_shards   # the whole sequence (the attention's)
        positions = torch.arange(t, device=hidden.device).unsqueeze(0)
        mask = None
        if self.window is not None and t >= self.window:
            mask = attention_mask(torch.ones(1, t, dtype=torch.long, device=hidden.device), t, self.window)
        if self.router is None:
            return self.run(hidden, mask=mask, position_ids=positions)
        logits: list[torch.Tensor] = []
        index = self.router.index
        # as transformers' output recorder: a router returning one tensor returns the logits (dbrx)
        hooks = [m.register_forward_hook(lambda _m, _i, out: logits.append(out[index] if isinstance(out, tuple) else out))
                 for m in self._routers]
        try:
            out = self.run(hidden, mask=mask, position_ids=positions)
        finally:
            for h in hooks:
                h.remove()
        if stats is None:
            stats = torch.zeros(self.router.width, dtype=torch.float32, device=hidden.device)
        for z in logits:
            stats = stats + layer_stats(z, self.router.top_k)
        return out, stats

    def run(self, hidden: torch.Tensor, *, mask: torch.Tensor | None, position_ids: torch.Tensor,
            cache: Any = None, position_embeddings: Any = None) -> torch.Tensor:
        """The layer with an explicit mask (None = causal), positions and optional KV cache."""
        if self.eager and (mask is None or mask.dtype == torch.bool):
            mask = additive_mask(mask, hidden.shape[1] * self.seq_shards, self.window, hidden.dtype, hidden.device)
        kwargs: dict[str, Any] = {"attention_mask": mask}
        if "position_ids" in self._args:
            kwargs["position_ids"] = position_ids
        if self.rotary is not None:
            kwargs["position_embeddings"] = (position_embeddings if position_embeddings is not None
                                             else self.position_embeddings(hidden, position_ids))
        if cache is not None:
            if self._cache_arg is None:
                raise TypeError(f"{type(self.block).__name__}.forward takes no KV cache argument")
            kwargs[self._cache_arg] = cache
            kwargs["use_cache"] = True
        if hidden.is_meta:   # the analytic profile: experts cost as top-k experts per token
            with meta_experts(self.block):
                out = self.block(hidden, **kwargs)
        else:
            out = self.block(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class HFHead(nn.Module):
    """Final norm (+ OPT's `project_out`) + LM head: `[b, t, d]` -> logits `[b, t, vocab]`;
    with `fused` (the chunked loss, `experiments.models.loss`) the forward returns
    `HeadOutput(norm(hidden), weight, bias)` instead, and `logits(hidden)` gives the logits
    either way (generation). `softcap`: gemma2/3's final logit soft-capping,
    `tanh(logits / c) * c` (the chunked loss cannot apply it: refused)."""

    def __init__(self, norm: nn.Module | None, lm_head: nn.Linear, fused: bool = False, scale: float | None = None,
                 divide: bool = False, proj: nn.Module | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.Identity()   # OPT without a final norm (post-LN)
        self.proj = proj
        self.lm_head = lm_head
        self.fused = fused
        self.scale, self.divide = scale, divide   # cohere's logit_scale, granite's logits_scaling (divide)
        self.softcap = softcap

    def tp_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism (`engine.tp`): the LM head split on the vocabulary, its logits left
        sharded for `lm_loss`'s vocabulary-parallel cross-entropy (transformers' own plan gathers
        them: `colwise_gather_output`); the final norm replicated, or with `sequence_parallel`
        split on the sequence and its output all-gathered into the head."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel

        if self.fused:
            raise ValueError("model.loss=chunked is not supported with pipeline.tensor_parallel > 1; "
                             "use model.loss=full (the vocabulary-parallel loss never gathers the logits)")
        _check_tp(self.lm_head.out_features, tp, "the vocabulary (model.vocab)")
        if not self.sequence_parallel:
            return {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        from torch.distributed.tensor.parallel import SequenceParallel

        if self.proj is not None or isinstance(self.norm, nn.Identity):
            raise ValueError("model.sequence_parallel=true needs a final norm and no output projection (a "
                             "Llama-style family); set model.sequence_parallel=false")
        return {"norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}

    sequence_parallel = False   # `with_sequence_parallel`

    def _scaled(self, t: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return t
        return t / self.scale if self.divide else t * self.scale

    def _normed(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.norm(hidden)
        return h if self.proj is None else self.proj(h)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> Any:
        if isinstance(x, tuple):  # an MoE model's (hidden, router stats): the stats go on to the loss
            return self.forward(x[0]), x[1]
        hidden = x
        if self.fused:
            from experiments.models.loss import HeadOutput

            if self.scale is not None and self.lm_head.bias is not None:
                raise ValueError("model.loss=chunked cannot scale the logits of a head with a bias; use model.loss=full")
            if self.softcap is not None:
                raise ValueError("model.loss=chunked cannot soft-cap the logits (final_logit_softcapping); "
                                 "use model.loss=full")
            return HeadOutput(self._scaled(self._normed(hidden)), self.lm_head.weight, self.lm_head.bias)
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of hidden states `[b, t, d]` (norm, head, scale, soft-cap)."""
        out = self._scaled(self.lm_head(self._normed(hidden)))
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


# --------------------------------------------------------------------------- where the pieces are
@dataclass(frozen=True)
class HFLayout:
    """Module paths of the pipeline pieces inside a transformers causal LM (`norm` None: a
    post-norm OPT without a final norm; `project_in` / `project_out`: OPT's projections between
    its embedding width and its hidden size).

    >>> HFLayout("llama", "model.embed_tokens", None, None, "model.layers", "model.norm",
    ...          "model.rotary_emb", "lm_head", 2).layers
    'model.layers'
    """

    model_type: str
    embed: str
    positions: str | None
    dropout: str | None
    layers: str
    norm: str | None
    rotary: str | None
    head: str
    num_layers: int
    project_in: str | None = None
    project_out: str | None = None


PROJECTIONS = ("project_in", "project_out")
"""Linear children of a decoder found by name (OPT's embedding-width projections)."""


def _kind(child: nn.Module, name: str = "") -> str:
    cls = type(child).__name__
    if isinstance(child, nn.ModuleList):
        return "layers"
    if isinstance(child, nn.Embedding):
        return "positions"
    if isinstance(child, nn.Dropout):
        return "dropout"
    if "Rotary" in cls:
        return "rotary"
    if "norm" in cls.lower():
        return "norm"
    if isinstance(child, nn.Linear) and name in PROJECTIONS:
        return name
    return "other"


def _check_rotary(model: nn.Module, mtype: str) -> None:
    """Refuse a rotary module that needs more than (hidden, positions), unless the only extra
    argument is the layer type and `config.rope_parameters` has a table for every entry of
    `config.layer_types` (gemma3's local and global tables: each block passes its own)."""
    types = getattr(model.config, "layer_types", None)
    tables = getattr(model.config, "rope_parameters", None)
    per_type = bool(types) and isinstance(tables, dict) and all(tables.get(t) is not None for t in types)
    for name, module in model.named_modules():
        if "Rotary" not in type(module).__name__:
            continue
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
        extra = [p.name for p in params[2:] if p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if extra and not (extra == ["layer_type"] and per_type):
            raise ValueError(f"model type {mtype!r} is not supported: its rotary embedding {name} takes "
                             f"{extra} (a table per layer type), which pipeshard's blocks do not pass")


def _check_config(config: Any, mtype: str) -> None:
    """Refuse what a family's config turns on that the pipeline layers do not reproduce."""
    reasons = {
        "falcon": (getattr(config, "alibi", False), "config.alibi=true: ALiBi position biases computed in "
                   "its forward (falcon checkpoints with rotary positions, alibi=false, are supported)"),
        "gemma3_text": (getattr(config, "use_bidirectional_attention", False),
                        "config.use_bidirectional_attention=true: a bidirectional (non-causal) mask"),
    }
    on, why = reasons.get(mtype, (False, ""))
    if "indexed_attention" in (getattr(config, "layer_types", None) or ()):   # dots3_note with DSA, any family
        on, why = True, ("'indexed_attention' layers: a sparse-attention indexer (DSA) run on the explicit mask "
                         "its forward builds")
    if on:
        raise ValueError(f"model type {mtype!r} with {why}, which a pipeline of its modules cannot "
                         "reproduce; it is not supported")


DECODER_FAMILIES = ("opt",)
"""Families whose base model holds its pieces one level down (OPT's `model.decoder`); other
`model.decoder` families (BART-like: an embedding norm and scale in their forward) are refused."""


def _decoder(base: nn.Module, prefix: str, mtype: str) -> tuple[nn.Module, str]:
    """The module holding the layers: the base model, or, for `DECODER_FAMILIES`, its only
    child when that child is a decoder with its own layers (OPT's `model.decoder`)."""
    children = list(base.named_children())
    if mtype in DECODER_FAMILIES and len(children) == 1 and \
            any(isinstance(c, nn.ModuleList) for c in children[0][1].children()):
        name, child = children[0]
        return child, f"{prefix}.{name}"
    return base, prefix


def _problems(found: dict[str, list[str]], mtype: str, heads: list[str], extra: list[str]) -> list[str]:
    optional_norm = mtype == "opt"   # OPT's post-norm checkpoints (350m) have no final norm
    needed = ("embed", "layers") if optional_norm else ("embed", "layers", "norm")
    return [f"{k}: {v}" for k, v in found.items() if len(v) > 1] + \
        [f"no {k}" for k in needed if k not in found] + \
        ([f"unexpected modules {found['other']}"] if "other" in found else []) + \
        ([f"modules outside the base model {extra}"] if extra else []) + ([] if heads else ["no head"])


def discover_layout(model: nn.Module) -> HFLayout:
    """Find the embedding, positions, dropout, decoder layers, final norm, rotary and head of a
    causal LM (any device, meta included); a clear error when it has another shape."""
    mtype = str(getattr(model.config, "model_type", type(model).__name__))
    if mtype in INCOMPATIBLE:
        raise ValueError(f"model type {mtype!r} is not supported: it {INCOMPATIBLE[mtype]}, which "
                         "a pipeline of its modules cannot reproduce")
    _check_config(model.config, mtype)
    base = model.base_model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if base is model and head is not None:   # llama4's Llama4ForCausalLM: prefix 'language_model', module 'model'
        raise ValueError(f"{type(model).__name__} has an LM head, but its base_model_prefix "
                         f"{model.base_model_prefix!r} names none of its modules {[n for n, _ in model.named_children()]}"
                         ", so pipeshard cannot find its decoder layers; it is not supported")
    if base is model or head is None:
        raise ValueError(f"{type(model).__name__} is not a causal LM with a base model and an LM head; "
                         "load it with AutoModelForCausalLM")
    decoder, prefix = _decoder(base, model.base_model_prefix, mtype)
    found: dict[str, list[str]] = {}
    for name, child in decoder.named_children():
        found.setdefault("embed" if child is embed else _kind(child, name), []).append(f"{prefix}.{name}")
    heads = [n for n, c in model.named_children() if c is head]
    extra = [n for n, c in model.named_children() if c is not head and c is not base]
    problems = _problems(found, mtype, heads, extra)
    if problems:
        raise ValueError(f"{type(model).__name__} does not have the embedding / decoder layers / final "
                         f"norm / LM head layout pipeshard splits ({'; '.join(problems)})")
    _check_rotary(model, mtype)
    one = {k: v[0] for k, v in found.items()}
    if mtype not in TESTED:
        log.warning("model type %r has the usual layout but is not among the tested families %s; "
                    "compare a forward with transformers' before relying on it (docs/hf_families.md)",
                    mtype, TESTED)
    return HFLayout(mtype, one["embed"], one.get("positions"), one.get("dropout"), one["layers"],
                    one.get("norm"), one.get("rotary"), heads[0], len(model.get_submodule(one["layers"])),
                    one.get("project_in"), one.get("project_out"))


def layer_prefixes(layout: HFLayout, index: int) -> dict[str, str]:
    """Pipeline layer `index`'s submodule names -> their module paths in the HF model (the one
    rule mapping parameter names both ways: loading and export).

    >>> lay = HFLayout("gpt2", "transformer.wte", "transformer.wpe", "transformer.drop",
    ...                "transformer.h", "transformer.ln_f", None, "lm_head", 2)
    >>> layer_prefixes(lay, 0), layer_prefixes(lay, 2), layer_prefixes(lay, 3)
    ({'wte': 'transformer.wte', 'wpe': 'transformer.wpe'}, {'block': 'transformer.h.1'}, {'norm': 'transformer.ln_f', 'lm_head': 'lm_head'})
    """
    n = layout.num_layers
    if index == 0:
        out = {"wte": layout.embed}
        if layout.positions:
            out["wpe"] = layout.positions
        if layout.project_in:
            out["proj"] = layout.project_in
        return out
    if index <= n:
        return {"block": f"{layout.layers}.{index - 1}"}
    if index == n + 1:
        out = {"norm": layout.norm} if layout.norm else {}
        if layout.project_out:
            out["proj"] = layout.project_out
        return {**out, "lm_head": layout.head}
    raise IndexError(f"pipeline layer {index} does not exist (the model has {n + 2})")


# --------------------------------------------------------------------------- building layers
def model_class(config: Any) -> type:
    """The `AutoModelForCausalLM` class of a transformers config."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"model type {config.model_type!r} has no causal-LM class in transformers") from None


def _model_class(arch: str) -> type:
    """The causal-LM class of a family name (e.g. "llama")."""
    from transformers import AutoConfig

    return model_class(AutoConfig.for_model(arch))


def _special_floats(value: Any) -> Any:
    """transformers' JSON spelling of inf / nan (`{"__float__": "Infinity"}`) back to floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def config_from_json(config_json: str) -> Any:
    """A transformers config from its JSON (`model_type` picks the class), attention on SDPA."""
    from transformers import AutoConfig

    d = _special_floats(json.loads(config_json))
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    config._attn_implementation = attention_implementation(config)
    return config


def attention_implementation(config: Any) -> str:
    """"sdpa" where the model class supports it, else "eager" (gpt-oss: attention sinks).

    >>> from transformers import AutoConfig
    >>> attention_implementation(AutoConfig.for_model("llama"))
    'sdpa'
    """
    return "sdpa" if getattr(model_class(config), "_supports_sdpa", False) else "eager"


def additive_mask(mask: torch.Tensor | None, q_len: int, window: int | None, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """The float mask eager attention adds to its scores (0 = attend, the dtype's minimum =
    not) for a boolean mask of :func:`attention_mask`; for None (SDPA's causal flag) the causal
    mask of `q_len` positions (with the window), or None for one query (it sees every key).

    >>> additive_mask(None, 2, None, torch.float32, torch.device("cpu"))[0, 0].tolist()
    [[0.0, -3.4028234663852886e+38], [0.0, 0.0]]
    """
    if mask is None:
        if q_len == 1:
            return None
        mask = attention_mask(torch.ones(1, q_len, dtype=torch.long, device=device), q_len, window, explicit=True)
    out = torch.zeros(mask.shape, dtype=dtype, device=device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


def _check_composite(config: Any) -> None:
    """Refuse a composite (multimodal) checkpoint whose causal-LM class takes one of its
    sub-configs (qwen3_5, llama4, mllama, ...): its tensors are the whole model's."""
    want = getattr(model_class(config), "config_class", None)
    subs = [n for n in (getattr(config, "sub_configs", None) or {}) if isinstance(getattr(config, n, None), want or ())]
    if want is not None and not isinstance(config, want) and subs:
        raise ValueError(f"model type {config.model_type!r} is a composite (multimodal) checkpoint: its causal LM "
                         f"{model_class(config).__name__} takes the config's {subs[0]}, and pipeshard loads causal-LM "
                         "checkpoints only; save the language model alone with transformers "
                         "(AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)) and load NEW_DIR")


@functools.lru_cache(maxsize=8)
def meta_reference(config_json: str) -> tuple[nn.Module, HFLayout]:
    """The whole model on the meta device (no memory) and its layout, cached per process."""
    config = config_from_json(config_json)
    _check_composite(config)
    with meta_device():
        model = model_class(config)(config)
    return model, discover_layout(model)


def _window(config: Any, layer: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None and layer < len(types):
        return window if types[layer] == "sliding_attention" else None
    return window


def _layer_type(config: Any, layer: int) -> str | None:
    """The layer's `config.layer_types` entry when the rotary keeps a table per type, else None."""
    types = getattr(config, "layer_types", None)
    rotary_types = getattr(config, "rope_parameters", None)
    if types is None or not isinstance(rotary_types, dict) or rotary_types.get(types[layer]) is None:
        return None
    return types[layer]


def logit_softcap(config: Any) -> float | None:
    """The final logit soft-capping of a config (gemma2/3: `final_logit_softcapping`), or None.

    >>> from transformers import AutoConfig
    >>> logit_softcap(AutoConfig.for_model("gemma2", final_logit_softcapping=30.0)), logit_softcap(AutoConfig.for_model("llama"))
    (30.0, None)
    """
    cap = getattr(config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


def _pipeline_layer(model: nn.Module, lay: HFLayout, index: int, take: Any, rotary: nn.Module | None) -> nn.Module:
    """Pipeline layer `index` made of `take(module)` for the model's modules (a deep copy, or the
    module itself), with the given rotary module for a block."""
    n, get, config = lay.num_layers, model.get_submodule, model.config
    opt = (lambda path: take(get(path)) if path else None)
    if index == 0:
        return HFTokenEmbedding(take(get(lay.embed)), opt(lay.positions), opt(lay.dropout),
                                family_scales(config)[0], opt(lay.project_in))
    if index <= n:
        return HFBlock(take(get(f"{lay.layers}.{index - 1}")), rotary, _window(config, index - 1),
                       router_spec(model), _layer_type(config, index - 1))
    if index == n + 1:
        _, logit, divide = family_scales(config)
        return HFHead(opt(lay.norm), take(get(lay.head)), scale=logit, divide=divide, proj=opt(lay.project_out),
                      softcap=logit_softcap(config))
    raise IndexError(f"pipeline layer {index} does not exist (the model has {n + 2})")


def meta_layer(config_json: str, index: int) -> nn.Module:
    """Pipeline layer `index` with its weights on the meta device (rotary buffers on the CPU)."""
    model, lay = meta_reference(config_json)
    rotary = None
    if lay.rotary and 1 <= index <= lay.num_layers:
        with torch.device("cpu"):
            rotary = type(model.get_submodule(lay.rotary))(config=model.config)
    return _pipeline_layer(model, lay, index, copy.deepcopy, rotary)


def _ambient_meta() -> bool:
    return torch.empty(0).device.type == "meta"


def build_hf_layer(arch: str, config_json: str, index: int) -> nn.Module:
    """Build pipeline layer `index` alone with random weights, initialised as transformers would
    (the model class's `_init_weights`, children before parents). `arch` is informational."""
    layer = meta_layer(config_json, index)
    if _ambient_meta():  # counting parameters / analytic profiling: no memory, no init
        return layer
    rotary = getattr(layer, "rotary", None)
    for child in layer.children():
        if child is not rotary:
            child.to_empty(device="cpu")
    for p in layer.parameters():
        if hasattr(p, "_is_hf_initialized"):
            del p._is_hf_initialized
    reference, _ = meta_reference(config_json)
    with torch.no_grad():
        layer.apply(lambda m: None if m is rotary else reference._init_weights(m))
    return layer


def layers_from_hf(model: nn.Module) -> list[nn.Module]:
    """Wrap an existing HF causal LM's own submodules as pipeshard layers (weights shared)."""
    lay = discover_layout(model)
    rotary = model.get_submodule(lay.rotary) if lay.rotary else None
    return [_pipeline_layer(model, lay, i, lambda m: m, rotary) for i in range(lay.num_layers + 2)]


# --------------------------------------------------------------------------- configs and specs
def hf_config(cfg: Any) -> Any:
    """The transformers config of a random model of family `cfg.arch` (`HFModelConfig` fields).

    >>> from experiments.config import HFModelConfig
    >>> hf_config(HFModelConfig(arch="gpt2", layers=2, dim=32, heads=2, vocab=300, seq_len=16)).n_layer
    2
    """
    from transformers import AutoConfig

    from experiments.fields import choice_text

    arch = choice_text(cfg.arch)
    if arch not in ARCHS:
        raise ValueError(f"model.arch={arch!r}; choose one of {ARCHS} (or give model.pretrained=<dir>)")
    layers, dim = int(cfg.layers), int(cfg.dim)
    heads, vocab = int(cfg.heads), int(cfg.vocab)
    seq_len, dropout = int(cfg.seq_len), float(cfg.dropout)
    tie = bool(cfg.tie_embeddings)
    kv_heads, intermediate = cfg.kv_heads, cfg.intermediate
    if arch == "gpt2":
        kwargs: dict[str, Any] = dict(
            n_positions=seq_len, n_embd=dim, n_layer=layers, n_head=heads, resid_pdrop=dropout,
            embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    else:
        kwargs = dict(hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=int(intermediate) if intermediate else 4 * dim,
                      max_position_embeddings=seq_len, attention_dropout=dropout, pad_token_id=None,
                      bos_token_id=min(1, vocab - 1), eos_token_id=min(2, vocab - 1))
        if arch == "gpt_neox":
            kwargs["hidden_dropout"] = dropout
        else:
            kwargs["num_key_value_heads"] = int(kv_heads) if kv_heads else heads
    return AutoConfig.for_model(arch, vocab_size=vocab, tie_word_embeddings=tie, use_cache=False,
                                attn_implementation="sdpa", **kwargs)
