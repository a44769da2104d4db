#!/usr/bin/env bash
# Set up (or reuse) the venv, then run the whole test suite on the CPU. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. "${LLMTUNE_VENV:-$PWD/.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the rollout engine tests (tests/integration/test_vllm_engine.py) run against this real vLLM (skipped without it)
VVENV="${LLMTUNE_VLLM_VENV:-$(dirname "${LLMTUNE_VENV:-$PWD/.venv}")/.venv-vllm}"
if [ -x "$VVENV/bin/python" ]; then export LLMTUNE_VLLM_PYTHON="${LLMTUNE_VLLM_PYTHON:-$VVENV/bin/python}"; fi
# the documentation site (mkdocs.yml): a broken link, anchor, nav entry or snippet fails here (warnings are errors)
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
exec python -m pytest -q -m "not gpu" "$@"
