"""Packed CPU GEMMs: used only inside engine steps, never stale, released cleanly, exact enough."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.packed_linear import pack_linears, packed_gemms, packing_available, should_pack

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


def linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(96, 160)


def test_outside_engine_steps_a_packed_layer_is_stock_torch():
    layer, x = linear(), torch.randn(7, 96)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    pack_linears(layer)
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)          # bit for bit: no packed path taken


def test_inside_engine_steps_the_packed_path_matches_to_fp32_rounding(monkeypatch):
    layer, x = linear(), torch.randn(1, 33, 96)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    handle = pack_linears(layer)
    assert handle.layers == [layer] and handle.nbytes == layer.weight.numel() * 4
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a) or real(*a))
    with torch.inference_mode(), packed_gemms():
        got = layer(x)
    assert len(calls) == 1 and calls[0][1] is layer._pagedkv_packed.weight
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_repacked_before_its_next_use():
    layer, x = linear(), torch.randn(5, 96)
    pack_linears(layer)
    with torch.no_grad():
        layer.weight.mul_(-3.0)
    with torch.inference_mode(), packed_gemms():
        got = layer(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


def test_a_reassigned_weight_is_repacked_before_its_next_use():
    layer, x = linear(), torch.randn(5, 96)
    pack_linears(layer)
    layer.weight = nn.Parameter(torch.randn(160, 96))
    with torch.inference_mode(), packed_gemms():
        got = layer(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)
    layer.weight.data = torch.randn(160, 96)          # what module.to() does: same object, new storage
    with torch.inference_mode(), packed_gemms():
        got = layer(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


def test_with_grad_enabled_the_layer_stays_differentiable():
    layer, x = linear(), torch.randn(4, 96)
    pack_linears(layer)
    with packed_gemms():
        layer(x).sum().backward()
    assert layer.weight.grad is not None


def test_release_restores_the_layers_and_drops_the_copies():
    model = tiny_model("llama")
    handle = pack_linears(model)
    packed = list(handle.layers)
    assert len(packed) == 2 * 7 + 1                      # 2 layers x (q k v o gate up down) + lm_head
    handle.release()
    assert handle.nbytes == 0
    assert all("forward" not in m.__dict__ and "_pagedkv_packed" not in m.__dict__ for m in packed)


def test_only_fp32_cpu_weights_are_packed_by_default():
    assert should_pack(torch.device("cpu"), torch.float32)
    assert not should_pack(torch.device("cpu"), torch.bfloat16)
    assert not should_pack(torch.device("cpu"), torch.float32, requested=False)
    with pytest.raises(ValueError, match="pack_weights=True needs a CPU model in torch.float32"):
        should_pack(torch.device("cpu"), torch.bfloat16, requested=True)
    bf16 = tiny_model("llama").to(torch.bfloat16)
    assert pack_linears(bf16).layers == []


def test_the_engine_packs_by_default_and_generates_what_hf_generates(make_engine):
    model = tiny_model("qwen3", seed=5)
    prompts = [[5, 9, 11, 40, 7], list(range(3, 40)), [100] * 12]
    refs = [hf_greedy(model, p, 24, stop_at_eos=False) for p in prompts]
    engine = make_engine(model)
    assert engine.pack_weights and len(engine.runner.packed.layers) == 15
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for p, o, r in zip(prompts, outs, refs):
        assert_same_or_near_tie(model, p, o.token_ids, r)
    unpacked = make_engine(tiny_model("qwen3", seed=5), pack_weights=False)
    assert not unpacked.pack_weights and unpacked.runner.packed.layers == []
