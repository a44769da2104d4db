#!/usr/bin/env bash
# The main job on the embedded default: set up (or reuse) the venv, run the quickstart pipeline on SmolLM2-135M-Instruct
# (recipes/quickstart_pipeline.yaml: SFT on GSM8K -> on-policy GSM8K pairs -> reward model -> DPO -> PPO -> export),
# then ask the merged model GSM8K questions it never saw. Prints each stage's held-out metric before -> after training (scripts/quickstart_report.py).
# Resumable: after Ctrl-C or a kill, run it again; finished steps are skipped and the interrupted one resumes.
# Extra args are pipeline overrides naming the step, e.g.  bash scripts/quickstart.sh sft.train.max_steps=4
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
. "${LLMTUNE_VENV:-$PWD/.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PIPELINE_DIR=runs/quickstart_pipeline
for arg in "$@"; do case "$arg" in pipeline.dir=*) PIPELINE_DIR="${arg#pipeline.dir=}" ;; esac; done
llmtune pipeline recipes/quickstart_pipeline.yaml "$@"
# Held-out metrics of every stage before -> after training, and whether each moved the right way.
python scripts/quickstart_report.py "$PIPELINE_DIR"
# Ask the exported model GSM8K questions it never saw (rows 1300-1304; SFT and PPO used rows 0-499).
python scripts/gsm8k_check.py "$PIPELINE_DIR/merged" --first 1300 --count 5
