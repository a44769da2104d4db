#!/usr/bin/env bash
# Two nodes without a scheduler: run this on each node, node 0 first (its address must be reachable from node 1).
#   node 0:  bash scripts/two_node_example.sh 0 10.0.0.1 recipes/llama7b_zero3.yaml model.name_or_path=/shared/Llama-2-7b-hf
#   node 1:  bash scripts/two_node_example.sh 1 10.0.0.1 recipes/llama7b_zero3.yaml model.name_or_path=/shared/Llama-2-7b-hf
# Both nodes must see the same working directory (runs/ is written by node 0's rank 0; DeepSpeed checkpoint
# shards by every rank). GPUs per node: NPROC (default: all visible GPUs). Stage: STAGE (default sft).
#
#   bash scripts/two_node_example.sh --simulate
# runs both "nodes" on this machine over 127.0.0.1 (one CPU process each, gloo, ZeRO-3) with a tiny random model:
# a check that the multi-node path works before paying for nodes (~1 min on 2 cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${LLMTUNE_VENV:-$PWD/.venv}/bin/python"
[ -x "$PY" ] || PY=python
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false

if [ "${1:-}" = "--simulate" ]; then
  WORK="${WORK:-$(mktemp -d)}"
  "$PY" - "$WORK" <<'PY'
import json, sys
from pathlib import Path
import yaml
from llmtune.models.tiny import save_tiny_model
root = Path(sys.argv[1])
model = save_tiny_model(root / "model")
rows = [{"messages": [{"role": "user", "content": f"What is {i} + 3?"}, {"role": "assistant", "content": f"It is {i + 3}."}]}
        for i in range(16)]
(root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
(root / "recipe.yaml").write_text(yaml.safe_dump({
    "stage": "sft", "model": {"name_or_path": str(model)},
    "data": {"datasets": [{"path": str(root / "data.jsonl")}], "max_length": 64},
    "adapter": {"lora_r": 4, "lora_alpha": 8}, "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 2},
    "distributed": {"zero_stage": 3}, "output": {"dir": str(root / "run")}}))
PY
  PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for RANK in 0 1; do
    "$PY" -m llmtune.commands.cli sft "$WORK/recipe.yaml" --nproc-per-node 1 --nnodes 2 --node-rank "$RANK" \
      --master-addr 127.0.0.1 --master-port "$PORT" > "$WORK/node$RANK.log" 2>&1 &
  done
  wait %1 && wait %2 || { tail -40 "$WORK"/node*.log; exit 1; }
  echo "two simulated nodes finished; one run directory: $WORK/run"
  ls "$WORK/run"
  exit 0
fi

NODE_RANK="${1:?usage: two_node_example.sh NODE_RANK MASTER_ADDR RECIPE [overrides] | --simulate}"
MASTER_ADDR="${2:?master address (node 0)}"
RECIPE="${3:?recipe}"
shift 3
NPROC="${NPROC:-$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
exec "$PY" -m llmtune.commands.cli "${STAGE:-sft}" "$RECIPE" "$@" --nproc-per-node "$NPROC" --nnodes 2 \
  --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}"
