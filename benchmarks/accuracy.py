"""Accuracy side by side: quantkit's W4A16 methods and the peers' on the same model, calibration tokens and held-out
text, in one run on one machine. Prints one JSON document (and writes it to --out when given).

    python benchmarks/accuracy.py --samples 32                       # quantkit's rows only
    python benchmarks/accuracy.py --samples 32 --rows gptq,autoround-gptq \
        --llmcompressor /tmp/anchor-venv/bin/python --autoround /tmp/autoround-venv/bin/python \
        --gptqmodel /tmp/gq-venv/bin/python

Every quantkit row is `recipes/smollm2-w4a16-gptq.yaml` (W4A16 int4, group 64, symmetric; `num_samples` x 512
calibration tokens from its builtin sources, seed 0) with its stages replaced as ROWS says, converted in its own
process without tracking, its calibration forward in float32 (`NAME@bf16`: bfloat16). The peers get the same token ids (a safetensors file) in their own venvs
(benchmarks/anchor_llmcompressor.py, benchmarks/anchor_autoround.py, benchmarks/anchor_gptqmodel.py). Perplexity: transformers, fp32, on
calibration/heldout/technical.txt (text no calibration source contains), 512-token windows, for the float model
and every result; `ratio` is result / float. Wall time includes each process's start; peak RSS is the
converting process's own (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from anchor_child import RECIPE, demo_calibration  # noqa: E402 (after the path insert)
W4 = "scheme: W4A16, group_size: 64"
AWQ = "{method: awq, grid: 20, duo_scaling: true, clip: true, max_tokens: 2048}"
ROT = "{method: rotate}"


def _rows(steps: int) -> dict[str, list[str]]:
    """Row name -> the recipe's stages (YAML flow maps)."""
    ar = f"method: autoround, {W4}, steps: {steps}"
    return {
        "rtn": [f"{{method: rtn, {W4}}}"],
        "rtn-mse": [f"{{method: rtn, {W4}, observer: mse}}"],
        "gptq": [f"{{method: gptq, {W4}, actorder: static}}"],
        "gptq-mse": [f"{{method: gptq, {W4}, actorder: static, observer: mse}}"],
        "awq-gptq": [AWQ, f"{{method: gptq, {W4}, actorder: static}}"],
        "autoround-rtn": [f"{{{ar}, init: rtn}}"],
        "autoround-rtn-mseloss": [f"{{{ar}, init: rtn, loss: mse}}"],  # the plain mean squared error as the loss
        "autoround-gptq": [f"{{{ar}, init: gptq}}"],
        "autoround-gptq-mse": [f"{{{ar}, init: gptq, observer: mse}}"],
        "awq-autoround-gptq": [AWQ, f"{{{ar}, init: gptq}}"],
        "rotate-rtn": [ROT, f"{{method: rtn, {W4}}}"],
        "rotate-gptq": [ROT, f"{{method: gptq, {W4}, actorder: static}}"],
        "rotate-gptq-mse": [ROT, f"{{method: gptq, {W4}, actorder: static, observer: mse}}"],
        "rotate-awq-gptq-mse": [ROT, AWQ, f"{{method: gptq, {W4}, actorder: static, observer: mse}}"],
        "rotate-autoround-gptq-mse": [ROT, f"{{{ar}, init: gptq, actorder: static, observer: mse}}"],
        "rotate-autoround-rtn": [ROT, f"{{{ar}, init: rtn}}"],
        "autoround-rtn-layer": [f"{{{ar}, init: rtn, reference: float_layer}}"],  # the float layer's output as target
        # W8A8 (int8 channels, dynamic per-token int8 activations)
        "w8a8-rtn": ["{method: rtn, scheme: W8A8}"],
        "w8a8-gptq": ["{method: gptq, scheme: W8A8}"],
        "w8a8-smoothquant-gptq": ["{method: smoothquant, alpha: 0.5}", "{method: gptq, scheme: W8A8}"],
        "w8a8-rotate-gptq": [ROT, "{method: gptq, scheme: W8A8}"],
    }


def _stages(rows: dict[str, list[str]], name: str) -> list[str]:
    """A row's stages; NAME+full / NAME+signed: its quantizer (the last stage) with `full_range: true` / `signed`."""
    base, plus, rule = name.partition("+")
    if plus and rule not in ("full", "signed"):
        raise SystemExit(f"row {name}: the suffixes are +full and +signed")
    stages = list(rows[base])
    if plus:
        stages[-1] = stages[-1][:-1] + f", full_range: {'true' if rule == 'full' else 'signed'}}}"
    return stages


