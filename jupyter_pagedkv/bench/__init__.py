"""Benchmarks: `python -m jupyter_pagedkv.bench NAME` (NAME --help for each); ratios against peers
run in the same process (or, for vLLM, the same command), never absolute targets in unit tests.
Command lines only: what they share with the tests lives in `testing` (models, the oracle, the
peers, the soak), `sim` (the tail sweep's and the tenant comparison's readings) and `gpucheck`
(`bench gpu`, `bench architectures`)."""
