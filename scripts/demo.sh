#!/usr/bin/env bash
# The main job on the built-in demo, on the CPU: fetch the baseline, SmolLM2-135M-Instruct dequantized from
# Q4_1 GGUF (bf16) -> convert (W8A8 RTN, W4A16 rotation + GPTQ) -> eval against it in vLLM -> gate -> publish -> show it,
# with its lineage (every step is an MLflow run in the tracking store: `quantkit ui` shows them; docs/tracking.md).
# The baseline is measured once and reused by the second eval (quantkit.evaluate.baseline_cache).
# Each artifact this machine can serve is evaluated, gated and offered to publish, which re-decides from the
# report; the last lines say what was decided for each and why. Exit status: 0 when every step ran and every
# decision agrees with its gates (an artifact not worth serving on this machine is a decision, not a
# failure); 1 when a step failed or gate and publish disagree (CI runs this script as the README gives it).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/quantkit ] || bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
TMPDIR_DEMO=$(mktemp -d)
trap 'rm -rf "$TMPDIR_DEMO"' EXIT
SECONDS=0
step() { printf '\n== %s (%d s)\n' "$*" "$SECONDS"; }

step "machine and engine"
quantkit capability
step "demo model"
quantkit models fetch smollm2-135m
step "convert"
quantkit convert recipes/smollm2-w8a8-rtn.yaml --overwrite
quantkit convert recipes/smollm2-w4a16-rotate-gptq.yaml --overwrite
quantkit inspect runs/smollm2-w8a8-rtn
quantkit inspect runs/smollm2-w4a16-rotate-gptq

failed=0
published=0
decisions=()
versions=()   # "NAME VERSION" of each published artifact
reports=()    # the reports the eval wrote, for `quantkit compare`
for run in smollm2-w8a8-rtn smollm2-w4a16-rotate-gptq; do
  step "runs/$run"
  if ! quantkit capability "runs/$run"; then
    decisions+=("runs/$run: not served on this machine (the reason is above); its eval is skipped")
    continue
  fi
  if ! quantkit eval "runs/$run" --overwrite; then
    decisions+=("runs/$run: the eval failed or is incomplete (above): no decision")
    failed=1
    continue
  fi
  reports+=("runs/$run")
  # the gate decides; publish re-decides from the report with the artifact's own gates and must agree
  set +e
  quantkit gate "runs/$run"; gate_rc=$?
  quantkit publish "runs/$run" | tee "$TMPDIR_DEMO/publish.out"; publish_rc=${PIPESTATUS[0]}
  set -e
  if [ "$gate_rc" -eq 0 ] && [ "$publish_rc" -eq 0 ]; then
    decisions+=("runs/$run: passed every gate; published")
    published=$((published + 1))
    versions+=("$(sed -n 's/^published \([^ ]*\) version \([0-9]*\).*/\1 \2/p' "$TMPDIR_DEMO/publish.out")")
  elif [ "$gate_rc" -eq 1 ] && [ "$publish_rc" -eq 2 ]; then
    decisions+=("runs/$run: not worth serving on this machine (the failing gates are above); publish refused it too")
  else
    decisions+=("runs/$run: gate exited $gate_rc and publish $publish_rc: a step failed or the two disagree")
    failed=1
  fi
done
step "registry"
quantkit registry list
for v in "${versions[@]}"; do
  step "lineage of $v"
  quantkit registry show $v
done
if [ "${#reports[@]}" -ge 2 ]; then
  step "compare"
  quantkit compare "${reports[@]}" -o runs/compare
fi
step "decisions"
printf '%s\n' "${decisions[@]}"
echo "demo finished in ${SECONDS} s: ${published} artifact(s) published; every step's run: quantkit ui"
exit "$failed"
