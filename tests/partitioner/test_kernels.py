"""The per-op-class device model (partitioner.kernels) and its use by the analytic profile."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import get_device_spec, profile
from partitioner.kernels import KERNEL_PRESETS, OpCharger, attention_time, gemm_time, memory_time
from partitioner.profile import forward_op_times

A100 = KERNEL_PRESETS["a100"]
PEAK, BW = 312e12, 2.039e12


def _rate(m: int, n: int, k: int, model=A100) -> float:
    return 2.0 * m * n * k / gemm_time(model, PEAK, BW, 2, m, n, k)


def test_gemm_efficiency_rises_with_size_and_small_gemms_run_far_below_peak():
    rates = [_rate(s, s, s) for s in (64, 256, 1024, 4096, 16384)]
    assert rates == sorted(rates)
    assert rates[0] < 0.02 * PEAK and rates[-1] > 0.8 * PEAK and rates[-1] <= A100.gemm_efficiency * PEAK


def test_wave_quantisation_one_more_tile_costs_a_wave():
    # 108 tiles of 256x128 fill one wave of the A100's 108 SMs; one row more needs a second wave
    k = dataclasses.replace(A100, launch_s=0.0)
    full = gemm_time(k, PEAK, BW, 2, 256 * 12, 128 * 9, 4096)
    over = gemm_time(k, PEAK, BW, 2, 256 * 12 + 1, 128 * 9, 4096)
    assert over > 1.3 * full


def test_gemm_short_k_is_slower_per_flop():
    assert _rate(4096, 4096, 64) < 0.5 * _rate(4096, 4096, 4096)


def test_attention_throughput_grows_with_sequence_and_head_dim_and_backward_is_slower():
    def tput(s, d=128, causal=False, backward=False):
        fl = 4.0 * 8 * 16 * s * s * d
        return fl / attention_time(A100, PEAK, fl, s, d, causal, backward)

    seqs = [tput(s) for s in (128, 512, 2048, 8192)]
    assert seqs == sorted(seqs) and seqs[-1] <= A100.attn_fwd * PEAK
    assert tput(4096, 64) < tput(4096, 128)
    assert tput(4096, backward=True) < tput(4096)
    assert tput(4096, causal=True) > tput(4096)  # FLOPs booked whole, half of them skipped


def test_memory_bound_time_is_bytes_at_achieved_bandwidth_plus_launch():
    assert memory_time(A100, BW, 0) == A100.launch_s
    t = memory_time(A100, BW, 1e9) - A100.launch_s
    assert t == pytest.approx(1e9 / (BW * A100.bandwidth))


def _classes(make, x, spec="h100-kernels", **kw):
    p = profile([make], x, mode="analytic", device_spec=get_device_spec(spec, **kw), dtype=torch.bfloat16)
    return p, p.meta["layer_op_classes"][0]


def test_analytic_profile_classifies_gemm_attention_and_memory_ops():
    _, lin = _classes(lambda: nn.Linear(512, 512), torch.randn(8, 512))
    assert lin["forward"]["gemm"] > 0 and lin["forward"]["attention"] == 0

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            q = self.lin(x)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    _, at = _classes(Attn, torch.randn(2, 4, 256, 64))
    assert at["forward"]["attention"] > 0 and at["backward"]["attention"] > at["forward"]["attention"]
    _, ln = _classes(lambda: nn.LayerNorm(512), torch.randn(8, 512))
    assert ln["forward"]["memory"] > 0 and ln["forward"]["gemm"] == 0


def test_fusion_merges_pointwise_chains():
    class Chain(nn.Module):
        def forward(self, x):
            return torch.tanh(F.gelu(x) * 2.0 + 1.0)

    x = torch.randn(64, 4096)
    eager, _ = _classes(Chain, x)
    fused, _ = _classes(Chain, x, fuse=True)
    assert fused.layers[0].forward_s < 0.6 * eager.layers[0].forward_s


def test_flat_presets_keep_the_former_roofline():
    spec = get_device_spec("h100-flat")
    assert spec.kernels is None and spec.efficiency == 0.7 and spec.overhead_s == 5e-6
    p = profile([lambda: nn.Linear(1024, 1024, bias=False)], torch.randn(4096, 1024), mode="analytic",
                device_spec=spec, dtype=torch.bfloat16)
    flops, moved = 2 * 4096 * 1024 * 1024, 2 * (4096 * 1024 * 2 + 1024 * 1024)
    assert p.layers[0].forward_s == pytest.approx(spec.op_time(flops, moved, "bfloat16"))
    assert p.meta["device_model"] == "flat-roofline"
    with pytest.raises(ValueError, match="kernel model"):
        get_device_spec("h100-flat", fuse=True)


def test_kernel_model_rejects_fractions_outside_unit_interval():
    with pytest.raises(ValueError, match="fraction"):
        dataclasses.replace(A100, gemm_efficiency=1.3)


def test_charger_sums_by_class():
    c = OpCharger(A100, PEAK, BW)
    c.charge_memory(1e6)
    assert c.by_class["memory"] > 0 and c.kernels == 1


def test_kernel_model_profiles_price_the_optimizer_step_at_achieved_bandwidth():
    from partitioner import partition
    from partitioner.kernels import OPTIMIZER_STATE_TRAFFIC

    layers = [lambda: nn.Linear(1024, 1024)] * 4
    x = torch.randn(64, 1024)
    prof = profile(layers, x, mode="analytic", device_spec="a100-kernels", dtype=torch.bfloat16)
    spec = get_device_spec("a100-kernels")
    per_param = (OPTIMIZER_STATE_TRAFFIC["adamw"] + 2) / (spec.memory_bandwidth * spec.kernels.bandwidth)
    assert prof.fixed.optimizer_s("adamw", 2.0) == pytest.approx(per_param)
    plan = partition(prof, num_stages=2, microbatches=4, optimizer="adamw")
    assert plan.rank_optimizer_s[0] == pytest.approx(per_param * (1024 * 1024 + 1024) * 2)
    flat = profile(layers, x, mode="analytic", device_spec="a100-flat", dtype=torch.bfloat16)
    assert flat.fixed is None   # the former model stays as it was


def test_dropout_is_charged_as_the_gpu_runs_it_one_fused_kernel():
    spec = get_device_spec("a100-kernels")
    ops = forward_op_times(lambda: nn.Dropout(0.1), torch.randn(64, 1024), device_spec=spec, dtype=torch.float16)
    n = 64 * 1024   # fp16 in, fp16 out and a one-byte mask
    assert [name for name, _ in ops] == ["native_dropout"]
    assert ops[0][1] == pytest.approx(memory_time(spec.kernels, spec.memory_bandwidth, n * (2 + 2 + 1)))


def test_dropout_on_the_measured_cpu_keeps_the_cpus_own_kernels():
    ops = forward_op_times(lambda: nn.Dropout(0.1), torch.randn(64, 1024), device_spec="cpu")
    assert "native_dropout" not in [name for name, _ in ops] and "bernoulli_" in [name for name, _ in ops]


def test_allocations_launch_no_kernel_and_move_no_bytes():
    class Alloc(nn.Module):
        def forward(self, x):
            return torch.empty_like(x).new_empty(x.shape)

    assert forward_op_times(Alloc, torch.randn(8, 8), device_spec="a100-kernels") == []


class _Attn(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1)


def test_unfused_attention_is_megatrons_core_attention_op_for_op():
    b, h, s, d = 2, 4, 128, 32
    spec = get_device_spec("a100-kernels")
    ops = forward_op_times(_Attn, torch.randn(b, h, s, d), device_spec=spec, dtype=torch.float16, attention="unfused")
    assert [name for name, _ in ops] == ["baddbmm", "_softmax", "native_dropout", "bmm"]
    scores = b * h * s * s   # fp16: softmax reads and writes them; dropout also writes a one-byte mask
    assert ops[1][1] == pytest.approx(memory_time(spec.kernels, spec.memory_bandwidth, scores * 4))
    assert ops[2][1] == pytest.approx(memory_time(spec.kernels, spec.memory_bandwidth, scores * 5))
    assert ops[0][1] == pytest.approx(gemm_time(spec.kernels, 312e12, spec.memory_bandwidth, 2, s, s, d, b * h))


def test_unfused_attention_saves_the_probabilities_the_mask_and_the_dropped_probabilities():
    b, h, s, d = 2, 4, 128, 32
    x = torch.randn(b, h, s, d)

    class Projected(_Attn):   # a parameter, so that the attention's inputs take a gradient
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(d, d)

        def forward(self, q):
            return super().forward(self.lin(q))

    def saved(attention):
        return profile([Projected], x, mode="analytic", device_spec="a100-kernels", dtype=torch.float16,
                       attention=attention).layers[0].activation_bytes

    # unfused keeps 5 bytes a score (fp16 probabilities, bool mask, fp16 dropped probabilities);
    # flash keeps instead its output (fp16) and log-sum-exp (fp32) per query, and its rng seed
    extra = saved("unfused") - saved("flash")
    scores = b * h * s * s
    assert extra == pytest.approx(scores * 5 - b * h * s * d * 2 - b * h * s * 4, abs=64)
