"""The demo's GPTQ recipe converted by one process and by `--nproc 2`, as typed: what docs/distributed.md
promises, measured on the real model. Prints one JSON document.

    python benchmarks/distributed_quality.py                  # recipes/smollm2-w4a16-gptq.yaml
    python benchmarks/distributed_quality.py --recipe recipes/smollm2-w8a8-gptq.yaml

Three conversions: 1 process at the machine's threads (what a user gets without --nproc), 2 processes (each
cores / 2 threads), and 1 process at 1 thread per process like the ranks. Reported: how many stored
tensors differ from the 1-process export, the largest per-module GPTQ loss difference, and held-out
perplexity (transformers, calibration/heldout/technical.txt) of each. At equal threads per process the
bytes must be equal; across thread counts, the quality.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import REPO, perplexity  # noqa: E402 - the one held-out perplexity of the benchmarks


def _convert(recipe: str, out: Path, nproc: int, threads: int | None) -> float:
    cmd = [sys.executable, "-m", "quantkit.cli", "--no-track", "convert", recipe, "-o", str(out), "-q", "--overwrite",
           "--preflight", "capability"] + (["--nproc", str(nproc)] if nproc > 1 else [])
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, env=env)
    return round(time.perf_counter() - t0, 1)


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _compare(a: Path, b: Path) -> dict:
    ta, tb = _tensors(a), _tensors(b)
    differ = sorted(k for k in ta if k not in tb or not ta[k].equal(tb[k]))
    la = json.loads((a / "manifest.json").read_text())["layers"]
    lb = json.loads((b / "manifest.json").read_text())["layers"]
    rel = [abs(la[m]["gptq_loss"] - lb[m]["gptq_loss"]) / max(abs(la[m]["gptq_loss"]), 1e-12)
           for m in la if "gptq_loss" in la[m] and m in lb]
    return {"tensors": len(ta), "tensors_differ": len(differ), "first_differ": differ[:5],
            "max_rel_gptq_loss_diff": max(rel, default=0.0)}


def _cpu_flags() -> list[str]:
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted({"avx2", "avx512f", "amx_bf16", "avx512_bf16"} & set(flags))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/smollm2-w4a16-gptq.yaml")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="qk-dist-") as td:
        runs = {"1proc": (1, None), "2proc": (2, None), "1proc_1thread": (1, 1)}
        out = {"recipe": args.recipe, "cpu": platform.processor() or platform.machine(), "cpu_flags": _cpu_flags(),
               "cores": os.cpu_count(), "runs": {}}
        for name, (nproc, threads) in runs.items():
            folder = Path(td) / name
            wall = _convert(args.recipe, folder, nproc, threads)
            out["runs"][name] = {"processes": nproc, "threads_per_process": threads or "default", "wall_s": wall,
                                 "perplexity": perplexity(folder)}
        base = Path(td) / "1proc"
        out["2proc_vs_1proc"] = _compare(base, Path(td) / "2proc")
        out["1proc_1thread_vs_2proc"] = _compare(Path(td) / "1proc_1thread", Path(td) / "2proc")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
