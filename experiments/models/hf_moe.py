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
           "moe_summary"]


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
