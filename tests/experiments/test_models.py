"""Reference models: shapes, determinism, causal masking, cost shape, and the HF adapter's parity."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from experiments.config import HFModelConfig, model_config
from experiments.models import build_model, compose
from experiments.models.mlp import width_profile

torch.set_num_threads(1)

GPT = {"name": "gpt", "layers": 3, "dim": 32, "heads": 4, "vocab": 256, "seq_len": 16, "dropout": 0.0}
MLP = {"name": "mlp", "depth": 5, "dim": 16, "width": 8, "profile": "ramp", "ratio": 4.0, "in_dim": 6, "classes": 5}


def _flops(module: torch.nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        module(x)
    return counter.get_total_flops()


def test_gpt_layer_shapes_and_initial_loss():
    spec = build_model(GPT)
    assert len(spec.layers) == GPT["layers"] + 2
    x, y = spec.example_input(3), spec.example_target(3)
    assert x.dtype == torch.int64 and x.shape == (3, 16) and y.shape == (3, 16)
    h = x
    for i, factory in enumerate(spec.layers):
        h = factory()(h)
        if i < len(spec.layers) - 1:
            assert h.shape == (3, 16, 32)
    assert h.shape == (3, 16, 256)
    loss = spec.loss_fn(h, y)
    assert loss.ndim == 0
    assert abs(loss.item() - math.log(256)) < 0.5  # near-uniform predictions at init
    assert spec.tokens_per_sample == 16


def test_gpt_is_causal():
    model = compose(build_model(GPT).layers).eval()
    x = build_model(GPT).example_input(2)
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 256  # change only the last token
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not torch.allclose(a[:, -1], b[:, -1])


@pytest.mark.parametrize("config", [GPT, MLP])
def test_factories_are_deterministic_under_a_seed(config):
    spec = build_model(config)
    a = compose(spec.layers, seed=5).state_dict()
    b = compose(spec.layers, seed=5).state_dict()
    c = compose(spec.layers, seed=6).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].numel() > 1 and a[k].std() > 0)


@pytest.mark.parametrize("config", [GPT, MLP])
def test_spec_pickles_for_spawned_workers(config):
    spec = build_model(config)
    layers, loss_fn = pickle.loads(pickle.dumps((spec.layers, spec.loss_fn)))
    torch.manual_seed(0)
    rebuilt = layers[1]()
    torch.manual_seed(0)
    original = spec.layers[1]()
    assert all(torch.equal(p, q) for p, q in zip(rebuilt.parameters(), original.parameters()))
    assert loss_fn is spec.loss_fn


def test_num_params_matches_built_model_and_counts_ties_once():
    spec = build_model(GPT)
    assert spec.num_params == sum(p.numel() for p in compose(spec.layers).parameters())
    tied = build_model({**GPT, "tie_embeddings": True})
    assert tied.ties == [("0.tok.weight", f"{GPT['layers'] + 1}.head.weight")]
    assert tied.num_params == spec.num_params - 256 * 32
    model = compose(tied.layers)
    params = {f"{i}.{n}": p for i, layer in enumerate(model) for n, p in layer.named_parameters()}
    first, second = tied.ties[0]
    assert params[first].shape == params[second].shape


def test_gpt_first_and_last_layers_outweigh_a_block_with_a_large_vocab():
    spec = build_model({**GPT, "vocab": 8192})
    layers = compose(spec.layers)
    params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert params[0] > params[1] and params[-1] > params[1]
    x = spec.example_input(2)
    hidden = layers[0](x)
    assert _flops(layers[-1], hidden) > _flops(layers[1], hidden)
    # and with a byte vocabulary the head is cheaper than a block
    small = compose(build_model(GPT).layers)
    assert _flops(small[-1], hidden) < _flops(small[1], hidden)


def test_width_profiles():
    assert width_profile(4, 10, "uniform") == [10] * 4
    ramp = width_profile(5, 10, "ramp", ratio=4.0)
    assert ramp[0] == 10 and ramp[-1] == 40 and ramp == sorted(ramp)
    hourglass = width_profile(5, 10, "hourglass", ratio=4.0)
    assert hourglass[0] == hourglass[-1] == 40 and min(hourglass) == hourglass[2] == 10
    with pytest.raises(ValueError, match="choose one of"):
        width_profile(3, 10, "diamond")


def test_mlp_shapes_unequal_layers_and_explicit_widths():
    spec = build_model(MLP)
    model = compose(spec.layers)
    x, y = spec.example_input(4), spec.example_target(4)
    assert x.shape == (4, 6) and y.dtype == torch.int64
    out = model(x)
    assert out.shape == (4, 5) and spec.loss_fn(out, y).ndim == 0
    block_params = [sum(p.numel() for p in layer.parameters()) for layer in model[1:-1]]
    assert block_params == sorted(block_params) and block_params[0] < block_params[-1]
    explicit = build_model({**MLP, "widths": [3, 30]})
    assert len(explicit.layers) == 4 and explicit.extra["widths"] == [3, 30]


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="gpt"):
        build_model({"name": "resnet"})


# --------------------------------------------------------------------------- Hugging Face adapter
import transformers  # noqa: E402,F401 - a required test dependency: a broken install fails here

HF = {"layers": 2, "dim": 32, "heads": 4, "vocab": 300, "seq_len": 16, "dropout": 0.0}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_layers_match_the_hf_forward(arch):
    from experiments.models.hf import _model_class, hf_config, layers_from_hf

    torch.manual_seed(0)
    hf_model = _model_class(arch)(hf_config(model_config({**HF, "arch": arch}, HFModelConfig))).eval()
    layers = torch.nn.Sequential(*layers_from_hf(hf_model)).eval()
    assert len(layers) == HF["layers"] + 2
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        expected = hf_model(x).logits
        got = layers(x)
    assert got.shape == (2, 16, 300)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the adapter shares the model's parameters (no copies)
    assert {id(p) for p in layers.parameters()} == {id(p) for p in hf_model.parameters()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_factories_build_each_layer_alone(arch):
    spec = build_model({**HF, "name": f"hf_{arch}", "arch": arch})
    assert len(spec.layers) == HF["layers"] + 2
    assert spec.ties == [("0.wte.weight", f"{HF['layers'] + 1}.lm_head.weight")]
    model = compose(spec.layers, seed=1)
    again = compose(spec.layers, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    x, y = spec.example_input(2), spec.example_target(2)
    loss = spec.loss_fn(model(x), y)
    loss.backward()
    assert all(p.grad is not None for p in model[1].parameters())
    assert abs(loss.item() - math.log(300)) < 0.5
    reference = _reference_param_count(arch)
    assert spec.num_params == reference


def _reference_param_count(arch: str) -> int:
    from experiments.models.hf import _model_class, hf_config

    with torch.device("meta"):
        model = _model_class(arch)(hf_config(model_config({**HF, "arch": arch}, HFModelConfig)))
    return sum(p.numel() for p in model.parameters())  # tied weights appear once


def test_hf_factories_use_hf_initialisation():
    spec = build_model({**HF, "dim": 128, "name": "hf_llama", "arch": "llama"})
    torch.manual_seed(0)
    block = spec.layers[1]()
    weight = block.block.self_attn.q_proj.weight
    # Llama's _init_weights draws N(0, initializer_range=0.02); torch's default Linear init
    # (Kaiming uniform, fan_in 128) would give a std of about 0.051.
    assert abs(weight.std().item() - 0.02) < 0.003
    for name, p in block.named_parameters():
        if "layernorm" in name:
            assert torch.all(p == 1)


def test_hf_configs_from_hydra_compose(compose_cfg):
    for option in ("hf_gpt2", "hf_llama", "gpt"):
        cfg = compose_cfg(f"model={option}", "model.layers=1", "model.dim=32")
        spec = build_model(cfg.model)
        assert len(spec.layers) == 3
        assert compose(spec.layers)(spec.example_input(1)).shape == (1, cfg.model.seq_len, cfg.model.vocab)
    cfg = compose_cfg("model=mlp", "data=synthetic", "model.depth=2")
    assert len(build_model(cfg.model).layers) == 4
