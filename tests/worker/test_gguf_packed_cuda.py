"""weights="packed" on CUDA with real GGUF files: the embedded model loaded into the Triton layers
(worker/quant_linear_cuda.py, kernels/quant_matmul.py) against gguf-py's dequantization and
transformers' dequantized model, in Triton's interpreter here (`PAGEDKV_KERNEL_TEST_DEVICE=cuda`:
natively). The kernel alone: test_quant_matmul.py, which also runs on the GPU image (no gguf there)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from jupyter_pagedkv.worker.kernels_bridge import kernel_module  # noqa: E402

DEVICE = torch.device(os.environ.get("PAGEDKV_KERNEL_TEST_DEVICE", "cpu"))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_split_blocks_dequantize_as_gguf_py_does(type_name):
    qm = kernel_module("quant_matmul")
    qtype = gguf.GGMLQuantizationType[type_name]
    w = np.random.default_rng(0).standard_normal((40, 96)).astype(np.float32)
    rows = gguf.quants.quantize(w, qtype)
    codes, scales, mins = qm.split_blocks(torch.from_numpy(rows.copy()), type_name)
    assert torch.equal(qm.dequantize(codes, scales, mins, type_name),
                       torch.from_numpy(gguf.quants.dequantize(rows, qtype).astype(np.float32)))


@pytest.fixture(scope="module")
def embedded_for_cuda():
    """The embedded GGUF loaded as a GPU would load it (Triton layers), here on the CPU in fp32."""
    from jupyter_pagedkv.worker.gguf_packed import Place, load_packed_model
    from jupyter_pagedkv.worker.loader import embedded_gguf, gguf_metadata_dir
    path = embedded_gguf()
    return load_packed_model(path, gguf_metadata_dir(path), Place(DEVICE, torch.float32, triton=True))


@pytest.mark.slow
def test_the_embedded_gguf_loads_into_triton_layers_equal_to_transformers_dequantized_model(embedded_for_cuda, embedded):
    """Every projection a CudaQuantLinear, the tied output layer reading the embedding's own
    tensors; weights, embedding rows and two layers' hidden states against transformers'
    dequantized fp32 model (a whole forward takes ~2 minutes in the interpreter)."""
    from jupyter_pagedkv.worker.quant_linear import describe_blocks, logical_parameters
    from jupyter_pagedkv.worker.quant_linear_cuda import CudaQuantEmbedding, CudaQuantLinear
    model, tokenizer = embedded_for_cuda
    reference, _ = embedded
    ours_base, ref_base = model.model, reference.model
    layer = ours_base.layers[0]
    assert all(isinstance(m, CudaQuantLinear) for m in (layer.self_attn.q_proj, layer.mlp.down_proj, model.lm_head))
    assert isinstance(ours_base.embed_tokens, CudaQuantEmbedding)
    assert model.lm_head.codes is ours_base.embed_tokens.codes                       # tied: one copy
    assert torch.equal(model.lm_head.dequantized().cpu(), reference.lm_head.weight)
    assert torch.equal(layer.mlp.gate_proj.dequantized().cpu(), ref_base.layers[0].mlp.gate_proj.weight)
    assert logical_parameters(model)[0] == sum(p.numel() for p in reference.parameters())
    assert describe_blocks(model).startswith("weights in GGUF blocks (Q4_1, Q8_0; ")
    ids = torch.tensor([tokenizer("The capital of France is").input_ids])
    with torch.inference_mode():
        assert torch.equal(ours_base.embed_tokens(ids.to(DEVICE)).cpu(), ref_base.embed_tokens(ids))
        hidden = {}
        for name, base, where in (("ours", ours_base, DEVICE), ("ref", ref_base, torch.device("cpu"))):
            h = base.embed_tokens(ids.to(where))
            position_ids = torch.arange(ids.shape[1], device=where).unsqueeze(0)
            cos_sin = base.rotary_emb(h, position_ids)
            for block in base.layers[:2]:
                h = block(h, position_embeddings=cos_sin, position_ids=position_ids)
                h = h[0] if isinstance(h, tuple) else h
            hidden[name] = h.cpu()
    torch.testing.assert_close(hidden["ours"], hidden["ref"], rtol=1e-5, atol=1e-4)
