"""Causal prefill attention on the CPU in C++ (prefill_attention.cpp): when it serves, and its calls.

Why: a long prompt's prefill is mostly attention (at 2,048 tokens about half of it in bf16, more
at 8k), and torch's CPU flash kernel computes its scores through MKL, which on AMD CPUs runs its
generic code path, and in bf16 at fp32 speed. The C++ kernel tiles the scores in registers with
AVX-512 FMAs (fp32) or VDPBF16PS (bf16 pairs summed in fp32), stacks the query heads that share a
KV head (GQA) so each key is read once for all of them, and reads keys and values where they lie
(the cache's blocks, or this step's projections). One layer of the embedded model, 2,048 tokens,
2 threads: fp32 30 ms against SDPA's 45 ms, bf16 18 ms against 45 ms (docs/benchmarks.md).

What it serves: fp32 on AVX-512 CPUs, bf16 on AVX-512 BF16 ones (Zen 4, Sapphire Rapids and
later), head sizes 64 and 128, no logit soft-capping; sliding windows yes. Anything else keeps
torch's SDPA (attention.py). Sums are in float32 in another order than SDPA's, so outputs agree
with it to float32 rounding, not bit for bit; exactness is checked against transformers.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .native_build import LazyModule, NativeBuildError
from .native_switch import native_disabled


SOURCE = Path(__file__).with_name("prefill_attention.cpp")
MODES = ("auto", "native", "torch")
HEAD_SIZES = (64, 128)
# OpenMP: at::parallel_for, a header template, splits work only where the extension is built with it.
_KERNEL = LazyModule("jupyter_pagedkv_prefill_attention", SOURCE, "the C++ prefill attention kernel",
                     "prefill_attention='torch'", ["-O3", "-fopenmp"], ["-fopenmp"])


def load_kernel():
    """The compiled module (built on first use, cached by torch for later processes); raises
    NativeBuildError with one line on why not."""
    return _KERNEL.load()


def plan(mode: str, device: torch.device, backend: str, dtype: torch.dtype, head_dim: int | None):
    """(the kernel module or None, a phrase for the engine's description). 'native' raises
    instead of falling back; 'torch' always takes SDPA."""
    if mode not in MODES:
        raise ValueError(f"prefill_attention must be 'auto', 'native' or 'torch', got {mode!r}")
    if mode == "torch":
        return None, "prefill attention by torch's SDPA"
    problem = native_disabled() or _problem(device, backend, dtype, head_dim)
    module = None
    if problem is None:
        try:
            module = load_kernel()
            if not module.supports(torch.empty(0, dtype=dtype)):  # host: a CPU kernel's dtype probe
                problem = f"this CPU lacks AVX-512{' BF16' if dtype == torch.bfloat16 else ''}"
        except NativeBuildError as err:
            problem = str(err)
    if problem is not None:
        if mode == "native":
            raise ValueError(f"prefill_attention='native' cannot run here: {problem}; use 'auto' or 'torch'")
        return None, f"prefill attention by torch's SDPA ({problem})"
    return module, "prefill attention in C++ (prefill_attention.cpp)"


def _problem(device: torch.device, backend: str, dtype: torch.dtype, head_dim: int | None) -> str | None:
    if device.type != "cpu" or backend != "torch":
        return "the kernel is for the CPU's torch backend"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the kernel serves float32 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    if head_dim not in HEAD_SIZES:
        return f"the kernel serves head sizes 64 and 128, not {head_dim}"
    return None


def attend(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int,
           window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`q [n, heads, d]` over `k/v [L, kv_heads, d]`: query i sees key j when j <= i + offset
    (and j > i + offset - window). Returns (out [n, heads, d], lse [heads, n] float32)."""
    return module.attend(q, k, v, scale, offset, window or 0)
