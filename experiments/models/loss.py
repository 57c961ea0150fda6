"""The LM loss: full (logits, then cross-entropy) or chunked (the head's matmul and the
cross-entropy fused, a chunk of tokens at a time).

Under ``model.loss=full`` the head layer returns logits ``[b, t, V]`` and :func:`lm_loss`
upcasts them to fp32 and takes the cross-entropy: autograd keeps the fp32 logits' log-softmax
for backward and the backward makes a ``[b, t, V]`` gradient, several fp32 ``[b, t, V]``
tensors at the last rank's peak (4.2 GB each for Llama-3-8B at 8192 tokens).

Under ``model.loss=chunked`` the head layer returns :class:`HeadOutput` ``(hidden, weight,
bias)`` (its final norm already applied) and :func:`chunked_lm_loss` runs
:class:`LinearCrossEntropy`: the forward computes ``chunk`` tokens' logits at a time, keeps
only their log-sum-exp (``[b * t]`` fp32), and the backward recomputes each chunk's logits
to form its gradient, accumulating the hidden states' and the weight's gradients. Saved for
backward: the hidden states and the log-sum-exp; the peak beyond them is one chunk's logits
in fp32 and their low-precision copy (about ``chunk * V * 6`` bytes in bf16) plus the
gradients of the hidden states and the weight. The price is the head's forward matmul run a
second time in backward (the head's FLOPs x 4/3). Liger-Kernel's fused linear cross entropy
instead computes the gradients in forward and keeps a weight-sized gradient per microbatch in
flight until backward, which a pipeline's last rank (several microbatches in flight under
gpipe or zero-bubble schedules) pays per microbatch; recomputing keeps nothing weight-sized.

Example:
    >>> import torch
    >>> h, w = torch.randn(2, 5, 8), torch.randn(11, 8)
    >>> t = torch.randint(0, 11, (2, 5))
    >>> full = lm_loss(h @ w.T, t)
    >>> torch.allclose(chunked_lm_loss(HeadOutput(h, w, None), t, chunk=3), full)
    True
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LOSSES", "HeadOutput", "LinearCrossEntropy", "lm_loss", "chunked_lm_loss",
           "loss_function", "loss_settings", "profile_loss_kwargs", "fused_head", "IGNORE_INDEX"]

LOSSES: tuple[str, ...] = ("full", "chunked")
IGNORE_INDEX = -100   # F.cross_entropy's default: targets with this value do not count


class HeadOutput(NamedTuple):
    """What a chunked head returns in place of logits: the normed hidden states ``[b, t, d]``,
    the LM head's weight ``[V, d]`` (the parameter itself, so its gradient reaches it) and bias."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over all positions: logits `[b, t, v]`, targets `[b, t]`
    (a :class:`HeadOutput` is taken too, by the chunked loss with its default chunk; logits that
    are a DTensor sharded on the vocabulary, by `engine.tp.vocab_parallel_cross_entropy`)."""
    if isinstance(logits, tuple):
        return chunked_lm_loss(HeadOutput(*logits), targets)
    if hasattr(logits, "device_mesh"):   # a tensor-parallel head's vocabulary-sharded DTensor
        from engine.tp import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits, targets)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def chunked_lm_loss(out: HeadOutput | tuple, targets: Tensor, chunk: int = 1024) -> Tensor:
    """:func:`lm_loss` of ``hidden @ weight.T + bias`` computed ``chunk`` tokens at a time
    without materialising the logits (see the module docstring). ``out`` may also be logits
    ``[b, t, V]`` (a head built for the full loss, e.g. in generation): then it is
    :func:`lm_loss`."""
    if isinstance(out, Tensor):
        return lm_loss(out, targets)
    hidden, weight, bias = HeadOutput(*out)
    if chunk < 1:
        raise ValueError(f"model.loss_chunk must be >= 1 (got {chunk})")
    return LinearCrossEntropy.apply(hidden, weight, bias, targets, int(chunk))


def loss_function(kind: str = "full", chunk: int = 1024) -> Callable[[Any, Tensor], Tensor]:
    """The spec's ``loss_fn`` for ``model.loss`` (a picklable callable).

    >>> loss_function("chunked", 512).keywords
    {'chunk': 512}
    """
    if kind not in LOSSES:
        raise ValueError(f"model.loss={kind!r}; choose one of {LOSSES}")
    if kind == "full":
        return lm_loss
    if int(chunk) < 1:
        raise ValueError(f"model.loss_chunk must be >= 1 (got {chunk})")
    return partial(chunked_lm_loss, chunk=int(chunk))


def loss_settings(cfg: Any) -> tuple[str, int]:
    """(``model.loss``, ``model.loss_chunk``) of the typed model group, the loss as plain text.

    >>> from experiments.config import GPTConfig, LossKind
    >>> loss_settings(GPTConfig(loss=LossKind["chunked"], loss_chunk=256))
    ('chunked', 256)
    """
    loss = cfg.loss
    return str(getattr(loss, "value", loss)), int(cfg.loss_chunk)


def profile_loss_kwargs(spec: Any, microbatch: int) -> dict[str, Any]:
    """Keyword arguments for ``partitioner.profile`` so that the last layer is profiled with the
    spec's loss (``loss_fn``, ``example_target`` of one microbatch) and, for a language model,
    with the other head too (``loss_variants``: the full head's cost under ``model.loss=chunked``
    and the reverse), so the planner can say when the other head would fit.

    >>> from experiments.models import build_model
    >>> spec = build_model({"name": "gpt", "layers": 1, "dim": 8, "heads": 2, "vocab": 16, "seq_len": 4})
    >>> sorted(profile_loss_kwargs(spec, 2)["loss_variants"])
    ['chunked']
    """
    out: dict[str, Any] = {"loss_fn": spec.loss_fn, "example_target": spec.example_target(int(microbatch))}
    heads = spec.extra.get("loss_heads") or {}
    variants = {name: head for name, head in heads.items() if name != spec.extra.get("loss")}
    if variants:
        out["loss_variants"] = variants
    return out


def fused_head(factory: Callable[[], Any]) -> Any:
    """Build the head layer with ``factory`` and switch it to return :class:`HeadOutput` (its
    ``fused`` attribute; the layer keeps ``logits(x)`` for generation). A picklable factory
    when ``factory`` is: ``functools.partial(fused_head, factory)``."""
    layer = factory()
    if not hasattr(layer, "fused") or not hasattr(layer, "logits"):
        raise TypeError(f"{type(layer).__name__} is not an LM head with a chunked-loss mode "
                        "(model.loss=chunked needs GPTHead or HFHead as the last layer)")
    layer.fused = True
    return layer


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's, else the weight's."""
    dev = hidden.device.type
    if _autocast_device(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def _autocast_device(dev: str) -> bool:
    """Whether torch.autocast knows the device type (the meta device of analytic profiles does not)."""
    try:
        torch.is_autocast_enabled(dev)
    except RuntimeError:
        return False
    return True


def _no_autocast(dev: str) -> Any:
    """The body runs in the dtypes it chose (autocast off), on any device."""
    return torch.autocast(dev, enabled=False) if _autocast_device(dev) else contextlib.nullcontext()


def _chunk_logits(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """One chunk's logits in fp32 (the matmul in the inputs' dtype, then upcast)."""
    z = h @ w.t()
    if b is not None:
        z = z + b
    return z.float()


class LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T + bias, targets)`` (mean over the targets that are not
    :data:`IGNORE_INDEX`), computed in chunks of ``chunk`` tokens; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                chunk: int) -> Tensor:
        cdt = _compute_dtype(hidden, weight)
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        if t.numel() != h.shape[0]:
            raise ValueError(f"the loss got {h.shape[0]} hidden positions but {t.numel()} targets")
        w, b = weight.to(cdt), None if bias is None else bias.to(cdt)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        valid = t != IGNORE_INDEX
        with _no_autocast(h.device.type):
            for s in range(0, h.shape[0], chunk):
                z = _chunk_logits(h[s:s + chunk].to(cdt), w, b)
                lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
                tc, vc = t[s:s + chunk], valid[s:s + chunk]
                picked = z.gather(1, tc.clamp(min=0).unsqueeze(1)).squeeze(1)
                total += ((lse[s:s + chunk] - picked) * vc).sum()
                del z
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.cdt = chunk, cdt
        return total / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        chunk, cdt = ctx.chunk, ctx.cdt
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        valid = t != IGNORE_INDEX
        scale = grad.float() / valid.sum().clamp(min=1)
        w, b = weight.to(cdt), None if bias is None else bias.to(cdt)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros_like(weight) if need_w else None
        gb = torch.zeros_like(bias) if need_b and bias is not None else None
        with _no_autocast(h.device.type):
            for s in range(0, h.shape[0], chunk):
                hc = h[s:s + chunk].to(cdt)
                tc, vc = t[s:s + chunk], valid[s:s + chunk]
                # d loss / d logits = (softmax - onehot) * scale, in place on the fp32 logits
                g = _chunk_logits(hc, w, b).sub_(lse[s:s + chunk, None]).exp_()
                g[torch.arange(g.shape[0], device=g.device), tc.clamp(min=0)] -= 1.0
                g.mul_((scale * vc).unsqueeze(1))
                gl = g.to(cdt)
                del g
                if gh is not None:
                    gh[s:s + chunk] = gl @ w
                if gw is not None:
                    gw.addmm_(gl.t().to(gw.dtype), hc.to(gw.dtype))
                if gb is not None:
                    gb += gl.sum(0).to(gb.dtype)
        return (None if gh is None else gh.view_as(hidden)), gw, gb, None, None
