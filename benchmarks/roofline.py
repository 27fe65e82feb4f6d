"""This machine's roofline for a conversion: its matmul peak, and how close each phase of a real-shape
conversion comes to it. Prints one JSON document (and writes it to --json-out when given).

    python benchmarks/roofline.py                                  # llama8b-2:gptq on 8 x 512 tokens (issue 34)
    python benchmarks/roofline.py --run toy-2:gptq --samples 8 --seq-len 256   # seconds, for a quick look

1. Peak: the best of several square matmuls (n = --peak-n) in float32, and in bfloat16 where this CPU computes
   it natively (amx_bf16 / avx512_bf16; on CUDA always), with torch's default thread count: what a GEMM-bound
   phase could reach on this machine. Measured before and after the conversion, and the higher reading of
   each dtype is the peak (a shared VM's busy moment only lowers one; both are in `peak_gflops_measured`).
2. The conversion: `benchmarks/scale.py`'s random checkpoint of the shape, converted by `quantkit convert`
   (its manifest's `conversion.phases_s`: quantkit/quantize/timing.py).
3. FLOPs per phase, counted from the shape (per layer, T calibration tokens of sequence length S, hidden h,
   a Linear [out, in]); multiply-adds count 2:
   - forward: 2 T x (the layer's Linear parameters) + attention's two products at their causal half,
     2 T S h (the calibration forward runs once per layer for GPTQ and RTN);
   - hessian: T in^2 per sequential group that a GPTQ stage owns (the symmetric X^T X: syrk's useful work);
   - solve (GPTQ): per sequential group (its members share one input, so one factor) 2/3 in^3 (a Cholesky
     factorisation and a triangular inverse), plus per weight out in^2 (the error feedback, column by column
     and block by block);
   - diagnostics: the output SQNR's signal per weight, 2 T in out from the inputs where T <= in (|X W^T|^2
     during the forward), else 2 out in^2 from the Hessian (W H W^T); GPTQ reports the noise (W-Q) H (W-Q)^T
     from its own losses.
   `achieved` is FLOPs / seconds, `of_peak` that over the peak of the dtype the phase computes in (the
   compute dtype for the forward, and for the diagnostics' and, on the CPU, the Hessian's products where it is
   bf16; float32 for the rest). `ideal_s` is every modelled phase's FLOPs at its
   peak; `layers_over_ideal` the measured layer time over it. Phases not modelled (load, save, capture,
   transforms, refine) have their seconds and no FLOPs.
4. Memory: the conversion's peak RSS against its bound, part by part (scale.py's `bound_parts_mb`: the imports,
   the largest layer in the compute dtype, its largest Hessian in fp32, the calibration activations), and where
   the peak actually grew (the manifest's `peak_at_start_mb` and `peak_raised_mb` per phase).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import scale  # noqa: E402  (benchmarks/scale.py: shapes, checkpoints, the conversion)

MODELLED = ("gptq", "rtn")  # methods whose per-phase FLOPs this script counts


def matmul_peak_gflops(dtype: str, n: int, reps: int = 5, device: str = "cpu") -> float:
    """The best rate of `reps` n x n x n matmuls (after one warm-up), GFLOP/s."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    c = torch.empty(n, n, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.mm(a, b, out=c)
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def layer_flops(shape: str, method: str, tokens: int, seq_len: int) -> dict[str, float]:
    """FLOPs per decoder layer and phase (the module docstring's model)."""
    lin = scale.linears(shape)
    h = scale.SHAPES[shape]["hidden_size"]
    forward = 2 * tokens * sum(o * i for _, o, i, _ in lin) + 2 * tokens * seq_len * h
    out = {"forward": float(forward) if method == "gptq" else 0.0,
           "diagnostics": float(sum(2 * o * i * min(tokens, i) for _, o, i, _ in lin)) if method == "gptq" else 0.0}
    if method == "gptq":
        group_in = {g: i for _, _, i, g in lin}
        out["hessian"] = float(sum(tokens * i * i for i in group_in.values()))
        out["solve"] = float(sum(2 / 3 * i ** 3 for i in group_in.values()) + sum(o * i * i for _, o, i, _ in lin))
    return out


