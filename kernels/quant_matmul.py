"""GGUF block weights on CUDA: `x @ W^T` with W kept as Q4_0 / Q4_1 / Q8_0 blocks, dequantized
tile by tile in registers (weights="packed" on a GPU; the CPU computes them in C++, worker/quant_gemm.cpp).

Layout. A GGUF row is a run of blocks of 32 weights: an fp16 scale d (Q4_1 also an fp16 minimum
m) then the quants (Q4: 16 bytes, weight j in the low nibble of byte j and weight j + 16 in its
high nibble; Q8_0: 32 int8). `split_blocks` makes three plain tensors of one row's blocks at load:
`codes` (uint8 [N, K / 2] for Q4, int8 [N, K] for Q8_0), `scales` and `mins` (the fp16 values'
bits as int16 [N, K / 32], so that `model.to(dtype)` cannot re-round them as it would float
buffers; `mins` empty but for Q4_1), so a tile's loads are contiguous; the bytes are the file's, moved.

Values. A weight is d * (q - 8) (Q4_0), d * q + m (Q4_1) or d * q (Q8_0), computed in fp32: d
has 11 significant bits and q at most 8, so every product is exact in fp32 and each weight is
exactly what gguf-py's dequantization gives before the model's dtype rounds it; the tile is then
rounded to the activations' dtype (as transformers' dequantized model holds its weights) and
multiplied on the tensor cores with fp32 accumulation (fp32 activations: IEEE products).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import KernelLaunch
from .tiles import interpreting

# GGML type -> (kernel's KIND, bytes per block of 32 weights, header bytes before the quants)
BLOCKS = {"Q4_0": (0, 18, 2), "Q4_1": (1, 20, 4), "Q8_0": (2, 34, 2)}


def split_blocks(rows: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF tensor's rows (uint8 [N, K / 32 * bytes per block]) as (codes, scales, mins)."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGUF blocks on CUDA: {', '.join(BLOCKS)}, not {type_name}: load with weights='dense'")
    kind, size, head = BLOCKS[type_name]
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, size)
    scales = blocks[..., 0:2].contiguous().view(torch.int16).reshape(n, -1)        # fp16 bits
    mins = (blocks[..., 2:4].contiguous().view(torch.int16).reshape(n, -1) if kind == 1
            else scales.new_empty(0))
    codes = blocks[..., head:].reshape(n, -1)
    return codes.contiguous().view(torch.int8) if kind == 2 else codes.contiguous(), scales, mins


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, type_name: str) -> torch.Tensor:
    """The fp32 [N, K] weight the blocks stand for, in torch (the kernel's reference, and the
    embedding's row lookup)."""
    kind = BLOCKS[type_name][0]
    n = codes.shape[0]
    if kind == 2:
        q = codes.float().reshape(n, -1, 32)
    else:
        b = codes.reshape(n, -1, 16)
        q = torch.cat([b & 15, b >> 4], dim=-1).float()         # weights j and j + 16 of each block
    w = scales.view(torch.float16).float().unsqueeze(-1) * (q - 8 if kind == 0 else q)
    if kind == 1:
        w = w + mins.view(torch.float16).float().unsqueeze(-1)
    return w.reshape(n, -1)


@triton.jit
def _round_to_bf16(v):
    """fp32 values rounded to the nearest bf16 (ties to even), still fp32: the cast after it is
    exact everywhere (the GPU's conversion rounds so too; the interpreter's truncates)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M"])   # the step's row count: one compiled kernel per tile, not per M
def _quant_matmul(x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_out,
                  KIND: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr):
    """out[M, N] = x[M, K] @ dequantize(blocks)[N, K]^T (+ bias); one program per (M, N) tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rn64 = rn.to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)          # K is a multiple of 32, BLOCK_K of 32: tiles hold whole blocks
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        if KIND == 2:
            q = tl.load(codes_ptr + rn64[None, :] * K + rk[:, None], mask=w_ok, other=0).to(tl.float32)
        else:
            byte = tl.load(codes_ptr + rn64[None, :] * (K // 2) + ((rk // 32) * 16 + rk % 16)[:, None],
                           mask=w_ok, other=0).to(tl.int32)
            q = tl.where((rk % 32 >= 16)[:, None], byte >> 4, byte & 15).to(tl.float32)
        block = rn64[None, :] * (K // 32) + (rk // 32)[:, None]
        d = tl.load(scales_ptr + block, mask=w_ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        if KIND == 0:
            w = d * (q - 8.0)
        elif KIND == 1:
            w = d * q + tl.load(mins_ptr + block, mask=w_ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            w = d * q
        if x.dtype == tl.bfloat16:
            w = _round_to_bf16(w)
        w = w.to(x.dtype)                         # the model dtype's weight, as transformers holds it
        if DOT_FP32:    # the interpreter's tl.dot mishandles bf16: the same values as fp32 operands
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        acc = _round_to_bf16(acc)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_out + rn[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


def tiles(rows: int, elem_size: int, interpreted: bool | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): a decode batch's few rows take the 16-row tile
    (tl.dot's least), a prefill's 64 rows; fp32 (IEEE products on CUDA cores) 16 rows over 32
    features and 32 inputs: the compile check found its 16 x 64 x 64 tile spilling 250-440 bytes
    per thread on sm_80 and sm_90. The interpreter takes the largest tiles (fewer programs, each
    one numpy pass)."""
    if interpreted is None:
        interpreted = interpreting()
    if interpreted:
        return 16 if rows <= 16 else 64, 64, 64, 4
    if elem_size > 2:
        return 16, 32, 32, 4
    if rows <= 16:
        return 16, 64, 64, 4
    return 64, 64, 64, 4


def quant_matmul_launch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                        type_name: str, bias: torch.Tensor | None, out: torch.Tensor, *,
                        interpreted: bool | None = None) -> KernelLaunch:
    """The launch for x [M, K] (contiguous rows) into out [M, N], as `quant_matmul` runs it."""
    kind = BLOCKS[type_name][0]
    if interpreted is None:
        interpreted = interpreting()
    m, k = x.shape
    n = scales.shape[0]
    block_m, block_n, block_k, warps = tiles(m, x.element_size(), interpreted)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    return KernelLaunch(_quant_matmul, grid,
                        (x, codes, scales, mins if mins.numel() else scales, bias if bias is not None else scales,
                         out, m, n, k, x.stride(0), out.stride(0)),
                        dict(KIND=kind, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                             BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
                             DOT_FP32=interpreted and x.dtype != torch.float32),
                        dict(num_warps=warps))


def quant_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 type_name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W given as `split_blocks`' tensors."""
    k = x.shape[-1]
    if k % 32 or codes.shape[0] != scales.shape[0] or scales.shape[1] * 32 != k:
        raise ValueError(f"blocks of {scales.shape[1] * 32} inputs (a multiple of 32) for an input of {k}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], scales.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        quant_matmul_launch(rows, codes, scales, mins, type_name, bias, out).run()
    return out.reshape(*x.shape[:-1], scales.shape[0])


def variant_launches(device: torch.device | str = "meta", *, interpreted: bool | None = False) -> list[KernelLaunch]:
    """Every compiled variant packed weights can hit, on dummy tensors: each block type x the
    activations' dtype x the decode and prefill tiles, with and without a bias (Qwen2's q/k/v)."""
    launches = []
    k, n = 64, 64
    for type_name, (kind, _, _) in BLOCKS.items():
        codes = torch.empty(n, k if kind == 2 else k // 2, dtype=torch.int8 if kind == 2 else torch.uint8, device=device)
        scales = torch.empty(n, k // 32, dtype=torch.int16, device=device)
        mins = scales if kind == 1 else scales.new_empty(0)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for rows in (2, 100):     # M is not specialised: these stand for every decode and prefill count
                for bias in (None, torch.empty(n, dtype=dtype, device=device)):
                    x = torch.empty(rows, k, dtype=dtype, device=device)
                    out = torch.empty(rows, n, dtype=dtype, device=device)
                    launches.append(quant_matmul_launch(x, codes, scales, mins, type_name, bias, out,
                                                        interpreted=interpreted))
    return launches
