"""Weights held once: the packed copy replaces the plain weight, exactly recoverable, freed on unload."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import assert_same_or_near_tie, hf_greedy, tiny_model
from jupyter_pagedkv import SamplingParams
from jupyter_pagedkv.worker import held_weights, packed_linear
from jupyter_pagedkv.worker.packed_linear import pack_linears, packed_gemms, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 11, 40, 7], list(range(3, 40)), [100] * 12]


def plain_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_identity_gemm_gives_back_the_packed_weight_bit_for_bit(dtype):
    if dtype not in packed_linear.packable_dtypes():
        # This CPU's oneDNN has no bf16 GEMMs (no AVX-512): the engine never packs bf16 here.
        assert not packed_linear.should_pack(torch.device("cpu"), dtype)
        return
    g = torch.Generator().manual_seed(3)
    for shape in ((96, 64), (48, 160), (200, 33)):
        weight = (torch.randn(shape, generator=g) * 0.1).to(dtype)
        weight[0, :4] = torch.tensor([0.0, 1e-30, -3.5e4, 6e-8]).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        back = held_weights.unpack(packed, shape[1])
        assert back.dtype == dtype and torch.equal(back.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                                   weight.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_an_engine_holding_a_models_weights_keeps_one_copy_and_matches_transformers(make_engine):
    model, oracle = tiny_model("qwen3", seed=5), tiny_model("qwen3", seed=5)
    refs = [hf_greedy(oracle, p, 20, stop_at_eos=False) for p in PROMPTS]
    before = plain_weights(model)
    engine = make_engine(model, keep_plain_weights=False)
    assert engine._hold_weights and engine._runner.packed.extra_bytes == 0
    held = [m for m in linears(model) if m.__dict__.get("_pagedkv_held")]
    assert len(held) == 15 and all(held_weights.is_placeholder(m.weight) for m in held)
    assert all(m.weight.shape == before[n + ".weight"].shape for n, m in model.named_modules() if m in held)
    assert "each weight held once" in engine.info().summary
    outs = engine.generate(PROMPTS, GREEDY)
    for p, o, r in zip(PROMPTS, outs, refs):
        assert_same_or_near_tie(oracle, p, o.token_ids, r)
    # The state dict is rebuilt from the packed copies, bit for bit.
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # A model passed in gets its plain weights back at shutdown, exactly, and runs stock again.
    engine.shutdown()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(held_weights.is_placeholder(m.weight) or "forward" in m.__dict__ for m in linears(model))


def test_a_model_passed_in_keeps_its_plain_weights_by_default(make_engine):
    model = tiny_model("llama")
    engine = make_engine(model)
    assert engine._pack_weights and not engine._hold_weights
    assert engine._runner.packed.extra_bytes == sum(m.weight.numel() * 4 for m in linears(model))
    assert "beside the plain weights" in engine.info().summary


def test_a_held_layer_outside_the_engine_computes_through_its_packed_weight():
    model = tiny_model("llama")
    x = torch.randn(1, 6, 64)
    with torch.no_grad():
        stock = model.model.layers[0].mlp(x)
    handle = pack_linears(model, hold=True)
    with torch.inference_mode(), packed_gemms(handle):
        model(input_ids=torch.tensor([[3, 4]]), use_cache=False)        # learns groups, holds
    mlp = model.model.layers[0].mlp
    assert held_weights.is_placeholder(mlp.up_proj.weight)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), stock, rtol=1e-5, atol=1e-5)
        # A grouped member called alone (another input than its siblings) still gets its own rows.
        torch.testing.assert_close(mlp.up_proj(x), nn.functional.linear(x, handle_plain(mlp.up_proj)),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="held packed by an engine, for inference only"):
        mlp(x.requires_grad_())
    mlp.up_proj.weight = nn.Parameter(torch.randn(128, 64))
    with pytest.raises(RuntimeError, match="keep_plain_weights=True to change weights"), torch.no_grad():
        mlp(x.detach())
    handle.release()


def handle_plain(layer: nn.Linear) -> torch.Tensor:
    return layer.__dict__["_pagedkv_plain"]()


def test_a_tied_output_projection_is_left_unpacked_when_weights_are_held():
    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    handle = pack_linears(model, hold=True)
    assert model.lm_head not in handle.layers and len(handle.layers) == 14
    copy = pack_linears(tiny_model("llama"), hold=False)
    assert len(copy.layers) == 15
    handle.release(), copy.release()


def test_engines_sharing_a_held_model_release_it_only_when_the_last_one_goes(make_engine):
    model, oracle = tiny_model("llama", seed=2), tiny_model("llama", seed=2)
    first = make_engine(model, keep_plain_weights=False)
    second = make_engine(model, keep_plain_weights=False)
    first.shutdown()
    assert all(m.__dict__.get("_pagedkv_held") for m in linears(model))     # still the second's
    outs = second.generate(PROMPTS[:2], GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert_same_or_near_tie(oracle, p, o.token_ids, hf_greedy(oracle, p, 20, stop_at_eos=False))


def test_an_unloaded_model_the_engine_owned_frees_its_weights_and_says_so(make_engine):
    model = tiny_model("llama")
    engine = make_engine(model, keep_plain_weights=False)
    engine._owns_model = True            # as Engine.from_pretrained builds it
    engine.shutdown()
    assert all("_pagedkv_packed" not in m.__dict__ and "_pagedkv_group" not in m.__dict__ for m in linears(model))
    with pytest.raises(RuntimeError, match="unloaded from its engine.*load the model again"):
        model(input_ids=torch.tensor([[3, 4]]))
