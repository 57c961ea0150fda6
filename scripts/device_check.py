"""Check the analytic device model against published measured training figures (issue 39, B).

Two held-out checks (no constant of partitioner/kernels.py was fitted to them). Each row is
planned as the published run executed it (its own settings below, read from the authors' code
at the commit they ran), and costed twice: "flat" (``a100-flat`` / ``h100-flat``: 70% of peak,
5 us per op) and "kernels" (``a100-kernels`` / ``h100-kernels``: the per-op-class model).

1. Zero Bubble (Qi et al., ICLR 2024 version of arXiv 2401.10241, "Zero Bubble Pipeline
   Parallelism"), 4 GPT-3-like models on A100 SXM 80GB, 8 / 8 / 16 / 32 stages:
   - Table 4: throughput (samples per GPU per second) of 1F1B and ZB-1p at three microbatch
     counts each (24 rows). ZB-1p is planned as zb-h1: Table 5 gives ZB-1p and ZB-H1 the same
     bubble rate in all 12 settings.
   - The pipeline transfers are charged on the a100 preset's links (``partitioner.transfers``):
     8 GPUs per node, as on the paper's cluster, so a boundary between two nodes goes through the
     preset's HDR 200 Gb/s NIC per GPU and the others over NVLink. The paper's nodes are
     "interconnected by a RoCE RDMA network" of unstated rate; nothing is fitted to these rows.
   - Table 6: the profiled per-stage T_F, T_B, T_W of each setting (a stage of the middle, which
     holds (layers + 2) / p blocks: "both the initial and final pipeline stages possess one fewer
     transformer layer", Section 5.1). This checks the kernels without the schedule.
   What the runs executed (sail-sg/zero-bubble-pipeline-parallelism, branch ``arxiv``, commit
   f68d387 "for arxiv paper", examples/pretrain_zero_bubble.sh and megatron/arguments.py): fp16
   (``--fp16`` unless FP32 is set), Megatron's legacy GPT (``--use-mcore-models`` not set) whose
   core attention without ``--use-flash-attn`` materialises the s x s scores (baddbmm, apex's
   fused scale-mask-softmax, dropout, bmm), attention and hidden dropout 0.1 (the argument
   defaults), learned absolute positions, LayerNorm, GeLU, tied embeddings (no
   ``--untie-embeddings-and-output-weights``), sequence 1024, no recomputation, no tensor or data
   parallelism, a GPTSentencePieceTokenizer. Its vocabulary is not printed anywhere; 32,000 (a
   SentencePiece Llama vocabulary, already a multiple of 128) is the one that reproduces all
   four parameter counts of Table 3 with tied embeddings and 2,048 positions (1.48, 6.18,
   14.65, 28.30 B), where GPT-2's padded 50,304 gives 6.26, 14.74 and 28.41 B (:func:`zb_params`).
2. torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Table 1: Llama 3.1 8B, 8 H100, FSDP,
   local batch 2 x 8192 tokens, selective activation checkpointing: 5,762 tokens/s/GPU (6,667
   with torch.compile), i.e. a measured step of 2 x 8192 / 5762 = 2.843 s per GPU. The run (the
   same file, "Hardware", footnote 2, and torchtitan 9dec370): H100 SXM with 96 GB HBM2e at 2.4
   TB/s and a 500 W power limit, its dense bf16 peak "between SXM and NVL" (989 and 835 TFLOP/s:
   both ends are run); op-level selective checkpointing (``_save_list`` in
   torchtitan/parallelisms/parallelize_llama.py: the outputs of every other ``mm`` and of the
   flash attention are kept, every other op of a block is recomputed in backward); FSDP2 with
   bf16 parameters and fp32 gradient reduction; AdamW with ``foreach`` kernels and
   ``clip_grad_norm_(foreach=True)`` (optimizer.fused defaults to false); the loss a
   cross-entropy of the logits upcast to fp32 (train.py). FSDP's collectives are taken as
   overlapped with compute (not charged); the memory-bound copies FSDP2 makes around them are.

Run::

    PYTHONPATH=. python scripts/device_check.py            # every row (a few minutes on 2 cores)
    PYTHONPATH=. python scripts/device_check.py --quick    # one ZB row and a reduced Llama row
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

__all__ = ["ZB_MODELS", "ZB_PUBLISHED", "ZB_PROFILED", "ZB_RUN", "TORCHTITAN", "TITAN_PEAKS", "llama_row", "zb_row",
           "zb_stage_row", "zb_params", "zb_floor", "ZB_BUBBLE", "sac_recompute", "main"]

# Zero Bubble, ICLR 2024 version: Table 3 (layers, heads, hidden; sequence 1024) with pipeline
# stages and microbatch size; Table 4: samples per GPU per second of (1F1B, ZB-1p) at each
# microbatch count; Table 6: profiled T_F, T_B, T_W in ms. Checked against the paper's text on
# 2026-12-06 (the same figures are in the authors' arxiv branch,
# megatron/core/pipeline_parallel/efficiency.py, iclr_bubble_rates).
ZB_MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "1.5B": (22, 24, 2304, 8, 6), "6.2B": (30, 32, 4096, 8, 3),
    "14.6B": (46, 40, 5120, 16, 1), "28.3B": (62, 48, 6144, 32, 1),
}
ZB_PUBLISHED: dict[tuple[str, int], tuple[float, float]] = {
    ("1.5B", 24): (11.8, 12.9), ("1.5B", 32): (12.5, 13.4), ("1.5B", 64): (13.6, 14.2),
    ("6.2B", 24): (3.50, 3.88), ("6.2B", 32): (3.70, 4.00), ("6.2B", 64): (4.03, 4.20),
    ("14.6B", 48): (1.40, 1.61), ("14.6B", 64): (1.49, 1.67), ("14.6B", 128): (1.64, 1.76),
    ("28.3B", 96): (0.76, 0.88), ("28.3B", 128): (0.80, 0.90), ("28.3B", 256): (0.88, 0.96),
}
ZB_PROFILED: dict[tuple[str, int], tuple[float, float, float]] = {
    ("1.5B", 24): (18.522, 18.086, 9.337), ("1.5B", 32): (18.513, 18.086, 9.331), ("1.5B", 64): (18.546, 18.097, 9.321),
    ("6.2B", 24): (29.718, 29.444, 19.927), ("6.2B", 32): (29.802, 29.428, 19.530), ("6.2B", 64): (29.935, 29.621, 19.388),
    ("14.6B", 48): (11.347, 11.248, 8.132), ("14.6B", 64): (11.307, 11.254, 8.101), ("14.6B", 128): (11.325, 11.308, 8.109),
    ("28.3B", 96): (10.419, 10.207, 7.715), ("28.3B", 128): (10.408, 10.204, 7.703), ("28.3B", 256): (10.402, 10.248, 7.698),
}
# Table 5: bubble rates of (1F1B, ZB-1p), the authors' schedule simulation with Table 6's times.
ZB_BUBBLE: dict[tuple[str, int], tuple[float, float]] = {
    ("1.5B", 24): (0.2431, 0.1585), ("1.5B", 32): (0.1985, 0.1242), ("1.5B", 64): (0.1240, 0.0674),
    ("6.2B", 24): (0.2347, 0.1323), ("6.2B", 32): (0.1898, 0.1045), ("6.2B", 64): (0.1091, 0.0554),
    ("14.6B", 48): (0.2552, 0.1397), ("14.6B", 64): (0.2082, 0.1088), ("14.6B", 128): (0.1251, 0.0576),
    ("28.3B", 96): (0.2646, 0.1421), ("28.3B", 128): (0.2168, 0.1106), ("28.3B", 256): (0.1352, 0.0594),
}
# What the Zero Bubble runs executed (module docstring: the arxiv branch's script and defaults).
ZB_RUN: dict[str, Any] = {"precision": "fp16", "attention": "unfused", "dropout": 0.1, "vocab": 32000,
                          "tie_embeddings": True, "positions": 2048}
ZB_GPT2_VOCAB = 50304  # what the earlier transcription assumed (GPT-2's 50,257 padded to 128)
TORCHTITAN = {"tokens_per_s_per_gpu": 5762.0, "compiled_tokens_per_s_per_gpu": 6667.0, "batch": 2, "seq": 8192}
# torchtitan's H100s (benchmark file, "Hardware" and footnote 2): HBM2e at 2.4 TB/s, 500 W; the
# dense bf16 peak between the H100 NVL's 835 and the SXM's 989 TFLOP/s (NVIDIA datasheets).
TITAN_BANDWIDTH = 2.4e12
TITAN_PEAKS: dict[str, float] = {"sxm": 989e12, "nvl": 835e12}
# Bytes per parameter the run's optimizer step moves (fp32 shard): torch's foreach AdamW
# (torch/optim/adam.py, _multi_tensor_adam with decoupled weight decay): mul_(p) 8, lerp_(m, g) 12,
# mul_(v) 8, addcmul_(v, g, g) 12, sqrt(v) 8, div_ 8, add_(eps) 8, addcdiv_(p, m, denom) 16 = 80;
# clip_grad_norm_(foreach=True) (torch/nn/utils/clip_grad.py): _foreach_norm 4 + _foreach_mul_ 8 = 12.
FOREACH_ADAMW_BYTES = 80.0
FOREACH_CLIP_BYTES = 12.0
# FSDP2's copies around its collectives, bytes per parameter of the whole model and step
# (torch.distributed._composable.fsdp._fsdp_collectives): each all-gather's copy-out
# (split_with_sizes_copy of the bf16 buffer into the parameters: read 2 + write 2), once in
# forward and once in backward (reshard_after_forward); the reduce-scatter's copy-in (the bf16
# gradients cast into the fp32 reduce buffer: read 2 + write 4).
FSDP2_COPY_BYTES = 2 * 4.0 + 6.0


def _cfg(*overrides: str) -> Any:
    from experiments.config import compose_config

    return compose_config(*overrides)


def zb_params(size: str, vocab: int = ZB_RUN["vocab"], positions: int = ZB_RUN["positions"]) -> float:
    """Parameters of a Zero Bubble model (Megatron GPT, tied embeddings): 12 h^2 + 13 h per block,
    the token and position tables, the final LayerNorm.

    >>> round(zb_params("28.3B") / 1e9, 2), round(zb_params("28.3B", vocab=50304) / 1e9, 2)
    (28.3, 28.41)
    """
    layers, _, h, _, _ = ZB_MODELS[size]
    return layers * (12 * h * h + 13 * h) + (vocab + positions) * h + 2 * h


def _zb_overrides(size: str, device: str, as_run: bool) -> tuple[str, ...]:
    layers, heads, dim, _, _ = ZB_MODELS[size]
    run = ZB_RUN if as_run else {"precision": "bf16", "attention": "flash", "dropout": 0.0, "vocab": ZB_GPT2_VOCAB,
                                 "tie_embeddings": False}
    return ("model=gpt", f"model.layers={layers}", f"model.dim={dim}", f"model.heads={heads}",
            f"model.vocab={run['vocab']}", "model.seq_len=1024", f"model.dropout={run['dropout']}",
            f"model.tie_embeddings={str(run['tie_embeddings']).lower()}", f"precision={run['precision']}",
            "partitioner.profile=analytic", f"partitioner.device_spec={device}",
            f"partitioner.attention={run['attention']}")


def zb_row(size: str, m: int, device: str = "a100-kernels", as_run: bool = True) -> dict[str, float]:
    """Predicted throughput (samples / GPU / s) of a Zero Bubble table row under 1F1B and zb-h1.
    ``as_run=False``: the earlier, generic workload (bf16, flash attention, no dropout, GPT-2's
    vocabulary, untied), for comparison."""
    from experiments.models import build_model
    from experiments.wiring import make_plan, profile_model

    _, _, _, p, mb = ZB_MODELS[size]
    out: dict[str, float] = {}
    base = (*_zb_overrides(size, device, as_run), f"pipeline.stages={p}", f"pipeline.microbatches={m}",
            f"train.batch_size={mb * m}")
    prof = None
    for sched, key in (("1f1b", "1f1b"), ("zb-h1", "zb1p")):
        cfg = _cfg(*base, f"pipeline.schedule={sched}")
        if prof is None:
            spec = build_model(cfg.model)
            prof = profile_model(cfg, spec, microbatch=mb)
        plan = make_plan(cfg, spec, prof)
        out[key] = mb * m / (plan.step_s * p)
    out["stage_forward_s"] = max(plan.stage_forward_s)
    return out


def zb_stage_row(size: str, device: str = "a100-kernels", as_run: bool = True) -> dict[str, float]:
    """Predicted T_F, T_B, T_W (ms) of a middle stage of a Zero Bubble setting (Table 6): its
    (layers + 2) / p blocks, each profiled with an input that takes a gradient (as inside a
    pipeline), B being the backward less its weight-gradient part W."""
    import torch

    import partitioner
    from experiments.models import build_model
    from experiments.wiring import profile_kwargs

    layers, _, dim, p, mb = ZB_MODELS[size]
    cfg = _cfg(*_zb_overrides(size, device, as_run))
    block = build_model(cfg.model).layers[1]
    prof = partitioner.profile([block, block], torch.randn(mb, 1024, dim), **profile_kwargs(cfg))
    c = prof.layers[1]
    k = (layers + 2) // p
    return {"F": 1e3 * k * c.forward_s, "B": 1e3 * k * (c.backward_s - c.weight_grad_s), "W": 1e3 * k * c.weight_grad_s}


def zb_floor(size: str, m: int) -> tuple[float, float]:
    """Throughput (1F1B, ZB-1p) that the paper's own figures give: Table 6's measured per-stage
    times through Table 5's bubble rates, ``m (T_F + T_B + T_W) / (1 - bubble)`` per step. What a
    model with exact stage times and an exact schedule would predict: the published throughput
    is below it by what the runtime spends outside the profiled stage times.

    >>> [round(v, 2) for v in zb_floor("1.5B", 24)]
    [12.36, 13.74]
    """
    _, _, _, p, mb = ZB_MODELS[size]
    ideal = m * sum(ZB_PROFILED[(size, m)]) * 1e-3
    return tuple(mb * m / (ideal / (1 - bub) * p) for bub in ZB_BUBBLE[(size, m)])


def _titan_spec(device: str, peak: str, fuse: bool = False) -> Any:
    """The run's H100 (module docstring): the preset's model at 2.4 TB/s and the given bf16 peak."""
    from partitioner import get_device_spec

    spec = get_device_spec(device, fuse=fuse if "kernels" in device else None)
    flops = {**spec.peak_flops, "bfloat16": TITAN_PEAKS[peak]}
    return replace(spec, name=f"{spec.name}-titan-{peak}", peak_flops=flops, memory_bandwidth=TITAN_BANDWIDTH)


def sac_recompute(ops: list[tuple[str, float]]) -> float:
    """Seconds that torchtitan's op-level selective checkpointing (9dec370,
    ``_apply_ac_to_transformer_block``) recomputes in a block's backward, from the block's forward
    ``ops`` (``partitioner.profile.forward_op_times``): every op but the odd-numbered ``mm`` and the
    fused attention, whose outputs it keeps.

    >>> sac_recompute([("mm", 1.0), ("mm", 2.0), ("_scaled_dot_product_flash_attention", 4.0), ("mul", 0.5)])
    2.5
    """
    saved = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention", "abs", "max"}
    mm, out = 0, 0.0
    for name, t in ops:
        if name == "mm":
            mm += 1
            if mm % 2 == 1:
                continue
        elif name in saved:
            continue
        out += t
    return out


def llama_row(device: str = "h100-kernels", *, peak: str = "sxm", layers: int = 32, seq: int = 8192,
              fuse: bool = False) -> dict[str, float]:
    """Predicted step of one GPU in torchtitan's Llama 3.1 8B run (module docstring). ``fuse``:
    pointwise chains fused as under torch.compile (Table 1's second row)."""
    import partitioner
    import torch
    from experiments.models import build_model
    from experiments.models.loss import profile_loss_kwargs
    from experiments.wiring import profile_kwargs
    from partitioner.profile import forward_op_times

    b = TORCHTITAN["batch"]
    dspec = _titan_spec(device, peak, fuse)
    cfg = _cfg("model=hf_llama", f"model.layers={layers}", "model.dim=4096", "model.heads=32", "model.kv_heads=8",
               "model.intermediate=14336", "model.vocab=128256", f"model.seq_len={seq}", "model.tie_embeddings=false",
               "precision=bf16", "partitioner.profile=analytic", f"partitioner.device_spec={device}",
               "pipeline.stages=1", "pipeline.microbatches=1", f"train.batch_size={b}")
    spec = build_model(cfg.model)
    kw = {**profile_kwargs(cfg), "device_spec": dspec, **profile_loss_kwargs(spec, b)}   # the loss with the head
    prof = partitioner.profile(spec.layers, spec.example_input(b), **kw)
    fwd = sum(c.forward_s for c in prof.layers)
    bwd = sum(c.backward_s for c in prof.layers)
    with torch.device("meta"):
        hidden = spec.layers[0]().to(torch.bfloat16)(spec.example_input(b).to("meta"))
    block_ops = forward_op_times(spec.layers[1], hidden, device_spec=dspec, dtype=torch.bfloat16)
    recompute = layers * sac_recompute(block_ops)
    params = sum(c.param_bytes for c in prof.layers) / 2  # bf16 parameters
    bw = dspec.memory_bandwidth * (dspec.kernels.bandwidth if dspec.kernels else dspec.efficiency)
    opt = params / 8 * (FOREACH_ADAMW_BYTES + FOREACH_CLIP_BYTES) / bw
    fsdp = params * FSDP2_COPY_BYTES / bw
    step = fwd + bwd + recompute + opt + fsdp
    tps = TORCHTITAN["compiled_tokens_per_s_per_gpu" if fuse else "tokens_per_s_per_gpu"]
    measured = b * TORCHTITAN["seq"] / tps * (seq / 8192) * (layers / 32)
    return {"forward_s": fwd, "backward_s": bwd, "recompute_s": recompute, "optimizer_s": opt, "fsdp_copies_s": fsdp,
            "step_s": step, "measured_s": measured, "error": step / measured - 1, "params": params}


def _fmt_zb(rows: list[dict]) -> str:
    lines = ["| model | m | sched | published | flat | err | kernels | err |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for i, s in enumerate(("1F1B", "ZB-1p")):
            key = ("1f1b", "zb1p")[i]
            pub = r["published"][i]
            lines.append(f"| {r['size']} | {r['m']} | {s} | {pub:.2f} | {r['flat'][key]:.2f} | "
                         f"{r['flat'][key] / pub - 1:+.1%} | {r['kernels'][key]:.2f} | {r['kernels'][key] / pub - 1:+.1%} |")
    return "\n".join(lines)


def _mean_abs(rows: list[dict], model: str) -> float:
    return statistics.fmean(abs(r[model][k] / r["published"][i] - 1) for r in rows
                            for i, k in enumerate(("1f1b", "zb1p")))


def _stages(sizes: list[str]) -> None:
    print("| model | T_F T_B T_W published (ms) | flat | kernels |\n|---|---|---|---|")
    for size in sizes:
        pub = [statistics.fmean(v[i] for (s, _), v in ZB_PROFILED.items() if s == size) for i in range(3)]
        cells = []
        for dev in ("a100-flat", "a100-kernels"):
            r = zb_stage_row(size, dev)
            cells.append(" ".join(f"{r[k]:.2f} ({r[k] / pub[i] - 1:+.0%})" for i, k in enumerate("FBW")))
        print(f"| {size} | {' '.join(f'{v:.2f}' for v in pub)} | {cells[0]} | {cells[1]} |", flush=True)


def _llama(kw: dict) -> None:
    for peak in TITAN_PEAKS:
        for dev, fuse in (("h100-flat", False), ("h100-kernels", False), ("h100-kernels", True)):
            r = llama_row(dev, peak=peak, fuse=fuse, **kw)
            print(f"torchtitan Llama 3.1 8B, {dev}, peak {peak}{' fused (vs FSDP + torch.compile)' if fuse else ''}: "
                  f"fwd {r['forward_s']:.3f} s, bwd {r['backward_s']:.3f} s, recompute {r['recompute_s']:.3f} s, "
                  f"AdamW+clip shard {r['optimizer_s'] * 1e3:.1f} ms, FSDP copies {r['fsdp_copies_s'] * 1e3:.1f} ms -> step "
                  f"{r['step_s']:.3f} s vs measured {r['measured_s']:.3f} s ({r['error']:+.1%})", flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description="device model vs published measured figures")
    ap.add_argument("--quick", action="store_true", help="one ZB row and a 2-layer, 2048-token Llama")
    ap.add_argument("--generic", action="store_true", help="also plan the ZB rows with the earlier generic workload")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    _llama({"layers": 2, "seq": 2048} if args.quick else {})
    keys = [("1.5B", 24)] if args.quick else list(ZB_PUBLISHED)
    _stages(sorted({s for s, _ in keys}, key=list(ZB_MODELS).index))
    rows = []
    for size, m in keys:
        rows.append({"size": size, "m": m, "published": ZB_PUBLISHED[(size, m)],
                     "flat": zb_row(size, m, "a100-flat"), "kernels": zb_row(size, m, "a100-kernels")})
        if args.generic:
            rows[-1]["generic"] = zb_row(size, m, "a100-kernels", as_run=False)
        print(_fmt_zb(rows[-1:]).split("\n", 2)[2], f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(_fmt_zb(rows))
    floor = [zb_floor(r["size"], r["m"])[i] / r["published"][i] - 1 for r in rows for i in range(2)]
    print(f"the paper's own stage times through its bubble rates: {min(floor):+.1%} to {max(floor):+.1%}, "
          f"mean {statistics.fmean(floor):+.1%} above the published throughput")
    print(f"mean |error|: flat {_mean_abs(rows, 'flat'):.1%}, kernels {_mean_abs(rows, 'kernels'):.1%} "
          f"over {2 * len(rows)} rows ({time.perf_counter() - t0:.0f} s)")
    if args.generic:
        print(f"kernels with the generic workload: {_mean_abs(rows, 'generic'):.1%}")
    return rows


if __name__ == "__main__":
    main()
