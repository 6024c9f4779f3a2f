#!/usr/bin/env bash
# GPU check for chatkv, for a machine with one NVIDIA GPU and no network; at most
# 16 minutes (the sum of its timeouts), about 6 on an H200. In order:
#   1. the CUDA tests: the Triton kernels (tests/test_triton_kernels.py), a model
#      through them, decode steps replayed from CUDA graphs (tests/test_cuda_graphs.py),
#      pinned offload and quantization on CUDA;
#   2. decode steps per batch size, CUDA graphs against the model run as it is
#      (benchmarks/decode_batch.py, SmolLM2-135M's shape with random weights);
#   3. decode attention against copy bandwidth up to 32k context (benchmarks/gpu_check.py);
#   4. a session restore from pinned host memory vs re-prefill (benchmarks/gpu_restore.py),
#      and from disk: restore or recompute, as each session's choice (benchmarks/restore_choice.py);
#   5. the engine-level test files whose engines default to the GPU when there is
#      one (chats, persistence, tiers, editing, context policies, the scheduler).
# Tables and logs go to $OUT when it is set.
#
#   benchmarks/gpu_check.sh            # on the GPU machine
#   benchmarks/gpu_check.sh --dry-run  # steps 1, 3, 4 on a CPU: tiny shapes, Triton interpreter
#
# Needs torch and triton. Packages missing there (pytest, SQLAlchemy,
# platformdirs) are installed without network from the wheels in $WHEELS,
# ./.whl, ./wheels or benchmarks/wheels; chatkv itself is installed from this
# checkout into a scratch folder when it is not installed (its storage/ folder
# installs as chatkv.storage, so the checkout alone does not import).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LOG_DIR="${OUT:-${TMPDIR:-/tmp}}"
SITE="${TMPDIR:-/tmp}/chatkv-gpu-site"
mkdir -p "$LOG_DIR" "$SITE"
# The scratch folder first (chatkv installed there, when it is), then the checkout (for `benchmarks`).
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CHATKV_HOME="${TMPDIR:-/tmp}/chatkv-gpu-home" CHATKV_MODEL_CACHE="${TMPDIR:-/tmp}/chatkv-gpu-models"
status=0

for module in pytest sqlalchemy platformdirs; do
    "$PY" -c "import $module" 2>/dev/null && continue
    for dir in "${WHEELS:-}" .whl wheels benchmarks/wheels; do
        if [[ -n "$dir" && -d "$dir" ]] && ls "$dir"/*.whl >/dev/null 2>&1; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --find-links "$dir" \
                "$module" && break
        fi
    done
    "$PY" -c "import $module" 2>/dev/null || echo "$module: not installed (no wheel found)"
done
if ! "$PY" -P -c "import chatkv.storage" 2>/dev/null; then
    # From the checkout (needs setuptools there), else from a chatkv wheel built from it.
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . \
        || "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            --find-links "${WHEELS:-.whl}" chatkv \
        || { echo "installing chatkv from this checkout failed"; status=1; }
fi

if [[ "${1:-}" == "--dry-run" ]]; then
    export TRITON_INTERPRET=1
    DRY=(--dry-run)
    TEST_TIMEOUT=600
else
    unset TRITON_INTERPRET
    DRY=()
    TEST_TIMEOUT=200
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "no CUDA device visible (use --dry-run on a CPU)"; exit 2; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
fi

echo "== 1. CUDA tests =="
# -P: the checkout's folder is not put first on sys.path, so the installed chatkv is the one imported.
timeout "$TEST_TIMEOUT" "$PY" -P -m pytest -q -p no:cacheprovider \
    tests/test_triton_kernels.py tests/test_cuda_graphs.py \
    "tests/test_attention.py::test_model_through_the_triton_backend_matches_stock" \
    tests/test_tiers.py::test_cuda_offload_uses_pinned_memory_and_round_trips \
    tests/test_quant.py::test_cuda_matches_cpu 2>&1 | tee "$LOG_DIR/gpu_check_tests.log"
test_rc=${PIPESTATUS[0]}
echo "pytest exit code: $test_rc"
[[ $test_rc -eq 0 ]] || status=1

if [[ "${1:-}" != "--dry-run" ]]; then
    echo "== 2. decode steps, CUDA graphs against the model as it is (benchmarks/decode_batch.py) =="
    timeout 150 "$PY" -P -m benchmarks.decode_batch --device cuda --model random:smollm2 \
        --batches 1,2,3,4,8,16,32 --graphs 1,2,4,8,16 --context 1000 --steps 40 --skip 10 \
        --out "$LOG_DIR/decode_batch.json" 2>&1 | tee "$LOG_DIR/decode_batch.md" || status=1
fi

echo "== 3. decode attention against copy bandwidth (benchmarks/gpu_check.py) =="
if [[ "${1:-}" == "--dry-run" ]]; then
    timeout 290 "$PY" benchmarks/gpu_check.py --dry-run || status=1
else
    timeout 170 "$PY" benchmarks/gpu_check.py --budget-s 100 --flex-budget-s 50 \
        --batches 1,4,16,64 --contexts 1024,8192,32768 || status=1
fi

echo "== 4. session restore from pinned host memory vs re-prefill (benchmarks/gpu_restore.py) =="
timeout 150 "$PY" benchmarks/gpu_restore.py "${DRY[@]}" || status=1
if [[ "${1:-}" != "--dry-run" ]]; then  # restore or recompute from disk, chosen per session on the GPU
    timeout 120 "$PY" -P -m benchmarks.restore_choice --device cuda --model random:smollm2 \
        --tokens 256,1024,4096,8000 --repeats 3 --out "$LOG_DIR/restore_choice.json" || status=1
fi

if [[ "${1:-}" != "--dry-run" ]]; then  # on a CPU these run in the test suite itself
    echo "== 5. engine-level tests, engines on the GPU by default =="
    timeout 150 "$PY" -P -m pytest -q -p no:cacheprovider -m "not smollm2" --maxfail=20 \
        tests/test_chat.py tests/test_persistence.py tests/test_tiers.py tests/test_editing.py \
        tests/test_context.py tests/test_sink.py tests/test_scheduler.py tests/test_streaming_and_sampling.py \
        2>&1 | tee "$LOG_DIR/gpu_check_engine_tests.log" | tail -40
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
exit $status
