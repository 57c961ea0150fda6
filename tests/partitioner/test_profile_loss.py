"""The loss in the profile (`profile(loss_fn=, example_target=)`): the last layer's costs carry what
the loss saves and its backward's transient, in both modes, and the plan books them on the last
rank; a loss variant that would fit is named in the PartitionError."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partitioner import PartitionError, partition, profile

TOKENS, DIM, VOCAB = (4, 64), 32, 2048
LOGITS_FP32 = TOKENS[0] * TOKENS[1] * VOCAB * 4      # one fp32 [b, s, V] tensor: 2 MiB


def _layers():
    return [lambda: nn.Linear(DIM, DIM), lambda: nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()),
            lambda: nn.Linear(DIM, DIM), lambda: nn.Linear(DIM, VOCAB, bias=False)]


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(*TOKENS, DIM, generator=g), torch.randint(0, VOCAB, TOKENS, generator=g)


def _profiles(mode: str):
    x, y = _inputs()
    kw = dict(mode=mode, repeats=1, warmup=0, min_time_s=0.0) if mode == "measure" else dict(mode=mode)
    return profile(_layers(), x, **kw), profile(_layers(), x, loss_fn=_ce, example_target=y, **kw)


@pytest.mark.parametrize("mode", ["measure", "analytic"])
def test_the_last_layer_carries_the_loss_saved_tensors_and_its_backward_transient(mode: str) -> None:
    plain, with_loss = _profiles(mode)
    a, b = plain.layers[-1], with_loss.layers[-1]
    assert plain.layers[:-1] == with_loss.layers[:-1] or mode == "measure"   # only the last layer changes
    assert with_loss.meta["loss"] == "_ce" and "loss" not in plain.meta
    # cross-entropy keeps its fp32 log-softmax: one logits-sized tensor more than the layer alone
    assert b.activation_bytes - a.activation_bytes >= LOGITS_FP32
    # MemTracker's transient of the backward: at least the logits' gradient, twice (fp32)
    assert b.workspace_bytes is not None and b.workspace_bytes >= 2 * LOGITS_FP32
    assert a.workspace_bytes is None
    assert b.param_bytes == a.param_bytes
    if mode == "analytic":   # the loss's memory-bound ops cost roofline time (no matmul FLOPs)
        assert b.forward_s > a.forward_s and b.backward_s > a.backward_s


def test_the_plan_books_the_loss_on_the_last_rank_as_activations_and_temporary() -> None:
    plain, with_loss = _profiles("analytic")
    kw = dict(schedule="1f1b", microbatches=4, optimizer="sgd", simulate=False)
    p0, p1 = partition(plain, 2, **kw), partition(with_loss, 2, **kw)
    assert p0.stage_ranges == p1.stage_ranges
    first0, first1 = p0.rank_memory_breakdown[0], p1.rank_memory_breakdown[0]
    last0, last1 = p0.rank_memory_breakdown[-1], p1.rank_memory_breakdown[-1]
    assert first1 == first0                        # the loss lives on the last rank only
    held = p1.stage_inflight[-1]
    assert last1["activations"] - last0["activations"] >= held * LOGITS_FP32
    # the loss's backward transient (the logits' fp32 gradient and its copy) is the last rank's
    # temporary: a maximum with the head weight's accumulation transient, which comes after it
    assert last1["temporary"] >= 2 * LOGITS_FP32


def test_a_loss_variant_that_fits_is_named_in_the_partition_error() -> None:
    """A 'bf16 head' variant whose loss keeps less: the limit between the two fits only it."""
    x, y = _inputs()

    def small_head() -> nn.Module:
        return nn.Linear(DIM, VOCAB, bias=False)

    def lean_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1)[:, : VOCAB // 8], target.flatten() % (VOCAB // 8))

    prof = profile(_layers(), x, mode="analytic", loss_fn=_ce, example_target=y,
                   loss_variants={"lean": (small_head, lean_loss)})
    lean = prof.meta["loss_variants"]["lean"]
    assert lean["activation_bytes"] < prof.layers[-1].activation_bytes
    kw = dict(schedule="1f1b", microbatches=2, optimizer="sgd", simulate=False)
    need = max(partition(prof, 2, **kw).rank_memory_bytes)
    with pytest.raises(PartitionError, match=r"fits with the lean loss head \(model.loss=lean\): last rank"):
        partition(prof, 2, memory_limit_bytes=need - LOGITS_FP32, **kw)
    with pytest.raises(PartitionError) as err:   # too small for either: no such hint
        partition(prof, 2, memory_limit_bytes=need // 20, **kw)
    assert "fits with" not in str(err.value)


def test_loss_arguments_are_checked() -> None:
    x, y = _inputs()
    with pytest.raises(ValueError, match="needs example_target"):
        profile(_layers(), x, mode="analytic", loss_fn=_ce)
    with pytest.raises(ValueError, match="need loss_fn"):
        profile(_layers(), x, mode="analytic", example_target=y)
