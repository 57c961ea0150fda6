"""Mixture-of-Experts routing statistics that travel through the pipeline, and the router's
auxiliary (load-balancing) loss computed from them exactly as transformers computes it.

transformers' `load_balancing_loss_func` (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, ...) reduces
each MoE layer's router logits to three sums, added over the layers: the top-k assignments per
expert (`histc` of the top-k indices, no gradient), the routing probabilities per expert
(softmax of the logits, summed over the tokens: the differentiable part) and the number of
token rows; at the end `aux = E * sum(counts / rows * probs / rows)`. The sums are additive
over layers, so a pipeline carries them: every decoder layer of an MoE model returns
`(hidden, stats)` with `stats = [counts (E), probs (E), rows (1)]` (fp32, `2E + 1` values), its
own layer's sums added in the same order as transformers adds them; the stats cross stage
boundaries with the activations (their gradient comes back with the activations'), and the
last rank's loss adds `coef * aux` (:class:`RouterLoss`). For one microbatch the loss is
`model(ids, labels=..., output_router_logits=True).loss`.

Example:
    >>> import torch
    >>> logits = [torch.randn(6, 4), torch.randn(6, 4)]     # two layers, 6 tokens, 4 experts
    >>> stats = torch.zeros(9)
    >>> for z in logits:
    ...     stats = stats + layer_stats(z, top_k=2)
    >>> from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    >>> bool(aux_loss(stats, 4) == load_balancing_loss_func(tuple(logits), 4, 2))
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

__all__ = ["RouterSpec", "router_spec", "layer_stats", "aux_loss", "RouterLoss", "routers_in",
           "moe_summary", "meta_experts_forward", "meta_experts", "META_EXPERTS"]

META_EXPERTS = "pipeshard_meta"
"""The experts implementation (transformers' `ExpertsInterface`) a block uses on the meta device."""


@dataclass(frozen=True)
class RouterSpec:
    """How a model's routers are found and what its auxiliary loss needs.

    `router`: the module class whose output `index` is the router logits (transformers'
    `OutputRecorder` for `router_logits`), `layer_name` an optional path filter;
    `num_experts`, `top_k`, `coef` (`router_aux_loss_coef`) as the causal-LM class reads them.
    """

    router: type
    index: int
    layer_name: str | None
    num_experts: int
    top_k: int
    coef: float

    @property
    def width(self) -> int:
        """Values in a stats tensor: counts, probabilities, rows."""
        return 2 * self.num_experts + 1


def router_spec(model: nn.Module) -> RouterSpec | None:
    """The routing of a transformers causal LM whose loss adds the router auxiliary loss
    (it has `router_aux_loss_coef` and its base model records `router_logits`), else None
    (dense models; MoE models whose transformers loss has no auxiliary term, e.g. DeepSeek-V3).
    A model that adds the auxiliary loss from routers this adapter cannot find is refused."""
    if not hasattr(model, "router_aux_loss_coef"):
        return None
    recorder = (getattr(type(model.base_model), "_can_record_outputs", None) or {}).get("router_logits")
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    target = getattr(recorder, "target_class", None)
    if target is None or experts is None or top_k is None:
        raise ValueError(f"{type(model).__name__} adds a router auxiliary loss from router logits that "
                         "pipeshard cannot locate (no router class / expert count); it is not supported")
    return RouterSpec(target, int(recorder.index), recorder.layer_name, int(experts), int(top_k),
                      float(model.router_aux_loss_coef))


def routers_in(block: nn.Module, spec: RouterSpec) -> list[nn.Module]:
    """The router modules of one decoder layer (as transformers' recorder matches them)."""
    out = []
    for name, module in block.named_modules():
        if not isinstance(module, spec.router):
            continue
        if spec.layer_name is not None and f".{spec.layer_name.strip('.')}." not in f".{name}.":
            continue
        out.append(module)
    return out


def layer_stats(logits: Tensor, top_k: int) -> Tensor:
    """One MoE layer's sums `[counts (E), probabilities (E), rows]` from its router logits
    `[tokens, E]`, computed as transformers' `load_balancing_loss_func` computes them (no
    attention mask: every position is a token)."""
    probs = torch.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    e = logits.shape[-1]
    dtype = torch.float32 if logits.device.type in ("cpu", "mps", "meta") else torch.int32
    counts = torch.histc(chosen.reshape(-1).to(dtype), bins=e, min=0, max=e).float()
    rows = torch.full((1,), float(probs.shape[0]), device=logits.device)
    return torch.cat([counts, probs.float().sum(dim=0), rows])


def aux_loss(stats: Tensor, num_experts: int) -> Tensor:
    """The auxiliary loss of the summed stats (transformers' final reduction)."""
    counts, probs, rows = stats[:num_experts], stats[num_experts:2 * num_experts], stats[-1]
    rows = rows.detach()
    return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * num_experts


class RouterLoss:
    """The loss of an MoE model's last stage: `base(head_out, target) + coef * aux`, for the
    head's `(head_out, stats)`. The auxiliary values of the microbatches are kept (detached)
    until :meth:`pop` (the step's mean for metrics.jsonl `aux_loss`).

    >>> loss = RouterLoss(lambda out, t: out.sum(), num_experts=2, coef=0.5)
    >>> float(loss((torch.ones(3), torch.tensor([1., 1., 0.5, 0.5, 2.])), None)), loss.pop()
    (3.25, 0.5)
    """

    def __init__(self, base: Callable[[Any, Tensor], Tensor], num_experts: int, coef: float) -> None:
        self.base, self.num_experts, self.coef = base, int(num_experts), float(coef)
        self._aux: list[Tensor] = []

    def __call__(self, value: Any, target: Tensor) -> Tensor:
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Tensor)):
            raise TypeError("an MoE model's loss takes the head's (output, router stats); the last "
                            f"layer returned {type(value).__name__}")
        out, stats = value
        aux = aux_loss(stats, self.num_experts)
        self._aux.append(aux.detach())
        return self.base(out, target) + self.coef * aux

    def clear(self) -> None:
        """Forget the kept auxiliary values (before a step)."""
        self._aux.clear()

    def pop(self) -> float | None:
        """The mean auxiliary loss of the microbatches since the last pop (None if none)."""
        if not self._aux:
            return None
        out = float(torch.stack([a.float().cpu() for a in self._aux]).mean())
        self._aux.clear()
        return out


