#!/usr/bin/env bash
# The main job on the built-in demo, on the CPU: fetch SmolLM2-135M -> convert (W8A8 RTN, W4A16 GPTQ)
# -> eval against the bf16 baseline in vLLM -> gate -> publish to the embedded registry -> show it.
# The baseline is measured once and reused by the second eval (quantkit.evaluate.baseline_cache).
# Exit status: 0 when every artifact this machine can serve was evaluated, passed its gates and was
# published; 1 otherwise (CI runs this script exactly as the README gives it).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/quantkit ] || bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
SECONDS=0
step() { printf '\n== %s (%d s)\n' "$*" "$SECONDS"; }

step "machine and engine"
quantkit capability
step "demo model"
quantkit models fetch smollm2-135m
step "convert"
quantkit convert recipes/smollm2-w8a8-rtn.yaml --overwrite
quantkit convert recipes/smollm2-w4a16-gptq.yaml --overwrite
quantkit inspect runs/smollm2-w8a8-rtn
quantkit inspect runs/smollm2-w4a16-gptq

failed=0
published=0
for run in smollm2-w8a8-rtn smollm2-w4a16-gptq; do
  step "runs/$run"
  if ! quantkit capability "runs/$run"; then
    echo "runs/$run: not served on this machine (the reason is above); its eval is skipped"
    continue
  fi
  quantkit eval "runs/$run" --overwrite
  if quantkit gate "runs/$run"; then
    quantkit publish "runs/$run"
    published=$((published + 1))
  else
    echo "runs/$run did not pass its gates: not published"
    failed=1
  fi
done
step "registry"
quantkit registry list
echo "demo finished in ${SECONDS} s: ${published} artifact(s) published"
if [ "$published" -eq 0 ] || [ "$failed" -ne 0 ]; then
  exit 1
fi
