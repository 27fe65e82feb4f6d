"""Time vLLM engine starts as quantkit makes them (VLLMServer), cold and warm, and print one JSON line.

    python benchmarks/engine_start.py [MODEL_DIR] [--runs 2]

A start is from `VLLMServer.__enter__` until the server answers; "cold" runs with an empty VLLM_CACHE_ROOT
(what every start was before quantkit kept that folder in QUANTKIT_HOME), "warm" with the one the cold start
filled. Starts run one after another, never two engines at once; run it on an otherwise idle machine.
Prints {"model", "cold_s": [...], "warm_s": [...], "ratio_warm_over_cold", "hardware"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def start_once(model_dir: Path, home: Path) -> float:
    from quantkit.engine.vllm_server import VLLMServer

    os.environ["QUANTKIT_HOME"] = str(home)
    with tempfile.TemporaryDirectory(prefix="qk-start-") as run:
        t0 = time.perf_counter()
        with VLLMServer(model_dir, Path(run), "m", max_model_len=512):
            return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, nargs="?", default=None, help="default: the demo model (smollm2-135m)")
    ap.add_argument("--runs", type=int, default=2, help="cold and warm starts each")
    args = ap.parse_args()
    from quantkit.hardware import hardware
    from quantkit.io import quantkit_home

    model = args.model or quantkit_home() / "models" / "smollm2-135m"
    if not (model / "config.json").is_file():
        sys.exit(f"{model}: no model folder; run `quantkit models fetch smollm2-135m` or pass MODEL_DIR")
    cold, warm = [], []
    with tempfile.TemporaryDirectory(prefix="qk-home-") as tmp:
        for i in range(args.runs):
            home = Path(tmp) / f"cold{i}"  # a new, empty QUANTKIT_HOME: no vllm-cache
            cold.append(start_once(model, home))
            warm.append(start_once(model, home))  # the same home: vllm-cache filled by the start before
            print(f"run {i}: cold {cold[-1]:.1f} s, warm {warm[-1]:.1f} s", file=sys.stderr, flush=True)
    print(json.dumps({"model": str(model), "cold_s": [round(x, 1) for x in cold], "warm_s": [round(x, 1) for x in warm],
                      "ratio_warm_over_cold": round(statistics.median(warm) / statistics.median(cold), 3),
                      "hardware": hardware()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
