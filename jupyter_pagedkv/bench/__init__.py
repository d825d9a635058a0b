"""Benchmarks: `python -m jupyter_pagedkv.bench {throughput,kernels}`; ratios against peers run
in the same process (or, for vLLM, the same command), never absolute targets in unit tests."""
