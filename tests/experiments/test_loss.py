"""The chunked linear + cross-entropy head (`model.loss=chunked`): the same loss and gradients
as the full head, for GPT and every Hugging Face family, without the [b, s, V] fp32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.memtrack import measure_step
from experiments.config import GPTConfig
from experiments.models import build_model, compose
from experiments.models.hf import ARCHS
from experiments.models.loss import (IGNORE_INDEX, HeadOutput, chunked_lm_loss, lm_loss, loss_function,
                                     loss_settings)


def _leaves(dtype: torch.dtype, bias: bool, tokens: tuple[int, int] = (3, 7), dim: int = 16, vocab: int = 50):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(*tokens, dim, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, dim, generator=g) * 0.3).to(dtype).requires_grad_(True)
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_(True) if bias else None
    t = torch.randint(0, vocab, tokens, generator=g)
    return h, w, b, t


def _loss_and_grads(fn, h, w, b, t):
    leaves = [x for x in (h, w, b) if x is not None]
    loss = fn(h, w, b, t)
    return loss.detach(), torch.autograd.grad(loss, leaves)


def _full(h, w, b, t):
    return lm_loss(F.linear(h, w, b), t)


@pytest.mark.parametrize("chunk", [1, 4, 21, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_matches_full_fp32(chunk: int, bias: bool) -> None:
    h, w, b, t = _leaves(torch.float32, bias)
    t[0, 2] = IGNORE_INDEX   # an ignored position counts in neither loss nor mean
    ref_loss, ref_grads = _loss_and_grads(_full, h, w, b, t)
    loss, grads = _loss_and_grads(lambda *a: chunked_lm_loss(HeadOutput(*a[:3]), a[3], chunk), h, w, b, t)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_chunked_bf16_as_close_to_fp32_as_the_full_head() -> None:
    """In bf16 both heads round; the chunked one is no further from the fp32 truth than the
    full one (up to a small factor), and the loss agrees to bf16's precision."""
    h32, w32, b32, t = _leaves(torch.float32, True, tokens=(4, 32), dim=64, vocab=300)
    true_loss, true_grads = _loss_and_grads(_full, h32, w32, b32, t)
    h, w, b = (x.detach().bfloat16().requires_grad_(True) for x in (h32, w32, b32))
    full_loss, full_grads = _loss_and_grads(_full, h, w, b, t)
    loss, grads = _loss_and_grads(lambda *a: chunked_lm_loss(HeadOutput(*a[:3]), a[3], 24), h, w, b, t)
    assert abs(loss.item() - true_loss.item()) < 2e-2 * abs(true_loss.item())
    for got, full, true in zip(grads, full_grads, true_grads):
        err, err_full = (got.float() - true).norm() / true.norm(), (full.float() - true).norm() / true.norm()
        assert err < max(3 * err_full, 2e-2), (err, err_full)


