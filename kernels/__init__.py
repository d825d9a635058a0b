"""Triton kernels for jupyter-pagedkv: paged attention (prefill + decode, split-K) and cache ops.

Installed as `jupyter_pagedkv_kernels` (the directory is `kernels/` in the repository; `kernels`
itself is another project's name on the package index). Import the submodules explicitly:

    from jupyter_pagedkv_kernels.paged_attention import paged_attention
    from jupyter_pagedkv_kernels.cache_ops import write_kv, copy_blocks, swap_blocks

This file imports nothing, so importing the package does not import Triton: a caller (the CPU
tests, `bench --smoke`) can still switch on Triton's interpreter (TRITON_INTERPRET=1) before the
first kernel module is loaded.
"""

__all__ = ["bench", "cache_ops", "paged_attention", "reference"]
