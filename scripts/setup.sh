#!/usr/bin/env bash
# Create .venv (once) and install pipeshard with its test extras. Idempotent and quiet.
# torch is pinned to the CPU build first so that no multi-GB CUDA wheel is pulled in;
# on a GPU machine install the CUDA torch you want before running this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.pipeshard-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==${PIPESHARD_TORCH_VERSION:-2.13.0}"
  fi
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
