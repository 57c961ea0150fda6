"""Decoder-only transformer (GPT) as a list of pipeline layers.

Layer 0 is the token + position embedding (`LongTensor [b, t] -> [b, t, d]`), layers 1..L are
pre-norm blocks (causal self-attention and a 4x MLP), the last layer is the final LayerNorm and
the LM head producing logits `[b, t, vocab]`. With a large vocabulary the first and last layers
cost much more than a block, which is what makes the choice of split matter.
With `loss="chunked"` the head returns `HeadOutput` (normed hidden states, weight, bias) and the
loss is `experiments.models.loss.chunked_lm_loss`, which never builds the fp32 logits.

Example:
    >>> from experiments.config import GPTConfig
    >>> spec = build_gpt(GPTConfig(layers=2, dim=32, heads=2, vocab=256, seq_len=16))
    >>> model = compose(spec.layers)
    >>> logits = model(spec.example_input(3))
    >>> spec.loss_fn(logits, spec.example_target(3)).ndim
    0
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.fields import sequence_parallel_mode
from experiments.models.loss import HeadOutput, fused_head, lm_loss, loss_function, loss_settings
from experiments.models.spec import ModelSpec, compose, count_params

__all__ = ["lm_spec", "GPTEmbedding", "GPTBlock", "GPTHead", "build_gpt", "lm_loss", "random_tokens", "compose"]

_INIT_STD = 0.02


class GPTEmbedding(nn.Module):
    """Token + learned position embedding: `[b, t]` int64 -> `[b, t, dim]`."""

    def __init__(self, vocab: int, dim: int, seq_len: int, dropout: float = 0.0,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.tok.weight, std=_INIT_STD)
        nn.init.normal_(self.pos.weight, std=_INIT_STD)

    def tp_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism (`engine.tp`): the token table split on the vocabulary (each rank
        looks up its rows, the vectors are summed); the position table replicated. With
        `sequence_parallel` the sum is reduce-scattered on the sequence (each rank its positions;
        the position table's gradient is then summed over tp)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import RowwiseParallel

        _check_tp(self.tok.num_embeddings, tp, "model.vocab")
        if not self.sequence_parallel:
            return {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
        _check_tp(self.pos.num_embeddings, tp, "model.seq_len")
        for prm in self.pos.parameters():
            prm._tp_grad_sum = True   # type: ignore[attr-defined]  # engine.tp.TpStageOptimizer
        return {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.pos.num_embeddings:
            raise ValueError(
                f"sequence length {t} exceeds model.seq_len={self.pos.num_embeddings}; "
                "raise model.seq_len or feed shorter sequences"
            )
        h = self.tok(idx)
        start = 0
        if h.shape[1] != t:   # sequence parallel: this tp rank's positions
            start = self.tok.weight.device_mesh.get_local_rank() * h.shape[1]
        positions = torch.arange(start, start + h.shape[1], device=idx.device)
        return self.drop(h + self.pos(positions))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: `x + attn(ln(x))`, then `x + mlp(ln(x))`; `[b, t, d] -> [b, t, d]`."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, mlp_ratio: int = 4, num_blocks: int = 1,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        if dim % heads:
            raise ValueError(f"model.dim={dim} is not divisible by model.heads={heads}; choose heads dividing dim")
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, mlp_ratio * dim)
        self.fc_out = nn.Linear(mlp_ratio * dim, dim)
        self.drop = nn.Dropout(dropout)
        # GPT-2 init: residual projections scaled by 1/sqrt(2 * blocks) so depth does not blow up.
        for lin in (self.qkv, self.fc):
            nn.init.normal_(lin.weight, std=_INIT_STD)
            nn.init.zeros_(lin.bias)
        for lin in (self.proj, self.fc_out):
            nn.init.normal_(lin.weight, std=_INIT_STD / math.sqrt(2 * num_blocks))
            nn.init.zeros_(lin.bias)

    def tp_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism (`engine.tp`): q/k/v (one fused Linear, each part split on its own)
        and the MLP's up projection colwise, the attention's and the MLP's out projections
        rowwise; afterwards the block holds `heads / tp` heads. With `sequence_parallel` the
        LayerNorms and the residual stream are split on the sequence: all-gathered before q/k/v
        and the MLP, reduce-scattered after their out projections."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        from engine.tp import FusedColwiseParallel

        _check_tp(self.heads, tp, "model.heads")
        _check_tp(self.fc.out_features, tp, "the MLP width (model.dim x model.mlp_ratio)")
        _check_tp(self.ln1.normalized_shape[0], tp, "model.dim")
        self.heads //= tp
        if not self.sequence_parallel:
            return {"qkv": FusedColwiseParallel(3), "proj": RowwiseParallel(),
                    "fc": ColwiseParallel(), "fc_out": RowwiseParallel()}
        seq = Shard(1)
        return {"ln1": SequenceParallel(), "qkv": FusedColwiseParallel(3, input_layouts=seq),
                "proj": RowwiseParallel(output_layouts=seq), "ln2": SequenceParallel(),
                "fc": ColwiseParallel(input_layouts=seq), "fc_out": RowwiseParallel(output_layouts=seq)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))
        b, t = qkv.shape[:2]   # the whole sequence, also under sequence parallelism
        d = qkv.shape[-1] // 3   # dim / tp under tensor parallelism (this rank's heads)
        q, k, v = qkv.split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class GPTHead(nn.Module):
    """Final LayerNorm and LM head: `[b, t, d] -> [b, t, vocab]` logits; with `fused` (the
    chunked loss) the forward returns `HeadOutput(ln_f(x), weight, bias)` instead, and
    `logits(x)` gives the logits either way (generation)."""

    def __init__(self, dim: int, vocab: int, fused: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.fused = fused
        nn.init.normal_(self.head.weight, std=_INIT_STD)

    def tp_plan(self, tp: int) -> dict[str, Any]:
        """Tensor parallelism (`engine.tp`): the LM head split on the vocabulary; its logits stay
        sharded (a DTensor) and `lm_loss` takes the cross-entropy from the shards."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel

        if self.fused:
            raise ValueError("model.loss=chunked is not supported with pipeline.tensor_parallel > 1; "
                             "use model.loss=full (the vocabulary-parallel loss never gathers the logits)")
        _check_tp(self.head.out_features, tp, "model.vocab")
        if not self.sequence_parallel:
            return {"head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        from torch.distributed.tensor.parallel import SequenceParallel

        return {"ln_f": SequenceParallel(),
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}

    def forward(self, x: torch.Tensor) -> Any:
        if self.fused:
            return HeadOutput(self.ln_f(x), self.head.weight, self.head.bias)
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def _check_tp(size: int, tp: int, what: str) -> None:
    if size % tp:
        raise ValueError(f"pipeline.tensor_parallel={tp} does not divide {what}={size}; choose a "
                         "tensor_parallel that divides it")


def random_tokens(batch: int, *, seq_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Deterministic random token ids `[batch, seq_len]` (example inputs and targets)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len), generator=gen, dtype=torch.int64)


