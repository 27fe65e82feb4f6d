"""GPTQ's column sweep on one real-shape weight: seconds per sweep with the columns after each span of blocks
updated at once (`quantkit.algorithms.gptq.SPAN_BLOCKS`) against one block at a time, on the same factor, in one
process. Prints one JSON document.

    python benchmarks/gptq_sweep.py                        # Llama-3.1-8B's down_proj and gate_proj shapes
    python benchmarks/gptq_sweep.py --shapes 4096x1536     # <out>x<in>, comma-separated

The Hessian is made from 4,096 random calibration tokens with unequal input scales; the weight is random bf16
(its values do not change the sweep's cost). Each setting is timed `--reps` times after one warm-up sweep; the
loss (the GPTQ objective) and the share of codes that differ from the one-block sweep are reported beside.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def sweep_seconds(W: torch.Tensor, f, spec, reps: int) -> tuple[list[float], torch.Tensor, float]:
    from quantkit.algorithms.gptq import gptq_solve_stacked

    gptq_solve_stacked([W], f, spec, keep_rounded=False)  # warm-up (the compiled kernel, the allocator)
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = gptq_solve_stacked([W], f, spec, keep_rounded=False)[0]
        seconds.append(round(time.perf_counter() - t0, 3))
    return seconds, r.weight, float(r.loss.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4096x14336,14336x4096", help="<out>x<in> weights, comma-separated")
    ap.add_argument("--spans", default="1,8", help="SPAN_BLOCKS settings to time (1: one block at a time)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from quantkit.algorithms import gptq
    from quantkit.hardware import hardware
    from quantkit.schemes import WeightSpec

    spec = WeightSpec(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        out, inp = (int(v) for v in shape.split("x"))
        X = torch.randn(4096, inp, generator=g) * torch.rand(inp, generator=g)
        f = gptq.gptq_factor(X.t() @ X / X.shape[0], consume=True)
        del X
        W = (torch.randn(out, inp, generator=g) * 0.02).to(torch.bfloat16)
        gptq.SPAN_FROM = 0  # every setting applies at any width
        first = None
        for span in (int(v) for v in args.spans.split(",")):
            gptq.SPAN_BLOCKS = span
            seconds, Q, loss = sweep_seconds(W, f, spec, args.reps)
            first = Q if first is None else first
            rows.append({"shape": shape, "span_blocks": span, "seconds": seconds, "loss": loss,
                         "codes_differ_from_first": float((Q != first).float().mean())})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"hardware": hardware(), "threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
