#!/usr/bin/env bash
# One GPU session, one script: the kernel tests natively on CUDA (no interpreter), then the full
# decode benchmark. Sized to finish in under 10 minutes on an H200 (first-launch compiles included).
# Run from anywhere: `bash kernels/gpu_check.sh`; with $OUT set, the logs are also written there.
# Needs only what the GPU image has (torch, triton, transformers, pytest); nothing is downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET JUPYTER_PAGEDKV_BACKEND
LOGS="${OUT:-/tmp}"
PY="${PYTHON:-python3}"

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
"$PY" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name())"

echo "== kernel tests on CUDA (budget 180 s)"
PAGEDKV_KERNEL_TEST_DEVICE=cuda timeout 180 "$PY" -m pytest -q -p no:cacheprovider --durations=5 \
    tests/test_kernels.py 2>&1 | tee "$LOGS/kernel_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== engine exactness on CUDA, Triton and torch backends (budget 120 s)"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_exactness.py 2>&1 | tee "$LOGS/exactness.log"
exact_rc=${PIPESTATUS[0]}
tests_rc=$(( tests_rc != 0 || exact_rc != 0 ))

echo "== decode benchmark (budget 270 s)"
timeout 270 "$PY" -m jupyter_pagedkv.kernels_bridge 2>&1 | tee "$LOGS/kernel_bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== done: tests rc=$tests_rc, bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