def measure_peaks(dtypes: list[str], n: int, device: str) -> dict:
    peaks = {d: round(matmul_peak_gflops(d, n, device=device), 1) for d in dtypes}
    print(json.dumps({"peak_gflops": peaks}), file=sys.stderr, flush=True)
    return peaks


def roofline(phases: dict, flops_per_layer: dict, layers: int, peaks: dict, compute: str, device: str = "cpu") -> dict:
    """Per phase: seconds, FLOPs, achieved GFLOP/s and the fraction of the peak of its dtype (the Hessian's
    products run on bf16 dot products where the compute dtype is bf16 on the CPU: quantkit/algorithms/gptq.py)."""
    rows, ideal = {}, 0.0
    for phase, seconds in sorted(phases.items()):
        if phase == "layer":
            continue
        flops = flops_per_layer.get(phase, 0.0) * layers
        row = {"seconds": seconds}
        if flops:
            in_compute = phase == "forward" or (compute == "bfloat16" and (
                phase == "diagnostics" or (phase == "hessian" and device == "cpu")))
            peak = peaks[compute if in_compute else "float32"]
            row.update(gflop=round(flops / 1e9, 1), achieved_gflops=round(flops / max(seconds, 1e-9) / 1e9, 1),
                       of_peak=round(flops / max(seconds, 1e-9) / 1e9 / peak, 3), ideal_s=round(flops / peak / 1e9, 2))
            ideal += flops / peak / 1e9
        rows[phase] = row
    return {"phases": rows, "ideal_s": round(ideal, 2),
            "layers_s": phases.get("layer"), "layers_over_ideal": round(phases["layer"] / ideal, 2) if ideal else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="llama8b-2:gptq", help="a scale.py run, <shape>-<layers>:<method>")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--peak-n", type=int, default=4096, help="the peak matmul's size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path, default=None, help="checkpoint and output (default: a temporary folder)")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    from quantkit.hardware import hardware, native_bf16

    target, method = args.run.split(":")
    shape, layers = target.rsplit("-", 1)
    if method not in MODELLED:
        raise SystemExit(f"--run {args.run}: FLOPs are modelled for {', '.join(MODELLED)} only")
    dtypes = ["float32"] + (["bfloat16"] if args.device.startswith("cuda") or native_bf16() else [])
    before = measure_peaks(dtypes, args.peak_n, args.device)
    imports_mb = scale.import_baseline_mb()
    work = args.work or Path(tempfile.mkdtemp(prefix="quantkit-roofline-"))
    model = scale.write_checkpoint(work / target, shape, int(layers))
    r = scale.convert(model, work / f"out-{target}-{method}", method, args.samples, args.seq_len, args.device)
    after = measure_peaks(dtypes, args.peak_n, args.device)
    peaks = {d: max(before[d], after[d]) for d in dtypes}  # a busy moment on a shared VM only lowers a reading
    compute = r["compute_dtype"]
    flops = layer_flops(shape, method, args.samples * args.seq_len, args.seq_len)
    parts = scale.bound_parts_mb(shape, method, args.samples, args.seq_len, imports_mb, compute)
    doc = {"run": args.run, "samples": args.samples, "seq_len": args.seq_len, "compute_dtype": compute,
           "hardware": hardware(), "peak_gflops": peaks,
           "peak_gflops_measured": {"before": before, "after": after}, "convert_s": r["convert_s"], "wall_s": r["wall_s"],
           "peak_rss_mb": r["peak_rss_mb"], "peak_at_start_mb": r["peak_at_start_mb"],
           "peak_raised_mb": r["peak_raised_mb"], "bound_parts_mb": parts,
           "peak_over_bound": round(r["peak_rss_mb"] / sum(parts.values()), 3), **roofline(r["phases_s"], flops, int(layers), peaks,
                                                      compute if compute in peaks else "float32",
                                                      "cuda" if str(args.device).startswith("cuda") else "cpu")}
    text = json.dumps(doc, indent=2)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
