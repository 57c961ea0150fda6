"""engine.executor's per-step pieces that need no processes: the non-finite flag of a forward
output (one sum per tensor, in the tensor's own precision)."""
from __future__ import annotations

import pytest
import torch

from engine.executor import _any_nonfinite, nonfinite_flag


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_flag_is_nonfinite_exactly_when_an_output_holds_a_nan_or_inf(dtype):
    x = torch.randn(4, 8).to(dtype)
    assert torch.isfinite(nonfinite_flag(x))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 3] = bad
        assert not torch.isfinite(nonfinite_flag(y))
        assert not torch.isfinite(nonfinite_flag((x, y)))   # any tensor of a tuple output


def test_16_bit_outputs_are_summed_in_float32_so_a_large_finite_sum_is_no_alarm():
    x = torch.full((64, 64), 60000.0, dtype=torch.float16)   # sums far past fp16's 65504
    flag = nonfinite_flag(x)
    assert flag.dtype == torch.float32 and torch.isfinite(flag)
    assert nonfinite_flag(torch.ones(3)).dtype == torch.float32        # no float64 copy
    assert nonfinite_flag(torch.ones(3, dtype=torch.float64)).dtype == torch.float64


def test_non_float_outputs_have_no_flag():
    assert nonfinite_flag(torch.arange(4)) is None
    assert nonfinite_flag((torch.arange(4), "mask")) is None


def test_a_steps_flags_are_folded_once_whatever_their_dtypes():
    ok = [torch.tensor(1.0), torch.tensor(2.0, dtype=torch.float64)]
    assert _any_nonfinite(ok).item() == 0.0 and _any_nonfinite(ok).dtype == torch.float64
    assert _any_nonfinite(ok + [torch.tensor(float("nan"))]).item() == 1.0