def convert_row(name: str, stages: list[str], out: Path, samples: int, batch: int, compute: str = "float32") -> dict:
    sets = [f"stages=[{', '.join(stages)}]", f"calibration.num_samples={samples}", f"calibration.batch_size={batch}",
            f"model.compute_dtype={compute}"]
    cmd = [sys.executable, "-m", "quantkit.cli", "--no-track", "convert", RECIPE, "-o", str(out), "-q", "--overwrite",
           "--preflight", "capability", *(a for s in sets for a in ("--set", s))]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    man = json.loads((out / "manifest.json").read_text())
    layers = man.get("layers", {})
    kept = [v.get("autoround_kept_start") for v in layers.values() if "autoround_kept_start" in v]
    return {"row": name, "toolkit": "quantkit", "scheme": "W8A8" if "W8A8" in stages[-1] else "W4A16 g64", "stages": stages, "wall_s": round(wall, 1),
            "compute_dtype": man["conversion"]["compute_dtype"],
            "convert_s": man["conversion"]["wall_time_s"], "peak_rss_mb": round(man["conversion"]["peak_rss_bytes"] / 1e6),
            "calibration_fingerprint": man["calibration"]["fingerprint"][:16],
            **({"autoround_modules_kept_start": f"{sum(kept)} of {len(kept)}"} if kept else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=32, help="calibration samples of 512 tokens")
    ap.add_argument("--batch", type=int, default=2, help="calibration.batch_size (autoround: samples per step)")
    ap.add_argument("--steps", type=int, default=50, help="autoround steps per layer (ours and intel's)")
    ap.add_argument("--rows", default=None, help="comma-separated quantkit rows (default: all); NAME@bf16 computes "
                                                 "that row's calibration forward in bfloat16 (default float32); "
                                                 "NAME+full / NAME+signed: its quantizer with full_range true / signed")
    ap.add_argument("--llmcompressor", help="python of a venv with llm-compressor (its GPTQ row)")
    ap.add_argument("--autoround", help="python of a venv with intel auto-round (its row, at --steps)")
    ap.add_argument("--gptqmodel", help="python of a venv with GPTQModel (its GPTQ row, W4A16 g64, float32)")
    ap.add_argument("--autoround-dtype", choices=["float32"], default=None,
                    help="float32: intel's row without its bf16 mixed precision (for float32 rows where bf16 is not "
                         "native); default: its own")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from safetensors.torch import save_file

    from convert import perplexity
    from quantkit.hardware import hardware

    rows = _rows(args.steps)
    names = args.rows.split(",") if args.rows else list(rows)
    model_dir, calib = demo_calibration(args.samples)
    result = {"model": "SmolLM2-135M", "schemes": "W4A16 int4 g64 symmetric; W8A8 int8 channels + dynamic per-token int8 "
              "activations (rows w8a8-*)", "samples": args.samples, "seq_len": 512,
              "autoround_steps": args.steps, "batch": args.batch, "hardware": hardware(),
              "calibration_fingerprint": calib.fingerprint[:16], "float_perplexity": perplexity(model_dir), "rows": []}

    def add(row: dict, folder: Path) -> None:
        row["perplexity"] = perplexity(folder)
        row["ratio"] = round(row["perplexity"] / result["float_perplexity"], 4)
        result["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="qk-accuracy-") as td:
        for name in names:  # NAME@bf16: that row with the calibration forward in bfloat16
            base, _, dt = name.partition("@")
            out = Path(td) / name.replace("+", "-")
            add(convert_row(name, _stages(rows, base), out, args.samples, args.batch,
                            "bfloat16" if dt == "bf16" else "float32"), out)
        ids_file = Path(td) / "ids.safetensors"
        save_file({"input_ids": calib.input_ids.contiguous()}, str(ids_file))
        if args.llmcompressor:
            from anchor_llmcompressor import run_llmcompressor

            for row, scheme, label in (("llmcompressor-gptq", "w4a16", "W4A16 g64"),
                                       ("llmcompressor-w8a8-smoothquant-gptq", "w8a8", "W8A8")):
                out = Path(td) / row
                add({"row": row, "toolkit": "llm-compressor", "scheme": label, "dtype": "float32",
                     **run_llmcompressor(args.llmcompressor, model_dir, ids_file, out, "float32", scheme)}, out)
        if args.gptqmodel:
            from anchor_gptqmodel import run_gptqmodel

            out = Path(td) / "gptqmodel-gptq"
            ran = run_gptqmodel(args.gptqmodel, model_dir, calib.input_ids, out, nsamples=args.samples, seqlen=512,
                                batch_size=args.batch)
            add({"row": "gptqmodel-gptq", "toolkit": "GPTQModel", "scheme": "W4A16 g64", "dtype": "float32", **ran}, out)
        if args.autoround:
            from anchor_autoround import run_autoround

            out = Path(td) / "intel-autoround"
            ran = run_autoround(args.autoround, model_dir, calib.input_ids, out, iters=args.steps,
                                nsamples=args.samples, seqlen=512, batch_size=args.batch,
                                dtype=args.autoround_dtype)
            add({"row": "intel-autoround", "toolkit": "auto-round", "scheme": "W4A16 g64", **ran}, out)
    result["rows"].sort(key=lambda r: r["perplexity"])
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