def build_gpt(cfg: Any) -> ModelSpec:
    """Build the GPT layer factories from the typed model group (`experiments.config.GPTConfig`;
    `experiments.models.build_model` types a mapping).

    Fields: layers, dim, heads, vocab, seq_len, dropout, mlp_ratio, tie_embeddings, loss,
    loss_chunk, sequence_parallel.
    """
    layers = int(cfg.layers)
    dim = int(cfg.dim)
    heads = int(cfg.heads)
    vocab = int(cfg.vocab)
    seq_len = int(cfg.seq_len)
    dropout = float(cfg.dropout)
    mlp_ratio = int(cfg.mlp_ratio)
    tie = bool(cfg.tie_embeddings)
    loss, chunk = loss_settings(cfg)
    if dim % heads:
        raise ValueError(f"model.dim={dim} is not divisible by model.heads={heads}; choose heads dividing dim")
    sp = {"sequence_parallel": True} if sequence_parallel_mode(getattr(cfg, "sequence_parallel", False)) is True else {}
    factories = [partial(GPTEmbedding, vocab, dim, seq_len, dropout, **sp)]
    factories += [partial(GPTBlock, dim, heads, dropout, mlp_ratio, layers, **sp) for _ in range(layers)]
    factories.append(partial(GPTHead, dim, vocab, **sp))
    ties = [("0.tok.weight", f"{layers + 1}.head.weight")] if tie else []
    return lm_spec(factories, ties, seq_len=seq_len, vocab=vocab, name=f"gpt-L{layers}-d{dim}-v{vocab}",
                   loss=loss, loss_chunk=chunk)


def lm_spec(factories: list, ties: list[tuple[str, str]], *, seq_len: int, vocab: int, name: str,
            loss: str = "full", loss_chunk: int = 1024, **extra: Any) -> ModelSpec:
    """The ModelSpec of a token-in, logits-out language model (GPT here, Hugging Face adapters).
    `loss="chunked"`: the head layer returns `HeadOutput` and the loss is the chunked
    linear + cross-entropy of `experiments.models.loss` (`loss_chunk` tokens at a time)."""
    heads = {"full": (factories[-1], loss_function("full")),
             "chunked": (partial(fused_head, factories[-1]), loss_function("chunked", loss_chunk))}
    last, loss_fn = heads[loss]
    factories = factories[:-1] + [last]
    return ModelSpec(
        layers=factories,
        loss_fn=loss_fn,
        example_input=partial(random_tokens, seq_len=seq_len, vocab=vocab, seed=0),
        example_target=partial(random_tokens, seq_len=seq_len, vocab=vocab, seed=1),
        ties=ties,
        name=name,
        num_params=count_params(factories, ties),
        tokens_per_sample=seq_len,
        extra={"vocab": vocab, "seq_len": seq_len, "loss": loss, "loss_chunk": loss_chunk,
               "loss_heads": heads, **extra},
    )
