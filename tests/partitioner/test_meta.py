"""partitioner.meta: modules built on the meta device without their initialisers' work."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from partitioner.meta import meta_device


@pytest.mark.parametrize("make", [lambda: nn.Linear(8, 4), lambda: nn.Embedding(16, 8), lambda: nn.LayerNorm(8),
                                  lambda: nn.TransformerEncoderLayer(16, 2, 32), lambda: nn.Conv2d(3, 4, 3)])
def test_the_same_tensors_as_under_torch_device_meta(make):
    with torch.device("meta"):
        want = make()
    with meta_device():
        got = make()
    assert [(n, t.shape, t.dtype, t.is_meta) for n, t in got.state_dict().items()] == \
        [(n, t.shape, t.dtype, t.is_meta) for n, t in want.state_dict().items()]


def test_real_tensors_and_nn_init_helpers_are_untouched():
    real = torch.zeros(3)
    with meta_device():
        nn.init.ones_(real)
        gain = nn.init.calculate_gain("relu")
        w = torch.empty(4, 2)
        nn.init.normal_(w)
    assert real.tolist() == [1.0, 1.0, 1.0] and gain == pytest.approx(2 ** 0.5)
    assert w.is_meta and w.shape == (4, 2)


def test_building_a_model_spec_does_not_import_dynamo():
    """The point of it: a fresh process builds a GPT's spec (its parameters counted on the meta
    device) without importing torch._dynamo (about 0.9 s)."""
    code = ("import sys\n"
            "from experiments.models import build_model\n"
            "spec = build_model({'name': 'gpt', 'layers': 2, 'dim': 32, 'heads': 2, 'vocab': 64, 'seq_len': 8})\n"
            "print(spec.num_params, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) > 0 and out[1] == "False"
