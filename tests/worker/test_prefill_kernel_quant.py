"""The C++ prefill attention kernel over a quantized KV cache (kv_cache_dtype "int8" / "fp8_e4m3":
int8 or e4m3 codes, an fp16 scale per token and KV head): it attends over code * scale, checked
against the plain definition (`kernels/reference.py`) over the dequantized cache, at random shapes
(GQA, partial blocks, prefixes aligned or not, windows), blocks read in place or gathered, a chunk's
own keys given or read back from the codes. Where this CPU lacks the kernel's instructions, the
engine must say so instead (never a silent skip)."""
from __future__ import annotations

import pytest
import torch
from kv_codes import dequantize, quantize
from test_prefill_attention import TOLERANCE, expected, laid_out_consecutively, prefill_batch
from test_prefill_attention import reference as definition
from test_prefill_kernel import DTYPES, assert_native_refused, kernel_for, reference

from jupyter_pagedkv.worker import prefill_attention


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_quantized_cache_is_attended_as_its_dequantized_values(kind, seed, dtype):
    module = kernel_for(dtype)
    if module is None:
        assert_native_refused(dtype)
        return
    g = torch.Generator().manual_seed(300 + seed)
    kv_heads, group = [1, 2, 3][seed], [4, 1, 3][seed]
    head_dim, block_size = [64, 128, 64][seed], [16, 5, 32][seed]
    chunks = [(0, 90), (block_size * 3, 40), (37, 20), (150, 1)]
    window = [None, 30, None][seed]
    query, k_cache, v_cache, meta, _, _ = prefill_batch(chunks, kv_heads * group, kv_heads, head_dim, block_size,
                                                        dtype, g)
    (kq, ks), (vq, vs) = quantize(k_cache, kind), quantize(v_cache, kind)
    k_deq, v_deq = dequantize(kq, ks), dequantize(vq, vs)
    scale = head_dim ** -0.5
    want = expected(query, k_deq, v_deq, meta, scale, window)
    # blocks read in place: the scales move with their blocks
    kq2, vq2, meta2 = laid_out_consecutively(kq, vq, meta, block_size)
    ks2, vs2, _ = laid_out_consecutively(ks.unsqueeze(-1), vs.unsqueeze(-1), meta, block_size)
    for k, v, k_s, v_s, m in ((kq, vq, ks, vs, meta), (kq2, vq2, ks2.squeeze(-1), vs2.squeeze(-1), meta2)):
        m.prefill_kernel = module
        own = [(None, None), tuple(dequantize(c.view(-1, kv_heads, head_dim)[m.slot_mapping],
                                              s.view(-1, kv_heads)[m.slot_mapping]).to(dtype)
                                   for c, s in ((k, k_s), (v, v_s)))]
        for new_k, new_v in own:     # own keys read back from the codes, or given (as dequantized)
            out = prefill_attention.prefill_attention(query, k, v, m, scale, window, new_k, new_v,
                                                      k_scale=k_s, v_scale=v_s)
            assert out.dtype == dtype
            assert (out.float() - want.float()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_codes_with_strided_scales_and_log_sum_exps(kind, dtype):
    module = kernel_for(dtype)
    if module is None:
        assert_native_refused(dtype)
        return
    g = torch.Generator().manual_seed(8)
    q = torch.randn(40, 6, 64, generator=g).to(dtype)
    kv = torch.randn(130, 2, 2, 64, generator=g)           # keys and values of 2 KV heads, side by side
    codes, scales = quantize(kv, kind)
    k, v, ks, vs = codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1]      # strided views
    out, lse = prefill_attention.attend(module, q, k, v, 0.125, 90, 50, ks, vs)
    # the kernel packs code * scale rounded to the tile's dtype: the reference reads those values
    want, want_lse = reference(q, dequantize(k, ks).to(dtype), dequantize(v, vs).to(dtype), 0.125, 90, 50)
    assert (out.double() - want).abs().max().item() <= TOLERANCE[dtype]
    assert (lse.double() - want_lse).abs().max().item() <= 1e-4


def test_codes_without_scales_are_refused():
    module = kernel_for(torch.float32)
    if module is None:
        assert_native_refused(torch.float32)
        return
    codes, scales = quantize(torch.randn(10, 2, 64), "int8")
    with pytest.raises(RuntimeError, match="k_scale and v_scale come with int8"):
        prefill_attention.attend(module, torch.randn(4, 2, 64), codes, codes, 0.125, 6, None)
    with pytest.raises(RuntimeError, match="float16 \\[L, kv_heads\\]"):
        prefill_attention.attend(module, torch.randn(4, 2, 64), codes, codes, 0.125, 6, None, scales.float(), scales)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("window", [None, 30])
def test_the_torch_path_attends_each_chunks_own_rows_as_computed(kind, window):
    """SDPA, no C++ kernel: a chunk that starts its sequence, chunks after a prefix (the split path)
    and, under a window that cuts, the dense-mask path all read the prefix quantized and the
    chunk's own rows as computed, as the plain definition does with `new_k`/`new_v`."""
    g = torch.Generator().manual_seed(11)
    chunks = [(0, 90), (48, 40), (37, 20), (150, 2)]
    query, k_cache, v_cache, meta, new_k, new_v = prefill_batch(chunks, 6, 2, 64, 16, torch.float32, g)
    (kq, ks), (vq, vs) = quantize(k_cache, kind), quantize(v_cache, kind)
    meta.prefill_kernel = None
    scale = 64 ** -0.5
    out = prefill_attention.prefill_attention(query, kq, vq, meta, scale, window, new_k, new_v, k_scale=ks, v_scale=vs)
    want = definition.paged_attention(query.float(), kq, vq, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      scale, sliding_window=window, k_scale=ks, v_scale=vs, new_k=new_k, new_v=new_v)
    assert (out.float() - want).abs().max().item() <= TOLERANCE[torch.float32]
