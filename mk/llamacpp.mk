# llama.cpp as a peer for `bench single` (included from the main Makefile).
# Its own venv, .venv-llamacpp: llama-cpp-python is built from source (its sdist vendors
# llama.cpp) with the host's compiler, so it uses this CPU's ISA. Kept apart from mk/peers.mk
# because editing that file makes vLLM's stamp stale (a 3.5 min rebuild).
# `make bench-llamacpp` builds it once (stamp: .venv-llamacpp/.ok); ~10-20 min on 2 busy cores.

LLAMACPP_MK := $(lastword $(MAKEFILE_LIST))
LLAMACPP_PY ?= python3
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_BIN := $(LLAMACPP_VENV)/bin
LLAMACPP_PKG := llama-cpp-python==0.3.36
# CPU only; GGML_NATIVE builds for the host's ISA (what llama.cpp's users get by default).
# Without AMX tiles: on our Xeons (AMX listed in /proc/cpuinfo) ggml's AMX matmul died of a general
# protection fault at its first ldtilecfg, so no run could finish; one-row decode does not use the
# tiles' matrix shapes anyway. GCC lets explicit -mno-* flags win over -march=native's.
# --no-cache-dir below: pip would otherwise reuse a wheel built earlier with other CMAKE_ARGS.
LLAMACPP_CFLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMACPP_CMAKE := -DCMAKE_C_FLAGS="$(LLAMACPP_CFLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMACPP_CFLAGS)" -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF

.PHONY: bench-llamacpp

bench-llamacpp: $(LLAMACPP_VENV)/.ok

# A half-built venv (no stamp) is discarded and rebuilt from scratch.
$(LLAMACPP_VENV)/.ok: $(LLAMACPP_MK)
	rm -rf $(LLAMACPP_VENV)
	$(LLAMACPP_PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_BIN)/pip install -q --upgrade pip
	CMAKE_ARGS='$(LLAMACPP_CMAKE)' CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(LLAMACPP_BIN)/pip install -q --no-cache-dir --no-binary llama-cpp-python $(LLAMACPP_PKG)
	$(LLAMACPP_BIN)/python -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())'
	touch $@
