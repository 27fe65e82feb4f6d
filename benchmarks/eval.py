"""Time `quantkit eval` phase by phase and print one JSON line (against the eval-time targets).

    python benchmarks/eval.py ARTIFACT [--suite default] [--output DIR]

Prints {"suite", "wall_s", "<role>": {engine_start_s, quality_s, tasks_s, speed_s}, "report": path,
"baseline_reused", "hardware"}; `--fresh-baseline` measures the baseline even when a cached one matches. Speed
figures themselves are in the report; this only says where an eval's own time goes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--suite", default="default")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--fresh-baseline", action="store_true", help="measure the baseline even if a cached one matches")
    args = ap.parse_args()
    from quantkit.evaluate import run_eval

    t0 = time.perf_counter()
    out = run_eval(args.artifact, suite=args.suite, output=args.output, overwrite=True,
                   fresh_baseline=args.fresh_baseline,
                   progress=lambda m: print(m, file=sys.stderr, flush=True))
    wall = time.perf_counter() - t0
    from quantkit.hardware import hardware

    report = json.loads((out / "report.json").read_text())
    rec = {"suite": args.suite, "wall_s": round(wall, 1), "report": str(out / "report.json"),
           "baseline_reused": report["baseline"].get("reused"), "hardware": hardware()}
    for role in ("baseline", "candidate"):
        raw = out / "raw" / f"{role}.json"
        if raw.is_file():
            rec[role] = {k: round(v, 1) for k, v in json.loads(raw.read_text()).get("timings", {}).items()}
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
