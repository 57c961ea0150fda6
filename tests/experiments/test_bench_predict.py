"""The bench's calibration of the profile, on plain numbers: one factor on every layer time
from the single-process step, and the split backward's own factor from its split step."""
from __future__ import annotations

import pytest

from experiments.bench.predict import calibrate
from partitioner import LayerCost, Profile


def _profile() -> Profile:
    # layer 0 has no input gradient (its split is its whole backward); layers 1-2 were split
    return Profile([LayerCost(1.0, 2.0, 0, 0, 0),
                    LayerCost(1.0, 2.0, 0, 0, 0, weight_grad_s=1.5, input_grad_s=1.0),
                    LayerCost(2.0, 4.0, 0, 0, 0, weight_grad_s=2.0, input_grad_s=3.0)])


def test_one_factor_makes_m_microbatches_of_forward_and_backward_the_single_step() -> None:
    cal, k = calibrate(_profile(), single_step_s=72.0, microbatches=4)   # 4 x 12 = 48 raw
    assert k == pytest.approx(1.5)
    assert 4 * sum(c.forward_s + c.backward_s for c in cal.layers) == pytest.approx(72.0)
    assert cal.layers[2].input_grad_s == pytest.approx(4.5) and "split_calibration_factor" not in cal.meta


def test_the_split_step_prices_the_measured_split_on_its_own() -> None:
    # calibrated (k = 1.5): f 6, layer 0's b 3, split I + W 3.75 + 7.5 = 11.25 per microbatch;
    # a split step of 4 x 20 leaves 4 x 11 for the split: factor 11 / 11.25 on I and W
    cal, k = calibrate(_profile(), single_step_s=72.0, microbatches=4, split_step_s=80.0)
    assert k == pytest.approx(1.5)
    L = cal.layers
    assert 4 * sum(c.forward_s + (c.split_backward_s if c.input_grad_s is not None else c.backward_s)
                   for c in L) == pytest.approx(80.0)
    ks = 11.0 / 11.25
    assert L[1].input_grad_s == pytest.approx(1.5 * ks) and L[2].weight_grad_s == pytest.approx(3.0 * ks)
    assert cal.meta["split_calibration_factor"] == pytest.approx(1.5 * ks)
    # what the unsplit schedules use is the first factor's alone
    assert [c.forward_s for c in L] == pytest.approx([1.5, 1.5, 3.0])
    assert [c.backward_s for c in L] == pytest.approx([3.0, 3.0, 6.0])
    assert L[0].weight_grad_s is None and L[0].input_grad_s is None


def test_a_split_step_that_leaves_nothing_for_the_split_is_ignored() -> None:
    cal, _ = calibrate(_profile(), single_step_s=72.0, microbatches=4, split_step_s=30.0)
    assert "split_calibration_factor" not in cal.meta
    assert cal.layers[1].input_grad_s == pytest.approx(1.5)
