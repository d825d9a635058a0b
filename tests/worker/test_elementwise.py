"""The C++ elementwise steps the lean loop calls for prefill rows (native_decode.cpp: norm_rows,
rotate_rows, gated_rows): ATen's very values for every dtype and layout (their own loops where the
tensors suit them, ATen's ops where not), and the engine's proof that keeps ATen's ops otherwise."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_pagedkv.testing.models import tiny_model
from jupyter_pagedkv.worker import lean_forward
from jupyter_pagedkv.worker.lean_forward import ATEN
from jupyter_pagedkv.worker.native_decode import load_extension
from jupyter_pagedkv.worker.packed_linear import packable_dtypes


def _norm(weight: torch.Tensor) -> nn.Module:
    norm = nn.Module()
    norm.weight, norm.variance_epsilon = weight, 1e-6
    return norm


@pytest.fixture(params=["avx2", "baseline"])
def row_loops(request):
    """The extension, its row loops' AVX2 build allowed or not (the baseline build runs everywhere)."""
    m = load_extension()
    before = m.row_loops_avx2(request.param == "avx2")
    yield m
    m.row_loops_avx2(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 300])      # 300 rows: more than one thread's run
def test_the_cpp_steps_give_atens_values(row_loops, dtype, tokens):
    m = row_loops
    g = torch.Generator().manual_seed(tokens)
    hidden, heads, kv_heads, d, inter = 96, 6, 2, 64, 160
    draw = lambda *s: (torch.randn(*s, generator=g) * 3).to(dtype)  # noqa: E731
    h, qkv, gate_up = draw(tokens, hidden), draw(tokens, heads + 2 * kv_heads, d), draw(tokens, 2 * inter)
    cos, sin = draw(tokens, 1, d), draw(tokens, 1, d)
    norm, mlp = _norm(draw(hidden)), nn.Module()
    mlp.act_fn = nn.SiLU()
    assert torch.equal(m.norm_rows(h, norm.weight, 1e-6), ATEN.norm(norm, h))
    assert torch.equal(m.rotate_rows(qkv, heads + kv_heads, cos, sin), ATEN.rotate(qkv, heads + kv_heads, cos, sin))
    assert torch.equal(m.gated_rows(gate_up, inter), ATEN.gated(mlp, gate_up, inter))
    # Rounding's edge cases: ties to even, values past bf16's largest (to infinity), infinities, NaN.
    edge = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.3895e38, -3.4e38, float("inf"), float("nan"), 0.0, -0.0])
    h2 = edge.repeat(tokens, hidden // len(edge)).to(dtype)
    assert torch.equal(m.norm_rows(h2, norm.weight, 1e-6).isnan(), ATEN.norm(norm, h2).isnan())
    g2 = torch.cat([edge.repeat(tokens, inter // len(edge))] * 2, dim=1).to(dtype)
    got, want = m.gated_rows(g2, inter), ATEN.gated(mlp, g2, inter)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    # Layouts the loops do not take go to ATen's ops: a strided h, a norm weight of another dtype,
    # strided rotary tables, a non-contiguous gate_up.
    wide = draw(tokens, 2 * hidden)[:, ::2]
    assert torch.equal(m.norm_rows(wide, norm.weight, 1e-6), ATEN.norm(norm, wide))
    other = _norm(norm.weight.float() if dtype != torch.float32 else norm.weight.bfloat16())
    assert torch.equal(m.norm_rows(h, other.weight, 1e-6), ATEN.norm(other, h))
    cos2, sin2 = draw(tokens, 1, 2 * d)[..., ::2], draw(tokens, 1, 2 * d)[..., ::2]
    assert torch.equal(m.rotate_rows(qkv, heads, cos2, sin2), ATEN.rotate(qkv, heads, cos2, sin2))
    gu = draw(2 * inter, tokens).t()
    assert torch.equal(m.gated_rows(gu, inter), ATEN.gated(mlp, gu, inter))


@pytest.mark.parametrize("dtype", packable_dtypes())
def test_engines_prove_the_cpp_steps_and_prefill_through_them(make_engine, dtype):
    engine = make_engine(tiny_model("llama").to(dtype), block_size=8)
    lean = engine._runner.lean
    assert lean.native is not None and lean.elementwise is not ATEN
    assert "prefill rows' elementwise steps in C++" in engine._runner.plan.forward.reason


def test_cpp_steps_that_differ_are_refused(make_engine, monkeypatch):
    """Were a loop to round once differently, the engine's proof would keep ATen's ops, and say so."""
    m = load_extension()
    monkeypatch.setattr(m, "rotate_rows", lambda qkv, n, cos, sin: ATEN.rotate(qkv, n, cos, sin) * (1 + 2 ** -10))
    engine = make_engine(tiny_model("llama"), block_size=8)
    assert engine._runner.lean.elementwise is lean_forward.ATEN
    assert "the C++ rotary embedding differs from ATen's here" in engine._runner.plan.forward.reason
