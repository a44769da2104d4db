#!/usr/bin/env bash
# ZeRO-3 LoRA and ZeRO-3 QLoRA SFT of a random-init ~1.1B Llama (TinyLlama shape, bf16) for 3 steps on the GPUs of
# this machine, through `llmtune sft` (re-launched through torchrun); checks that each saved adapter holds every
# lora_A/lora_B tensor with its full shape (DeepSpeed #4295: ZeRO-3 once saved a 40-byte adapter).
#   bash scripts/gpu_zero3_check.sh                 # GPUs; result in $OUT/result.json (default /tmp/gpu_zero3_check)
#   bash scripts/gpu_zero3_check.sh --tiny          # CPU dry run: 2-layer model, fp32, 2 processes over gloo
# Extra arguments go to scripts/gpu_zero3_check.py (--steps, --nproc, --variants lora,qlora, --out).
# Needs the project's venv (scripts/setup.sh); nothing is downloaded. Exit code 0 = every variant passed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${LLMTUNE_VENV:-$PWD/.venv}/bin/python"
[ -x "$PY" ] || PY=python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/gpu_zero3_check}"
"$PY" - <<'PY' || true
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
exec "$PY" scripts/gpu_zero3_check.py --out "$OUT" "$@"
