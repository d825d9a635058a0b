"""Packed CPU GEMMs: used only inside engine steps, never stale, released cleanly, exact enough."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.worker.packed_linear import pack_linears, packed_gemms, packing_available, should_pack

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
    assert handle.layers == [layer]
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a) or real(*a))
    with torch.inference_mode(), packed_gemms():
        got = layer(x)
    assert len(calls) == 1 and calls[0][1] is layer._pagedkv_packed.weight
    assert handle.nbytes == layer.weight.numel() * 4          # packed on first use
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def assert_engine_step_uses_current_weight(layer: nn.Linear, x: torch.Tensor) -> None:
    with torch.inference_mode(), packed_gemms():
        got = layer(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_repacked_before_its_next_use():
    layer, x = linear(), torch.randn(5, 96)
    pack_linears(layer)
    with torch.no_grad():
        layer.weight.mul_(-3.0)
    assert_engine_step_uses_current_weight(layer, x)


def test_a_reassigned_weight_is_repacked_before_its_next_use():
    layer, x = linear(), torch.randn(5, 96)
    pack_linears(layer)
    layer.weight = nn.Parameter(torch.randn(160, 96))
    assert_engine_step_uses_current_weight(layer, x)
    layer.weight.data = torch.randn(160, 96)          # what module.to() does: same object, new storage
    assert_engine_step_uses_current_weight(layer, x)


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


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_fp32_is_packed_everywhere_and_bf16_where_onednn_computes_it(monkeypatch, onednn_bf16):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    assert should_pack(torch.device("cpu"), torch.float32)
    assert should_pack(torch.device("cpu"), torch.bfloat16) is onednn_bf16
    assert not should_pack(torch.device("cpu"), torch.float16)
    assert not should_pack(torch.device("cpu"), torch.float32, requested=False)
    with pytest.raises(ValueError, match="pack_weights=True needs a CPU model in float32"):
        should_pack(torch.device("cpu"), torch.float16, requested=True)
    bf16 = tiny_model("llama").to(torch.bfloat16)
    assert len(pack_linears(bf16).layers) == (15 if onednn_bf16 else 0)


def test_the_engine_packs_by_default_and_generates_what_hf_generates(make_engine):
    model = tiny_model("qwen3", seed=5)
    prompts = [[5, 9, 11, 40, 7], list(range(3, 40)), [100] * 12]
    refs = [hf_greedy(model, p, 24, stop_at_eos=False) for p in prompts]
    engine = make_engine(model)
    assert engine._pack_weights and len(engine._runner.packed.layers) == 15
    # Packed at start, each weight exactly once (the groups learned from a one-token forward).
    assert engine._runner.packed.nbytes == sum(m.weight.numel() * 4 for m in engine._runner.packed.layers)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    # Learned in the first step: per decoder layer q/k/v and gate/up are one GEMM each.
    assert [len(g.members) for g in engine._runner.packed.groups] == [3, 2, 3, 2]
    for p, o, r in zip(prompts, outs, refs):
        assert_same_or_near_tie(model, p, o.token_ids, r)
    unpacked = make_engine(tiny_model("qwen3", seed=5), pack_weights=False)
    assert not unpacked._pack_weights and unpacked._runner.packed.layers == []


class Siblings(nn.Module):
    """Three projections of one input, as an attention block's q/k/v."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.q, self.k, self.v = nn.Linear(64, 48), nn.Linear(64, 16, bias=False), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> list[torch.Tensor]:
        return [self.q(x), self.k(x), self.v(x if y is None else y)]


@torch.inference_mode()
def stock(model: Siblings, x: torch.Tensor, y: torch.Tensor | None = None) -> list[torch.Tensor]:
    return [torch.nn.functional.linear(i, m.weight, m.bias)
            for m, i in ((model.q, x), (model.k, x), (model.v, x if y is None else y))]


def test_layers_reading_one_input_are_learned_as_one_fused_gemm(monkeypatch):
    model, x = Siblings(), torch.randn(1, 5, 64)
    handle = pack_linears(model)
    with torch.inference_mode():
        with packed_gemms(handle):                   # the first forward records, then groups
            model(x)
        assert [g.members for g in handle.groups] == [[model.q, model.k, model.v]]
        assert handle.nbytes == sum(m.weight.numel() * 4 for m in (model.q, model.k, model.v))
        calls = []
        real = torch.ops.mkldnn._linear_pointwise
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a) or real(*a))
        x = torch.randn(1, 5, 64)
        with packed_gemms(handle):
            got = model(x)
    assert len(calls) == 1                           # one GEMM served all three layers
    for a, b in zip(got, stock(model, x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_grouped_layer_called_with_another_input_computes_on_its_own():
    model, x, y = Siblings(), torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    handle = pack_linears(model)
    with torch.inference_mode():
        with packed_gemms(handle):
            model(x)                                 # learns q, k, v as one group
        with packed_gemms(handle):
            got = model(x, y)                        # v now reads a different tensor
    for a, b in zip(got, stock(model, x, y)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_group_is_repacked_when_a_member_weight_changes():
    model, x = Siblings(), torch.randn(1, 4, 64)
    handle = pack_linears(model)
    with torch.inference_mode(), packed_gemms(handle):
        model(x)
    with torch.no_grad():
        model.k.weight.add_(1.0)
    with torch.inference_mode(), packed_gemms(handle):
        got = model(x)
    for a, b in zip(got, stock(model, x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
