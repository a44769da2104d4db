#!/usr/bin/env bash
# GPU acceptance: bf16 LoRA / QLoRA SFT, DPO, PPO (+ GRPO when it exists) through the llmtune CLI, export + reload,
# ZeRO-3 LoRA/QLoRA adapters, and the side-by-side benchmark (scripts/bench.py --gpu) on one GPU machine.
#   bash scripts/gpu_acceptance.sh            # on the GPU machine: result in $OUT/result.json (+ logs), <= 9 min
#   bash scripts/gpu_acceptance.sh --tiny     # CPU dry run (2-layer model, fp32); the test suite runs it (slow)
# Extra arguments go to scripts/gpu_acceptance.py (--only sft_lora,dpo, --timeout S, --out DIR).
# On the lent H200 (see ../shared/gpu/README.md): carry .whl (../shared/gpu/make_wheels.sh), then
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && PYTHONPATH=/tmp/site:$PWD bash scripts/gpu_acceptance.sh
# Exit code 0 only if every check that ran passed. Nothing is downloaded.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=python3
[ -x "${LLMTUNE_VENV:-$PWD/.venv}/bin/python" ] && PY="${LLMTUNE_VENV:-$PWD/.venv}/bin/python"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
OUT="${OUT:-/tmp/gpu_acceptance}"
mkdir -p "$OUT"
"$PY" - <<'PY' | tee "$OUT/versions.txt" || true
import importlib, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "deepspeed"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "MISSING", type(exc).__name__)
PY
"$PY" scripts/gpu_acceptance.py --out "$OUT" "$@" 2>&1 | tee "$OUT/acceptance.log"
exit "${PIPESTATUS[0]}"
