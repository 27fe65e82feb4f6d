#!/usr/bin/env bash
# The main job on the built-in demo, on the CPU: fetch SmolLM2-135M -> convert (W8A8 RTN, W4A16 GPTQ)
# -> eval against the bf16 baseline in vLLM -> gate -> publish to the embedded registry -> show it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/quantkit ] || bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"

quantkit models fetch smollm2-135m
quantkit convert recipes/smollm2-w8a8-rtn.yaml --overwrite
quantkit convert recipes/smollm2-w4a16-gptq.yaml --overwrite
quantkit inspect runs/smollm2-w8a8-rtn
quantkit inspect runs/smollm2-w4a16-gptq

for run in smollm2-w8a8-rtn smollm2-w4a16-gptq; do
  if why=$(python -c "import sys; from quantkit.engine.capability import artifact_can_run as c; ok, w = c('runs/$run'); print(w); sys.exit(0 if ok else 1)"); then
    quantkit eval "runs/$run" --overwrite
    if quantkit gate "runs/$run"; then
      quantkit publish "runs/$run"
    else
      echo "runs/$run did not pass its gates: not published"
    fi
  else
    echo "runs/$run: not served here: $why"
  fi
done
quantkit registry list
