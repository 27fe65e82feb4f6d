#!/usr/bin/env bash
# The whole test suite, fast and slow (CI runs exactly this). Fast only: scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/quantkit ] || bash scripts/install.sh
.venv/bin/quantkit models fetch smollm2-135m -q  # the slow tests convert and serve the demo model
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 1800 --durations=30 "$@"  # slowest 30: where CI time goes