def moe_summary(spec: RouterSpec | None) -> dict[str, Any]:
    """The routing facts a spec's `extra` records (empty for a dense model)."""
    if spec is None:
        return {}
    return {"num_experts": spec.num_experts, "experts_per_token": spec.top_k, "router_aux_loss_coef": spec.coef}


# --------------------------------------------------------------------------- the meta device
def _one_expert(x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    """`x` through one expert's matrix (expert 0 of the stack: the same shapes as any)."""
    w = weight[0]
    y = x @ (w if transposed else w.transpose(0, 1))
    return y if bias is None else y + bias


def meta_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                         top_k_weights: Tensor) -> Tensor:
    """transformers' experts forward (`grouped_mm_experts_forward`) with the same shapes and
    work, for the meta device, where routing has no values (the grouped kernel cannot run there
    in fp32): every token's `top_k` routed copies (`S = tokens * top_k` rows) go through one
    expert-sized up (gate-up) and down projection, so the FLOPs and activations are those of
    top-k experts per token, not of all experts; the weights are the whole expert stacks (all
    experts' parameters stay in the layer and receive a full-size gradient)."""
    tokens, dim = hidden_states.shape
    k = top_k_index.size(-1)
    x = hidden_states.repeat_interleave(k, dim=0)             # (S, dim)
    ids = top_k_index.reshape(-1)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[ids] if self.has_bias else None
    h = _one_expert(x, up, up_bias, self.is_transposed)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = _one_expert(h, self.down_proj, self.down_proj_bias[ids] if self.has_bias else None, self.is_transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1, 1)
    return out.view(tokens, k, dim).sum(dim=1).to(hidden_states.dtype)


class meta_experts:  # noqa: N801 - a context manager used like a function
    """Within the block, experts modules run :func:`meta_experts_forward` (the analytic,
    meta-device profile); restored on exit. A block without such modules is left alone.

    >>> with meta_experts(nn.Linear(2, 2)):
    ...     pass
    """

    def __init__(self, block: nn.Module) -> None:
        self.configs = {id(m.config): m.config for m in block.modules()
                        if hasattr(m, "has_gate") and hasattr(m, "_is_expert_parallel") and hasattr(m, "config")}
        self.saved: dict[int, Any] = {}

    def __enter__(self) -> "meta_experts":
        if self.configs:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

            if META_EXPERTS not in ALL_EXPERTS_FUNCTIONS:
                ALL_EXPERTS_FUNCTIONS[META_EXPERTS] = meta_experts_forward
        for key, config in self.configs.items():
            self.saved[key] = config._experts_implementation
            config._experts_implementation = META_EXPERTS
        return self

    def __exit__(self, *exc: Any) -> None:
        for key, config in self.configs.items():
            config._experts_implementation = self.saved[key]
