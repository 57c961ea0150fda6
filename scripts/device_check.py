"""Check the analytic device model against published measured training figures (issue 39, B).

Two held-out checks (no constant of partitioner/kernels.py was fitted to them):

1. torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (also docs/performance.md), Table 1:
   Llama 3.1 8B, 8 H100, FSDP, local batch 2 x 8192 tokens, selective activation checkpointing:
   5,762 tokens/s/GPU, i.e. a measured step of 2 x 8192 / 5762 = 2.843 s per GPU. We predict the
   compute of one GPU's step: forward + backward of the 2 sequences (analytic profile of a
   Llama-3.1-8B-shaped HF model on the meta device, bf16), plus selective recomputation (torchtitan's
   op-level SAC recomputes every second matmul and the memory-bound ops of the forward), plus
   AdamW over the GPU's 1/8 shard (fp32 master, grads and two moments: 28 bytes per parameter at
   achieved bandwidth). FSDP's collectives are taken as overlapped (not charged).
2. Zero Bubble (Qi et al., arXiv 2401.10241), A100 SXM 80GB, GPT-3-like models, 1F1B and ZB-1p
   throughput (samples per GPU per second) for 1.5B / 6.2B / 14.6B / 28.3B on 8 / 8 / 16 / 32
   stages. We plan the same model, stages, microbatch size and count with the analytic profile
   on "a100" (bf16) and the project's planner (1f1b; zb-h1 for ZB-1p), and compare.

Each row runs twice: "flat" (the former model: device_spec a100-flat / h100-flat) and "kernels" (a100-kernels / h100-kernels)
(the per-op-class model). Run::

    PYTHONPATH=. python scripts/device_check.py            # every row (a few minutes on 2 cores)
    PYTHONPATH=. python scripts/device_check.py --quick    # one ZB row and the Llama row
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

__all__ = ["ZB_MODELS", "ZB_PUBLISHED", "TORCHTITAN", "llama_row", "zb_row", "main"]

# Zero Bubble, arXiv 2401.10241: model configs (layers, heads, hidden; seq 1024) with pipeline
# stages and microbatch size; throughput in samples per GPU per second for (1F1B, ZB-1p) at each
# microbatch count. Transcribed from the paper's Tables 1 and 4 (v1); the retrieval tools of this
# session could not fetch the table text again, so check the figures against the paper before
# quoting them.
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
ZB_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 128, as Megatron-LM does (an assumption)
TORCHTITAN = {"tokens_per_s_per_gpu": 5762.0, "compiled_tokens_per_s_per_gpu": 6667.0, "batch": 2, "seq": 8192}


def _cfg(*overrides: str) -> Any:
    from experiments.config import compose_config

    return compose_config(*overrides)


def llama_row(device: str = "h100-kernels", *, layers: int = 32, seq: int = 8192, fuse: bool = False) -> dict[str, float]:
    """Predicted compute of one GPU's torchtitan Llama 3.1 8B step (see the module docstring).
    ``fuse``: pointwise chains fused as under torch.compile (Table 1's second row)."""
    from experiments.models import build_model
    from experiments.wiring import profile_kwargs, profile_model
    from partitioner import get_device_spec

    cfg = _cfg("model=hf_llama", f"model.layers={layers}", "model.dim=4096", "model.heads=32", "model.kv_heads=8",
               "model.intermediate=14336", "model.vocab=128256", f"model.seq_len={seq}", "model.tie_embeddings=false",
               "precision=bf16", "partitioner.profile=analytic", f"partitioner.device_spec={device}",
               "pipeline.stages=1", "pipeline.microbatches=1", f"train.batch_size={TORCHTITAN['batch']}")
    spec = build_model(cfg.model)
    if fuse:
        import partitioner

        kw = dict(profile_kwargs(cfg), device_spec=get_device_spec(device, fuse=True))
        prof = partitioner.profile(spec.layers, spec.example_input(TORCHTITAN["batch"]), **kw)
    else:
        prof = profile_model(cfg, spec, microbatch=TORCHTITAN["batch"])
    fwd = sum(c.forward_s for c in prof.layers)
    bwd = sum(c.backward_s for c in prof.layers)
    recompute = _selective_recompute(prof)
    params = sum(c.param_bytes for c in prof.layers) / 2  # bf16 parameters
    dev = get_device_spec(device)
    bw = dev.memory_bandwidth * (dev.kernels.bandwidth if dev.kernels else dev.efficiency)
    opt = params / 8 * 28 / bw
    step = fwd + bwd + recompute + opt
    measured = TORCHTITAN["batch"] * TORCHTITAN["seq"] / TORCHTITAN["tokens_per_s_per_gpu"] * (seq / 8192) * (layers / 32)
    return {"forward_s": fwd, "backward_s": bwd, "recompute_s": recompute, "optimizer_s": opt, "step_s": step,
            "measured_s": measured, "error": step / measured - 1, "params": params}


def _selective_recompute(prof: Any) -> float:
    """torchtitan's op-level SAC: half the forward GEMMs and every memory-bound forward op again
    (kernel model: from the per-class split; flat model: the forward minus its GEMM+attention
    FLOPs' share is unknown, so half the forward)."""
    classes = prof.meta.get("layer_op_classes")
    if not classes:
        return 0.5 * sum(c.forward_s for c in prof.layers[1:-1])
    inner = classes[1:-1]  # the blocks; the embedding and the head are not checkpointed
    return sum(0.5 * c["forward"]["gemm"] + c["forward"]["memory"] for c in inner)


def zb_row(size: str, m: int, device: str = "a100-kernels") -> dict[str, float]:
    """Predicted throughput (samples / GPU / s) of a Zero Bubble table row under 1F1B and zb-h1."""
    from experiments.models import build_model
    from experiments.wiring import make_plan, profile_model

    layers, heads, dim, p, mb = ZB_MODELS[size]
    out: dict[str, float] = {}
    base = ("model=gpt", f"model.layers={layers}", f"model.dim={dim}", f"model.heads={heads}",
            f"model.vocab={ZB_VOCAB}", "model.seq_len=1024", "precision=bf16", "partitioner.profile=analytic",
            f"partitioner.device_spec={device}", f"pipeline.stages={p}", f"pipeline.microbatches={m}",
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


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description="device model vs published measured figures")
    ap.add_argument("--quick", action="store_true", help="one ZB row and a 2-layer, 2048-token Llama")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    kw = {"layers": 2, "seq": 2048} if args.quick else {}
    for dev, fuse in (("h100-flat", False), ("h100-kernels", False), ("h100-kernels", True)):
        r = llama_row(dev, fuse=fuse, **kw)
        if fuse:
            r["measured_s"] *= TORCHTITAN["tokens_per_s_per_gpu"] / TORCHTITAN["compiled_tokens_per_s_per_gpu"]
            r["error"] = r["step_s"] / r["measured_s"] - 1
        print(f"torchtitan Llama 3.1 8B, {dev}{' fused (vs FSDP + torch.compile)' if fuse else ''}: fwd {r['forward_s']:.3f} s, bwd {r['backward_s']:.3f} s, "
              f"recompute {r['recompute_s']:.3f} s, AdamW shard {r['optimizer_s'] * 1e3:.1f} ms -> step "
              f"{r['step_s']:.3f} s vs measured {r['measured_s']:.3f} s ({r['error']:+.1%})")
    keys = [("1.5B", 24)] if args.quick else list(ZB_PUBLISHED)
    rows = []
    for size, m in keys:
        rows.append({"size": size, "m": m, "published": ZB_PUBLISHED[(size, m)],
                     "flat": zb_row(size, m, "a100-flat"), "kernels": zb_row(size, m, "a100-kernels")})
        print(_fmt_zb(rows[-1:]).split("\n", 2)[2], f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(_fmt_zb(rows))
    print(f"mean |error|: flat {_mean_abs(rows, 'flat'):.1%}, kernels {_mean_abs(rows, 'kernels'):.1%} "
          f"over {2 * len(rows)} rows ({time.perf_counter() - t0:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