def test_chunked_under_autocast_matches_full_autocast() -> None:
    h, w, b, t = _leaves(torch.float32, False, tokens=(2, 16), dim=32, vocab=128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _loss_and_grads(_full, h, w, b, t)
        loss, grads = _loss_and_grads(lambda *a: chunked_lm_loss(HeadOutput(*a[:3]), a[3], 8), h, w, b, t)
    assert grads[1].dtype == torch.float32   # the fp32 master weight gets an fp32 gradient
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for got, want in zip(grads, ref_grads):
        assert (got - want).norm() / want.norm() < 2e-2


def test_loss_function_and_settings_refuse_bad_values() -> None:
    assert loss_function("full") is lm_loss
    assert loss_settings(GPTConfig()) == ("full", 1024)
    with pytest.raises(ValueError, match="model.loss="):
        loss_function("fused")
    with pytest.raises(ValueError, match="loss_chunk"):
        loss_function("chunked", 0)


_SMALL = dict(layers=2, dim=32, heads=4, vocab=97, seq_len=12)
_MODELS = [dict(name="gpt", **_SMALL), dict(name="gpt", tie_embeddings=True, **_SMALL)] + [
    dict(name="hf", arch=a, tie_embeddings=tie, **_SMALL) for a in ARCHS for tie in (False, True)]


def _tie(model: nn.Sequential, spec) -> None:
    """Share the tied parameters as the engine does on one rank (compose leaves them apart)."""
    for src, dst in spec.ties:
        i, name = src.split(".", 1)
        j, dname = dst.split(".", 1)
        owner, attr = model[int(j)].get_submodule(dname.rsplit(".", 1)[0]), dname.rsplit(".", 1)[1]
        setattr(owner, attr, model[int(i)].get_parameter(name))


def _model_grads(cfg: dict, loss: str):
    spec = build_model(dict(cfg, loss=loss, loss_chunk=7))
    model = compose(spec.layers, seed=0)
    _tie(model, spec)
    x, y = spec.example_input(2), spec.example_target(2)
    value = spec.loss_fn(model(x), y)
    value.backward()
    return spec, model, value.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg", _MODELS, ids=lambda c: f"{c.get('arch', 'gpt')}-tie{int(bool(c.get('tie_embeddings')))}")
def test_every_lm_same_loss_and_gradients_with_the_chunked_head(cfg: dict) -> None:
    _, _, ref, ref_grads = _model_grads(cfg, "full")
    spec, model, got, grads = _model_grads(cfg, "chunked")
    assert spec.extra["loss"] == "chunked"
    out = model(spec.example_input(2))
    assert isinstance(out, HeadOutput) and out.hidden.shape[-1] == 32
    assert model[-1].logits(out.hidden.new_zeros(1, 1, 32)).shape == (1, 1, 97)  # generation's path
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def _peak_beyond_inputs(fn, module: nn.Module, inputs: list[torch.Tensor]) -> int:
    """MemTracker's peak over ``fn`` less the bytes alive before it (parameters, inputs)."""
    before = sum(p.numel() * p.element_size() for p in module.parameters())
    before += sum(t.numel() * t.element_size() for t in inputs)
    _, report = measure_step(fn, modules=[module])
    return report.peak_bytes - before


def test_chunked_loss_peak_stays_far_below_one_fp32_logits_tensor() -> None:
    tokens, dim, vocab, chunk = (4, 512), 64, 4096, 128
    logits_fp32 = tokens[0] * tokens[1] * vocab * 4           # 32 MiB
    head = nn.Linear(dim, vocab, bias=False)
    h = torch.randn(*tokens, dim, requires_grad=True)
    t = torch.randint(0, vocab, tokens)

    def chunked() -> None:
        chunked_lm_loss(HeadOutput(h, head.weight, None), t, chunk).backward()

    def full() -> None:
        lm_loss(head(h), t).backward()

    extra = _peak_beyond_inputs(chunked, head, [h, t])
    # the gradients of the hidden states and the weight, the log-sum-exp, and a few chunks' logits
    grads = h.numel() * 4 + head.weight.numel() * 4 + tokens[0] * tokens[1] * 4
    assert extra < grads + 4 * chunk * vocab * 4, extra
    assert extra < logits_fp32 / 4, extra
    h.grad, head.weight.grad = None, None
    assert _peak_beyond_inputs(full, head, [h, t]) > 2 * logits_fp32   # the full head: the contrast


# --------------------------------------------------------------------------- pipelined parity
_PIPE_CFG = dict(name="gpt", layers=3, dim=32, heads=2, vocab=256, seq_len=16, tie_embeddings=True)
_STEPS, _BATCH, _LR, _MOMENTUM = 3, 4, 0.05, 0.9


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return (torch.randint(0, 256, (_BATCH, 16), generator=g), torch.randint(0, 256, (_BATCH, 16), generator=g))


def _pipeline_worker(cases: list[dict]) -> list[dict]:
    """Each case: the chunked-loss GPT (tied embeddings, so the tie crosses the two ranks)
    trained `_STEPS` SGD-momentum steps with the pipeline."""
    from engine import OptimizerConfig, Pipeline

    torch.set_num_threads(1)
    spec = build_model(dict(_PIPE_CFG, loss="chunked", loss_chunk=24))
    out = []
    for case in cases:
        pipe = Pipeline(spec.layers, [(0, 2), (2, 5)], loss_fn=spec.loss_fn, schedule=case["schedule"],
                        microbatches=2, seed=5, ties=spec.ties, comm_timeout_s=30,
                        activation_checkpointing=case.get("ckpt", False),
                        optimizer=OptimizerConfig(name="sgd", lr=_LR, momentum=_MOMENTUM,
                                                  backend=case.get("backend", "auto")))
        losses, grads = [], []
        for step in range(_STEPS):
            losses.append(pipe.train_step(*_tokens(step)).loss)
            grads.append(pipe.optimizer.full_grads())
        out.append({"losses": losses, "grads": grads})
    return out


def test_two_stage_pipeline_with_the_chunked_head_equals_one_process_with_the_full_head() -> None:
    """Losses and gradients (the tied embedding's included) of 3 steps on 2 ranks, chunked
    loss, equal one process training the same model with the full head (fp32, the runtime's
    parity tolerances)."""
    from dist_helpers import run_workers
    from engine.optim import OptimizerConfig
    from problems import reference

    full = build_model(dict(_PIPE_CFG, loss="full"))
    ref = reference(full.layers, _tokens, OptimizerConfig(name="sgd", lr=_LR, momentum=_MOMENTUM), _STEPS,
                    seed=5, loss_fn=full.loss_fn, ties=full.ties)
    # DeepSpeed's backward takes no gradient edges: zb-h1 then splits I/W per layer, where the
    # fused head's output is no boundary value and forms one segment with the loss
    cases = [dict(schedule="1f1b"), dict(schedule="zb-h1"), dict(schedule="1f1b", ckpt=True),
             dict(schedule="zb-h1", backend="deepspeed")]
    results = run_workers(_pipeline_worker, 2, cases, timeout_s=240)
    alias = dict((b, a) for a, b in full.ties)
    for k, case in enumerate(cases):
        for rank in results:
            res = rank[k]
            assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), case
            for step, g in enumerate(res["grads"]):
                for name, t in g.items():
                    torch.testing.assert_close(t, ref["grads"][step][alias.get(name, name)], rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{case} step {step} {name}: {m}")
    assert any("0.tok.weight" in g for rank in results for g in rank[0]["grads"])


def test_generation_gets_logits_from_a_chunked_head() -> None:
    """The cached chunk generation runs calls the head's `logits`: the same next-token logits
    from a model built with the chunked loss as with the full one."""
    from experiments.models.hf_cache import HFCachedChunk

    cfg = dict(name="hf", arch="llama", **_SMALL)
    outs = []
    for loss in ("full", "chunked"):
        spec = build_model(dict(cfg, loss=loss))
        chunk = HFCachedChunk(list(compose(spec.layers, seed=0)))
        ids = spec.example_input(2)[:, :6]
        outs.append(chunk(ids, chunk.new_cache(2), torch.ones_like(ids)))
    assert outs[0].shape == (2, 1, 97)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
