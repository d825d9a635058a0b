"""The Triton kernels over a quantized KV cache (kv_cache_dtype "int8" / "fp8_e4m3"): the cache
write quantizes as the format's torch definition does (kernels/reference.py), code for code and
scale for scale, and attention reads the codes as their dequantized values. Interpreted on the
CPU, native under `PAGEDKV_KERNEL_TEST_DEVICE=cuda` (test_kernels.py says how)."""
from __future__ import annotations

import pytest
import torch
from test_kernels import DEVICE, TOLERANCE, kernels, make_batch, max_error  # noqa: F401  (the fixture)

CODES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
# bf16: measured (interpreter, 2026-12-02) up to 2.4e-2 on the 8-heads-per-KV-head batch below over
# three seeds, where the unquantized kernel's own error on the same batches is 1.5-1.6e-2: the
# weights times the values' scales are rounded to bf16, as the unquantized kernel rounds the weights.
QUANT_TOLERANCE = {**TOLERANCE, torch.bfloat16: 3e-2}


def quantize_batch(kernels, b, kind: str):
    """The batch's cache as codes and fp16 scales per token and KV head (the reference quantizer)."""
    b.k_codes, b.k_scale = (t.to(DEVICE) for t in kernels.reference.quantize(b.k_cache.cpu(), CODES[kind]))
    b.v_codes, b.v_scale = (t.to(DEVICE) for t in kernels.reference.quantize(b.v_cache.cpu(), CODES[kind]))
    return b


