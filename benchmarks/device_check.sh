#!/usr/bin/env bash
# The GPU check of issue 13, for a machine with one NVIDIA GPU (an H200) whose image has torch+CUDA,
# transformers, safetensors, scipy and accelerate but not pydantic, compressed-tensors or greenlet, and no
# package registry. Budget: 8 minutes.
#
# Here, with network (once):   bash benchmarks/device_check.sh --fetch
#     downloads the small pure/binary wheels quantkit needs into .device-wheels/ (ignored by git, ~15 MB,
#     binary ones for CPython 3.10-3.13); carry that folder to the GPU machine with the tree.
# There, from the repository root:   bash benchmarks/device_check.sh
#     installs them into .device-deps/ (no index), writes the Llama-3.1-8B-shape random checkpoint, converts
#     it with GPTQ W4A16 g128 on 128 x 2048 calibration tokens on cuda, and prints JSON with the wall time,
#     the GPU peak memory and the host peak RSS (benchmarks/scale.py; the log lines go to stderr).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device-wheels
PURE="pydantic==2.14.4 annotated-types typing-inspection typing-extensions compressed-tensors==0.17.0 loguru
      typer click rich shellingham annotated-doc markdown-it-py mdurl pygments"
BINARY="pydantic-core greenlet"

if [ "${1:-}" = "--fetch" ]; then
  mkdir -p "$WHEELS"
  python3 -m pip download -q --no-deps --only-binary=:all: --dest "$WHEELS" $PURE
  for v in 3.10 3.11 3.12 3.13; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$v" \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
      --dest "$WHEELS" "pydantic-core==$(python3 -m pip show pydantic-core 2>/dev/null | awk '/^Version/{print $2}' || echo 2.41.5)" greenlet
  done
  du -sh "$WHEELS"
  exit 0
fi

[ -d "$WHEELS" ] || { echo "no $WHEELS: run 'bash benchmarks/device_check.sh --fetch' where there is network, and carry it" >&2; exit 2; }
python3 -m pip install -q --no-index --find-links "$WHEELS" --target .device-deps --no-deps \
  $(ls "$WHEELS" | sed 's/-[0-9].*//' | sort -u | tr '\n' ' ') 2>&1 | tail -3 || true
export PYTHONPATH="$PWD:$PWD/.device-deps${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU'; print(torch.__version__, torch.cuda.get_device_name(0))" >&2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >&2 || true
WORK=${WORK:-/tmp/quantkit-device}
timeout 460 python3 benchmarks/scale.py --runs llama8b-32:gptq --samples 128 --seq-len 2048 --device cuda --work "$WORK"
