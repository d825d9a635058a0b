"""weights="packed" on CUDA: GGUF blocks through the Triton GEMM (kernels/quant_matmul.py) and the
CUDA packed layers (worker/quant_linear_cuda.py), run here in Triton's interpreter on CPU tensors
(`PAGEDKV_KERNEL_TEST_DEVICE=cuda`: natively on a GPU; docs/kernels.md has the command), against
the blocks' values by the format's definition (testing/gguf_blocks.py: the GPU image has no gguf
package). gguf-py's own files and transformers' dequantized model: test_gguf_packed_cuda.py.

Tolerances, and why. Each weight the kernel builds is exact in fp32 (an fp16 scale times a 4- or
8-bit code), rounded to the activations' dtype as the dequantized model holds it; only the GEMM's
summation order differs from torch's: fp32 (IEEE products) ~1e-6 relative, hence 1e-4 on unit
data; bf16 / fp16 outputs round once more at the end, so one unit in the last place of the
output's dtype (rtol 2^-7 / 2^-10)."""
from __future__ import annotations

import os

import pytest
import torch

from jupyter_pagedkv.worker.kernels_bridge import kernel_module

DEVICE = torch.device(os.environ.get("PAGEDKV_KERNEL_TEST_DEVICE", "cpu"))
TYPES = ("Q4_0", "Q4_1", "Q8_0")
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
ATOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def qm():
    return kernel_module("quant_matmul")


def file_rows(shape: tuple[int, int], type_name: str, seed: int = 0):
    """(valid GGUF rows of blocks of a random weight, the fp32 weight they stand for, computed from
    the codes by the format's definition: testing/gguf_blocks.quantize, not the kernels' module)."""
    from jupyter_pagedkv.testing.gguf_blocks import quantize
    return quantize(torch.randn(shape, generator=torch.Generator().manual_seed(seed)), type_name)


@pytest.mark.parametrize("type_name", TYPES)
def test_split_blocks_keep_the_files_bytes_and_dequantize_by_the_format(qm, type_name):
    rows, plain = file_rows((40, 96), type_name)
    codes, scales, mins = qm.split_blocks(rows, type_name)
    assert codes.nbytes + scales.nbytes + mins.nbytes == rows.nbytes          # moved, nothing added
    assert torch.equal(qm.dequantize(codes, scales, mins, type_name), plain)  # bit for bit
    assert (codes.dtype, scales.dtype) == (torch.int8 if type_name == "Q8_0" else torch.uint8, torch.int16)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [3, 40])
