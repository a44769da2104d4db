#!/usr/bin/env bash
# The main job on the embedded default: set up (or reuse) the venv, LoRA-SFT SmolLM2-135M-Instruct on
# GSM8K (recipes/quickstart_sft.yaml), export the merged model, and ask it GSM8K questions it never saw.
# Extra args are recipe overrides, e.g.  bash scripts/quickstart.sh train.max_steps=5
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. "${LLMTUNE_VENV:-$PWD/.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RUN=runs/quickstart_sft
resume=()
if [ -f "$RUN/lineage.json" ]; then
  echo "$RUN is already complete; delete it to train again" >&2
elif [ -d "$RUN/checkpoints" ]; then
  resume=(train.resume_from=latest)
  llmtune sft recipes/quickstart_sft.yaml "${resume[@]}" "$@"
else
  llmtune sft recipes/quickstart_sft.yaml output.overwrite=true "$@"
fi
llmtune export "$RUN"
# Ask the exported model GSM8K questions it never saw (rows 1300-1304; it trained on rows 0-399).
python scripts/gsm8k_check.py "$RUN/merged" --first 1300 --count 5
