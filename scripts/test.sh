#!/usr/bin/env bash
# Set up (or reuse) the venv, then run the whole test suite on the CPU. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. "${LLMTUNE_VENV:-$PWD/.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q -m "not gpu" "$@"