def test_the_kernel_equals_the_dequantized_weights_gemm(qm, type_name, dtype, rows):
    """72 outputs and 96 inputs: a partial tile of features and of inputs (64 + 32) both ways."""
    blocks, plain = file_rows((72, 96), type_name, seed=rows)
    codes, scales, mins = (t.to(DEVICE) for t in qm.split_blocks(blocks, type_name))
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    bias = torch.randn(72, generator=g).to(dtype)
    for b in (None, bias):
        out = qm.quant_matmul(x.to(DEVICE), codes, scales, mins, type_name, None if b is None else b.to(DEVICE)).cpu()
        want = x.float() @ plain.to(dtype).float().T + (0 if b is None else b.float())
        assert out.dtype == dtype and out.shape == (rows, 72)
        torch.testing.assert_close(out.float(), want.to(dtype).float(), rtol=RTOL[dtype], atol=ATOL[dtype])
    strided = torch.randn(rows, 2, 96, generator=g).to(dtype)[:, 0]        # rows 192 apart: read in place
    torch.testing.assert_close(qm.quant_matmul(strided.to(DEVICE), codes, scales, mins, type_name).cpu().float(),
                               (strided.float() @ plain.to(dtype).float().T).to(dtype).float(),
                               rtol=RTOL[dtype], atol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_gpus_tiles_compute_the_same_at_ragged_shapes(qm, dtype):
    """The tiles a GPU launches (fp32: 16 x 32 x 32; fp16: 16 or 64 rows x 64 x 64), run here too:
    rows, features and inputs off every tile edge, with a bias. (bf16 needs the interpreter's fp32
    operands, so the GPU's bf16 launch cannot run here; it shares every index with fp16.)"""
    g = torch.Generator().manual_seed(3)
    for type_name, m, n, k in (("Q4_1", 1, 5, 32), ("Q4_0", 17, 130, 160), ("Q8_0", 65, 72, 96)):
        blocks, plain = file_rows((n, k), type_name, seed=m)
        codes, scales, mins = (t.to(DEVICE) for t in qm.split_blocks(blocks, type_name))
        x = torch.randn(m, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        out = torch.empty(m, n, dtype=dtype, device=DEVICE)
        qm.quant_matmul_launch(x.to(DEVICE), codes, scales, mins, type_name, bias.to(DEVICE), out,
                               interpreted=False).run()
        want = (x.float() @ plain.to(dtype).float().T + bias.float()).to(dtype)
        torch.testing.assert_close(out.cpu().float(), want.float(), rtol=RTOL[dtype], atol=ATOL[dtype])


def test_a_type_or_shape_it_cannot_compute_is_one_line(qm):
    rows, _ = file_rows((8, 64), "Q4_1")
    with pytest.raises(ValueError, match=r"^GGUF blocks on CUDA: Q4_0, Q4_1, Q8_0, not Q6_K: load with weights='dense'$"):
        qm.split_blocks(rows, "Q6_K")
    codes, scales, mins = qm.split_blocks(rows, "Q4_1")
    with pytest.raises(ValueError, match="blocks of 64 inputs"):
        qm.quant_matmul(torch.randn(2, 96), codes, scales, mins, "Q4_1")


def test_bf16_layers_hold_the_dequantized_models_bf16_values():
    """On a GPU the activations are bf16: the kernel rounds each weight to bf16 as transformers'
    dequantized bf16 model stores it, and norms and embedding rows are that model's."""
    from jupyter_pagedkv.worker.quant_linear_cuda import CudaQuantEmbedding, CudaQuantLinear
    rows, plain = file_rows((64, 128), "Q4_1")
    layer = CudaQuantLinear(rows, "Q4_1", 128, None, DEVICE, torch.bfloat16)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    torch.testing.assert_close(layer(x.to(DEVICE)).cpu().float(), (x.float() @ plain.to(torch.bfloat16).float().T).to(torch.bfloat16).float(),
                               rtol=RTOL[torch.bfloat16], atol=ATOL[torch.bfloat16])
    table = CudaQuantEmbedding(rows, "Q4_1", 128, DEVICE, torch.bfloat16)
    ids = torch.tensor([[3, 0, 63]])
    assert torch.equal(table(ids.to(DEVICE)).cpu(), plain.to(torch.bfloat16)[ids])
    before = layer(x.to(DEVICE))
    layer.to(torch.float16)          # what a user's model.half() does: the blocks' scales are bits, not re-rounded
    assert torch.equal(layer(x.to(DEVICE)), before)
    with pytest.raises(RuntimeError, match=f"blocks are on {DEVICE.type}.*; it got an input on meta"):
        layer(torch.empty(2, 128, device="meta"))


@pytest.mark.parametrize("arch, type_name", [("llama", "Q4_1"), ("llama", "Q8_0"), ("qwen2", "Q4_0")])  # qwen2: q/k/v biases
def test_an_engine_on_packed_layers_equals_transformers_on_their_dense_twin(arch, type_name, make_engine):
    """A whole engine (Triton attention, the packed layers in every projection and the output
    layer) against transformers' generate on the same model holding the blocks' values densely:
    fp32, so token-identical but for a near-tie (the oracle's top-2 gap under 1e-3)."""
    from conftest import compare_with_oracle, hf_greedy, tiny_model
    from jupyter_pagedkv import SamplingParams
    from jupyter_pagedkv.testing.gguf_blocks import packed_twins
    from jupyter_pagedkv.testing.models import random_prompts
    dense, packed = packed_twins(tiny_model(arch).to(DEVICE), type_name)
    engine = make_engine(packed, attention_backend="triton", pack_weights=False, kv_cache_memory="8MiB")
    assert f"weights in GGUF blocks ({type_name}; " in engine.info().summary
    prompts = random_prompts(3, 256, seed=5, lo=2, hi=24)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.check_invariants()
    for prompt, out in zip(prompts, outs):
        found = compare_with_oracle(dense, prompt, out.token_ids, hf_greedy(dense, prompt, 8, stop_at_eos=False))
        assert found.identical or found.near_tie(1e-3), found
