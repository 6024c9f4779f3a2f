#!/usr/bin/env bash
# The test suite. Triton kernels run on the CPU through Triton's interpreter;
# CUDA-only tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=${TRITON_INTERPRET:-$(python3 -c 'import torch; print(0 if torch.cuda.is_available() else 1)')}
exec python3 -m pytest -q "$@"
