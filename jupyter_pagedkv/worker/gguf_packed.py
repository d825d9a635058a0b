"""A Llama-architecture GGUF file loaded with its weights kept packed (weights="packed").

Why: transformers' GGUF support dequantizes every tensor to fp32 (the embedded 98 MB Q4_1 file
becomes 540 MB); here each projection, the embedding and the (tied) output layer keep the file's
own blocks and compute from them: on the CPU in fp32 through the C++ kernels (quant_linear.py), on
CUDA in the model's dtype through the Triton GEMM (quant_linear_cuda.py). Norms are F32 in the file
and take the model's dtype (fp32 on the CPU), as transformers' dequantized model holds them.

How: the model's skeleton is built from the file's config on the meta device (no fp32 weights are
ever allocated), then every GGUF tensor is put in its module: a supported block type as a
packed layer over a copy of its bytes, F32/F16 as a parameter. Like transformers,
q and k rows are un-permuted (llama.cpp's converter interleaves each head's rotary halves); a row
permutation moves whole rows of blocks, so it is exact on the packed form.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .quant_linear import SUPPORTED, QuantEmbedding, QuantLinear, block_kind, stack_siblings
from .quant_linear_cuda import CudaQuantEmbedding, CudaQuantLinear

ARCHITECTURES = ("llama",)
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_PLAIN = ("F32", "F16")
# Whole-model tensors; rope_freqs: Llama 3.1+ rope scaling as llama.cpp's converter writes it.
_GLOBAL = ("token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight")


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of q/k rows (transformers' reverse_permute_weights)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"


def check_packable(path: Path):
    """The file's header read (no tensor data, no metadata conversion): a GGUF file packed weights
    cannot load is one line naming why and the way out. Returns the reader."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _architecture(reader)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path.name} is a {arch} model; packed weights load {', '.join(ARCHITECTURES)} GGUF "
                         f"files: load it with weights='dense' (--weights dense)")
    for t in reader.tensors:
        if len(t.shape) == 2 and t.tensor_type.name not in _PLAIN:
            block_kind(t.tensor_type.name)        # an unsupported block type: one line naming the supported
        match = _LAYER.match(t.name)
        known = (t.name in _GLOBAL if match is None
                 else match.group(3) == "bias" or match.group(2) in _NORMS or match.group(2) in _PROJECTIONS)
        if not known:
            raise ValueError(f"{path.name}: tensor {t.name} has no place in a Llama model: load it with "
                             f"weights='dense'")
    return reader


