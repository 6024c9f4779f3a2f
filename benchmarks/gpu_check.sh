#!/usr/bin/env bash
# GPU check for chatkv's fused paged attention (issue 8), for a machine with one
# NVIDIA GPU and no network; under 8 minutes. Runs the Triton kernel tests on
# CUDA, then times decode attention (benchmarks/gpu_check.py) and a session
# restore from pinned host memory vs re-prefill (benchmarks/gpu_restore.py). The Markdown
# table and the test log go to $OUT when it is set.
#
#   benchmarks/gpu_check.sh            # on the GPU machine
#   benchmarks/gpu_check.sh --dry-run  # same logic on a CPU, tiny shapes, Triton interpreter
#
# Needs torch and triton; pytest for the tests (installed from ./wheels or
# $WHEELS without network if it is missing there). Not SQLAlchemy.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
LOG_DIR="${OUT:-${TMPDIR:-/tmp}}"
mkdir -p "$LOG_DIR"
status=0

if ! "$PY" -c "import pytest" 2>/dev/null; then
    for dir in "${WHEELS:-}" wheels benchmarks/wheels; do
        if [[ -n "$dir" && -d "$dir" ]]; then
            "$PY" -m pip install --quiet --no-index --find-links "$dir" pytest && break
        fi
    done
fi

if [[ "${1:-}" == "--dry-run" ]]; then
    export TRITON_INTERPRET=1
    BENCH_ARGS=(--dry-run)
    RESTORE_ARGS=(--dry-run)
    TEST_TIMEOUT=300
else
    unset TRITON_INTERPRET
    BENCH_ARGS=(--budget-s 220 --flex-budget-s 140)
    RESTORE_ARGS=()
    TEST_TIMEOUT=120
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "no CUDA device visible (use --dry-run on a CPU)"; exit 2; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
fi

echo "== kernel tests (tests/test_triton_kernels.py) =="
if "$PY" -c "import pytest" 2>/dev/null; then
    # --noconftest: the suite's conftest may import parts (the index) this machine lacks.
    timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider --noconftest \
        tests/test_triton_kernels.py 2>&1 | tee "$LOG_DIR/gpu_check_tests.log"
    test_rc=${PIPESTATUS[0]}
    echo "pytest exit code: $test_rc"
    [[ $test_rc -eq 0 ]] || status=1
else
    echo "pytest unavailable (no wheel found): kernel tests NOT run"
    status=1
fi

echo "== decode attention timing (benchmarks/gpu_check.py) =="
timeout 290 "$PY" benchmarks/gpu_check.py "${BENCH_ARGS[@]}" || status=1

echo "== session restore from pinned host memory vs re-prefill (benchmarks/gpu_restore.py) =="
timeout 120 "$PY" benchmarks/gpu_restore.py "${RESTORE_ARGS[@]}" || status=1
exit $status
