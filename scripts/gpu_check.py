"""GPU checks for a lent CUDA machine: the runtime's parity with a single process, on CUDA.

1. One process, the pipeline's chunks on ``cuda``: losses, gradients and parameters after three
   SGD(momentum) steps equal the CPU reference (tests/engine/test_runtime.py's model and
   tolerances: fp32, rtol 1e-5).
2. Two ranks over NCCL (``batch_isend_irecv``, the held transfers of ``engine.comm.P2P``), every
   schedule. It needs two GPUs: NCCL refuses two ranks on one ("Duplicate GPU detected", seen on
   a one-GPU H200), which the report records as ``two_rank_error``, not as a pass.

Prints one line per case and a JSON summary (``--json PATH``); exits 1 if a case ran and
disagreed. Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=.:tests:tests/engine python3 scripts/gpu_check.py --json /tmp/gpu_check.json

With ``--backend gloo --device cpu`` the same checks run on a CPU machine (how the script itself
is tested).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests", ROOT / "tests" / "engine"):
    sys.path.insert(0, str(p))

__all__ = ["main"]

TWO_RANK_CASES = [dict(schedule=s, p=2, m=4) for s in ("gpipe", "1f1b", "zb-h1", "zb-h2")] + [
    dict(schedule="interleaved-1f1b", p=2, v=2, m=4), dict(schedule="zbv", p=2, v=2, m=4),
    dict(schedule="1f1b", p=2, m=4, ckpt=True),
    dict(schedule="interleaved-1f1b", p=2, v=2, m=4, lookahead=0)]


ONE_PROCESS_CASES = [dict(schedule="1f1b", p=1, m=4), dict(schedule="zb-h1", p=1, m=2)]


def _worker_on_cpu(cases: list[dict]) -> list[dict]:
    """test_runtime's worker, its tensors brought back to the CPU (the reference lives there)."""
    import torch

    import test_runtime as tr

    def cpu(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().cpu()
        if isinstance(x, dict):
            return {k: cpu(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(cpu(v) for v in x)
        return x

    return cpu(tr._worker(cases))


def _check(name: str, case: Any, per_rank: list[dict]) -> dict:
    import test_runtime as tr
    try:
        tr._check(case, per_rank)
        return {"case": name, "ok": True}
    except AssertionError as exc:
        return {"case": name, "ok": False, "error": str(exc)[:2000]}


def main(argv: list[str] | None = None) -> int:
    """Run the checks; 0 if every case that ran agreed with the reference."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from engine.launch import launch

    report: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                              "gpus": torch.cuda.device_count(), "results": []}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name(0)
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    t0 = time.time()
    cases = [dict(c, device=args.device) for c in ONE_PROCESS_CASES]
    for case, res in zip(cases, _worker_on_cpu(cases)):
        r = _check(f"one process {case}", case, [res])
        report["results"].append(r)
        print(r, flush=True)
    try:
        per_rank = launch(_worker_on_cpu, 2, TWO_RANK_CASES, backend=args.backend, timeout_s=240,
                          pg_timeout_s=120)
        for k, case in enumerate(TWO_RANK_CASES):
            r = _check(f"{args.backend} 2 ranks {case}", case, [pr[k] for pr in per_rank])
            report["results"].append(r)
            print(r, flush=True)
    except Exception as exc:  # noqa: BLE001 - reported: e.g. NCCL refusing two ranks on one GPU
        report["two_rank_error"] = f"{type(exc).__name__}: {exc}"[:4000]
        report["two_rank_traceback"] = traceback.format_exc()[-4000:]
        print("two-rank run did not complete:", report["two_rank_error"], flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    report["all_ran_agree"] = all(r["ok"] for r in report["results"])
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if report["all_ran_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