def load_packed_model(path: Path, metadata: Path, place: Place | None = None, reader=None):
    """(model, tokenizer) of a Llama-architecture GGUF file, weights packed; `metadata` is a folder
    with the file's config and tokenizer (loader.gguf_metadata_dir); `place` (default: the CPU in
    fp32) where they compute; `reader` the file's `check_packable` reader when the caller already
    has it (opening one parses every metadata array: 2.6 s for the embedded file). Bad input is
    one line."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    place = place or Place()
    reader = reader or check_packable(path)
    config = AutoConfig.from_pretrained(metadata, local_files_only=True)
    config.dtype = place.dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=place.dtype)
    base = model.model
    # The rotary frequencies are a computed buffer: compute them for real.
    base.rotary_emb = type(base.rotary_emb)(config=config)
    tensors = {t.name: t for t in reader.tensors}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, t in tensors.items():
        data = np.array(t.data)                    # a copy: the file's memory map is let go below
        match = _LAYER.match(name)
        if match and match.group(3) == "weight":
            layer = base.layers[int(match.group(1))]
            part = match.group(2)
            if part in _NORMS:
                _set_parameter(layer.get_submodule(_NORMS[part]), "weight", data, place)
                continue
            if part in _PROJECTIONS:
                bias = tensors.get(name[:-6] + "bias")
                bias = None if bias is None else np.array(bias.data, dtype=np.float32)
                if part in ("attn_q", "attn_k"):
                    n = heads if part == "attn_q" else kv_heads
                    data = _unpermute_rows(data, n)
                    bias = None if bias is None else _unpermute_rows(bias, n)
                _set_linear(layer, _PROJECTIONS[part], data, t, bias, place)
                continue
        elif match:
            continue                               # biases are taken with their weight
        elif name == "token_embd.weight":
            base.embed_tokens = _embedding(data, t, place)
        elif name == "output_norm.weight":
            _set_parameter(base.norm, "weight", data, place)
        elif name == "output.weight":
            model.lm_head = _linear(data, t, None, place)
        elif name == "rope_freqs.weight":
            apply_rope_factors(base.rotary_emb, data)
    if "output.weight" not in tensors:             # tied: the output layer reads the embedding's blocks
        model.lm_head = _tied_output(base.embed_tokens, path.name, place)
    del reader, tensors                            # closes the file's memory map
    base.rotary_emb.to(place.device)
    for layer in base.layers if not place.triton else ():   # q/k/v and gate/up: one C++ kernel call each
        attn, mlp = layer.self_attn, layer.mlp
        stack_siblings([attn.q_proj, attn.k_proj, attn.v_proj])
        stack_siblings([mlp.gate_proj, mlp.up_proj])
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise ValueError(f"{path.name} lacks {', '.join(left[:3])}: it is not a complete Llama checkpoint; "
                         f"load it with weights='dense'")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(metadata, local_files_only=True)
    return model, tokenizer


def apply_rope_factors(rotary: nn.Module, factors: np.ndarray) -> None:
    """Divide each rotary frequency by its factor from the file's `rope_freqs` (as llama.cpp does:
    Llama 3.1+ rope scaling). transformers' GGUF loader reads neither the tensor nor the scaling
    keys, so a dense load of such a file rotates with the unscaled frequencies."""
    factors = torch.from_numpy(np.asarray(factors, dtype=np.float32).reshape(-1))   # host: the rotary table is built there
    if factors.shape != rotary.inv_freq.shape:
        raise ValueError(f"rope_freqs holds {factors.numel()} factors for {rotary.inv_freq.numel()} rotary "
                         f"frequencies: load the file with weights='dense'")
    rotary.inv_freq = rotary.inv_freq / factors
    rotary.original_inv_freq = rotary.inv_freq.clone()


@dataclass(frozen=True)
class Place:
    """Where the model's tensors go: the CPU in fp32 with the C++ kernels, or (`triton`) CUDA in
    the model's dtype with the Triton GEMM; `triton` on the CPU runs it under the interpreter."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    triton: bool = False

    def tensor(self, data: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(data.astype(np.float32)).to(self.device, self.dtype)   # host: then moved


def _set_parameter(module: nn.Module, name: str, data: np.ndarray, place: Place) -> None:
    setattr(module, name, nn.Parameter(place.tensor(data), requires_grad=False))


def _linear(data: np.ndarray, t, bias: np.ndarray | None, place: Place) -> nn.Module:
    """A packed layer over the tensor's blocks, or a plain Linear for an F32/F16 tensor."""
    b = None if bias is None else place.tensor(bias)
    if t.tensor_type.name in _PLAIN:
        w = place.tensor(data)
        layer = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=place.device, dtype=place.dtype)
        with torch.no_grad():
            layer.weight.copy_(w)
            if b is not None:
                layer.bias.copy_(b)
        return layer.requires_grad_(False)
    rows = torch.from_numpy(data)   # host: the file's bytes, moved by the layer
    if place.triton:
        return CudaQuantLinear(rows, t.tensor_type.name, int(t.shape[0]), b, place.device, place.dtype)
    return QuantLinear(rows, t.tensor_type.name, int(t.shape[0]), b)


def _set_linear(layer: nn.Module, path: str, data: np.ndarray, t, bias: np.ndarray | None, place: Place) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(layer.get_submodule(parent), leaf, _linear(data, t, bias, place))


def _embedding(data: np.ndarray, t, place: Place) -> nn.Module:
    if t.tensor_type.name in _PLAIN:
        return nn.Embedding.from_pretrained(place.tensor(data), freeze=True)
    rows = torch.from_numpy(data)   # host: the file's bytes, moved by the layer
    if place.triton:
        return CudaQuantEmbedding(rows, t.tensor_type.name, int(t.shape[0]), place.device, place.dtype)
    return QuantEmbedding(rows, t.tensor_type.name, int(t.shape[0]))


def _tied_output(emb: nn.Module, name: str, place: Place) -> nn.Module:
    """The output layer over the embedding's blocks (one copy)."""
    if isinstance(emb, CudaQuantEmbedding):
        return CudaQuantLinear(None, emb.type_name, emb.embedding_dim, None, place.device, place.dtype, share=emb)
    if not isinstance(emb, QuantEmbedding):
        raise ValueError(f"{name}: a tied output layer over an unpacked embedding: use weights='dense'")
    return QuantLinear(emb.blocks, emb.type_name, emb.embedding_dim, already_interleaved=True)


def supported_types() -> str:
    return ", ".join(SUPPORTED)