def own_rows(b) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's keys and values `[T, kv_heads, d]`, unquantized: each sequence's query rows are
    the last positions of its context, whose rows the batch's unquantized cache holds."""
    bs = b.k_cache.shape[1]
    blocks, slots = [], []
    for i in range(len(b.seq_lens)):
        s, e, ctx = int(b.query_start_loc[i]), int(b.query_start_loc[i + 1]), int(b.seq_lens[i])
        for pos in range(ctx - (e - s), ctx):
            blocks.append(int(b.block_tables[i, pos // bs]))
            slots.append(pos % bs)
    # Laid out as the engine passes them: head-major views of the projection (stride(1) = T * d).
    return tuple(c[blocks, slots].transpose(0, 1).contiguous().transpose(0, 1) for c in (b.k_cache, b.v_cache))


def run_quantized(kernels, b, fresh: bool = True, **options):
    """As the engine calls it: with this step's own rows (prefill chunks attend them unquantized)."""
    new_k, new_v = own_rows(b) if fresh else (None, None)
    return kernels.attention.paged_attention(b.query, b.k_codes, b.v_codes, b.block_tables, b.seq_lens,
                                             b.query_start_loc, b.scale, k_scale=b.k_scale, v_scale=b.v_scale,
                                             new_k=new_k, new_v=new_v, **options)


def dequantized_reference(kernels, b, sliding_window=None, fresh: bool = True):
    new_k, new_v = (t.cpu() for t in own_rows(b)) if fresh else (None, None)
    return kernels.reference.paged_attention(
        b.query.cpu().float(), b.k_codes.cpu(), b.v_codes.cpu(), b.block_tables.cpu(), b.seq_lens.cpu(),
        b.query_start_loc.cpu(), b.scale, sliding_window=sliding_window, k_scale=b.k_scale.cpu(),
        v_scale=b.v_scale.cpu(), new_k=new_k, new_v=new_v)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype, head_dim, heads, kv_heads", [(torch.float32, 64, 6, 2), (torch.bfloat16, 64, 8, 1),
                                                              (torch.float16, 128, 4, 4)])
def test_mixed_batch_over_a_quantized_cache_matches_the_dequantized_reference(kernels, kind, dtype, head_dim,
                                                                              heads, kv_heads):
    """Decode rows and prefill chunks (one after a prefix), partial last blocks, GQA, unused
    blocks between the tables' (as the engine's scratch block is)."""
    b = quantize_batch(kernels, make_batch([1, 7, 1, 29], [50, 7, 1, 90], heads=heads, kv_heads=kv_heads,
                                           head_dim=head_dim, dtype=dtype), kind)
    out = run_quantized(kernels, b)
    assert out.dtype == dtype and out.shape == b.query.shape
    assert max_error(out, dequantized_reference(kernels, b)) <= QUANT_TOLERANCE[dtype]
    if head_dim == 128:     # the tile a GPU launches there (launch_config: 32 rows, 64 keys)
        assert max_error(run_quantized(kernels, b, block_m=32, tile_n=64),
                         dequantized_reference(kernels, b)) <= QUANT_TOLERANCE[dtype]
    if dtype == torch.float32:      # without this step's rows, every key is read from the cache
        stored = dequantized_reference(kernels, b, fresh=False)
        assert max_error(run_quantized(kernels, b, fresh=False), stored) <= QUANT_TOLERANCE[dtype]
        # The two rules differ, and only in the prefill chunks' rows (the decode rows read it all).
        rows = [r for i in (1, 3) for r in range(int(b.query_start_loc[i]), int(b.query_start_loc[i + 1]))]
        assert max_error(out[rows], stored[rows]) > 10 * QUANT_TOLERANCE[dtype]
        decode = [int(b.query_start_loc[i]) for i in (0, 2)]
        assert max_error(out[decode], stored[decode]) <= QUANT_TOLERANCE[dtype]


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_split_k_window_and_block_size_over_a_quantized_cache(kernels, kind):
    b = quantize_batch(kernels, make_batch([1, 1, 5], [130, 64, 70], block_size=32, seed=7), kind)
    assert max_error(run_quantized(kernels, b, num_splits=3), dequantized_reference(kernels, b)) \
        <= TOLERANCE[torch.float32]
    assert max_error(run_quantized(kernels, b, sliding_window=24), dequantized_reference(kernels, b, 24)) \
        <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")   # the NaN row, int8
def test_write_kv_quantizes_code_for_code_as_the_reference(kernels, kind, dtype):
    """Strided rows, skipped slots (-1), a row of zeros (scale 2**-14, -0 codes for -0), values wide
    enough apart that fp8 rounding carries into the exponent, fp8 subnormals, a NaN: codes and
    scales bit for bit the reference's (the NaN's row: NaN as the reference's, below)."""
    g = torch.Generator().manual_seed(11)
    shape = (6, 16, 3, 64)
    caches = [torch.zeros(shape, dtype=CODES[kind], device=DEVICE) for _ in range(2)]
    scales = [torch.zeros(shape[:3], dtype=torch.float16, device=DEVICE) for _ in range(2)]
    key = (torch.randn(1, 3, 6, 64, generator=g) * 10 ** torch.randn(1, 3, 6, 1, generator=g)).to(dtype)
    key[0, 1, 2] = 0
    # one row spanning seven decades: fp8 codes down into e4m3's subnormals (below 2**-6), both signs
    key[0, 0, 4] = (torch.logspace(-7, 0, 64) * torch.randn(64, generator=g).sign()).to(dtype)
    key[0, 2, 5, 9] = float("nan")
    key = key.to(DEVICE)[0].transpose(0, 1)               # [T, kv_heads, d], strided
    value = -key * 3
    slots = torch.tensor([17, -1, 95, 0, -1, 40], device=DEVICE)
    expected = [t.cpu().clone() for t in (*caches, *scales)]
    kernels.reference.write_kv(expected[0], expected[1], key.cpu(), value.cpu(), slots.cpu(), expected[2],
                               expected[3])
    kernels.cache.write_kv(caches[0], caches[1], key, value, slots, scales[0], scales[1])
    # Token 5's head 2 holds a NaN: its scales are NaN, as torch's amax makes them (a GPU's max.f32
    # would drop the NaN and store finite codes), so the whole row reads back NaN. The codes a NaN
    # casts to are the platform's (the interpreter's fp8 cast gives 384, a GPU's NaN), so that row
    # is compared by what it reads back; the rest bit for bit.
    at = (40 // 16, 40 % 16, 2)
    got = [t.cpu().clone() for t in (*caches, *scales)]
    got = [t.view(torch.uint8) if t.element_size() == 1 else t for t in got]
    want = [t.view(torch.uint8) if t.element_size() == 1 else t for t in expected]
    for codes, scale in ((got[0], got[2]), (got[1], got[3]), (want[0], want[2]), (want[1], want[3])):
        assert bool((codes[at].view(CODES[kind]).float() * scale[at].float()).isnan().all())
        codes[at], scale[at] = 0, 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert int((scales[0] != 0).sum()) == 4 * 3                     # four rows written, three heads each
    assert float(scales[0][5, 15, 1]) == 2.0 ** -14                  # token 2's head 1 is all zeros


def test_written_then_read_back_the_cache_holds_what_was_written_within_the_code_step(kernels):
    """Round trip through both kernels: one key per sequence, so attention returns its value row,
    which must be within half a code step (scale / 2 for int8) of the value written."""
    key = torch.randn(4, 2, 64, device=DEVICE)
    value = torch.randn(4, 2, 64, device=DEVICE)
    k_cache = torch.zeros(5, 16, 2, 64, dtype=torch.int8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(5, 16, 2, dtype=torch.float16, device=DEVICE)
    v_scale = torch.zeros_like(k_scale)
    slots = torch.tensor([16, 32, 48, 64], device=DEVICE)              # blocks 1..4, first position
    kernels.cache.write_kv(k_cache, v_cache, key, value, slots, k_scale, v_scale)
    out = kernels.attention.paged_attention(
        torch.randn(4, 4, 64, device=DEVICE), k_cache, v_cache, torch.arange(1, 5, device=DEVICE,
                                                                            dtype=torch.int32).view(4, 1),
        torch.ones(4, dtype=torch.int32, device=DEVICE), torch.arange(5, dtype=torch.int32, device=DEVICE), 0.125,
        k_scale=k_scale, v_scale=v_scale)
    step = v_scale[torch.arange(1, 5), 0].float().repeat_interleave(2, 1).unsqueeze(-1)   # [4, heads, 1]
    assert ((out - value.repeat_interleave(2, 1)).abs() <= step / 2 + 1e-6).all()


def test_the_reference_quantizer_is_the_engines(kernels):
    """kernels/reference.py (standalone: torch only) and worker/kv_quant.py define one format."""
    from jupyter_pagedkv.worker.kv_quant import quantize

    x = torch.randn(5, 3, 64) * 10 ** torch.randn(5, 3, 1)
    x[2, 1] = 0
    for kind in CODES:
        ours, theirs = kernels.reference.quantize(x, CODES[kind]), quantize(x, kind)
        assert torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8)) and torch.equal(ours[1], theirs[1])


def test_engine_on_the_triton_backend_with_a_quantized_cache_generates_what_the_torch_backend_does(kernels):
    """Chunked prefill, decode, a prefix hit and a fork (copy-on-write moves codes and scales)
    through the Triton kernels (interpreted on the CPU) against the torch path over the same
    quantized format. fp8 only (~1 min interpreted on a loaded 2-core machine): int8 differs in
    the code conversion alone, which the kernel tests above cover."""
    kind = "fp8_e4m3"
    from conftest import tiny_model
    from jupyter_pagedkv import Engine, SamplingParams

    model = tiny_model("llama", seed=4).to(DEVICE)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(n=2, max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        engine = Engine(model, None, block_size=4, num_blocks=16, max_num_batched_tokens=8,
                        attention_backend=backend, kv_cache_dtype=kind)
        outs[backend] = [[c.token_ids for c in o.outputs] for o in engine.generate(prompts, [params, forked])]
        engine.check_invariants()
        assert engine._runner.backend == backend and engine._runner.kv_cache.k.dtype == CODES[kind]
    assert outs["triton"] == outs["torch"]
