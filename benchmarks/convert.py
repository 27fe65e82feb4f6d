"""Conversion benchmark: wall time, peak RSS, size and held-out perplexity per method, plus the forward
floor and a memory-scaling run. Prints one JSON document.

    python benchmarks/convert.py                      # SmolLM2: RTN and GPTQ W4A16 g64, 128 x 512 tokens
    python benchmarks/convert.py --samples 32 --runs gptq-w4a16,rtn-w4a16 --floor
    python benchmarks/convert.py --scaling            # random Llama, 4 vs 16 layers, same width

Each conversion runs in its own process and reports its own peak RSS (VmHWM, in the manifest; the
child's ru_maxrss would include this parent's size at fork) and perplexity is measured afterwards with transformers on calibration/heldout/technical.txt
(the engine has no int4 kernel on AVX2-only CPUs, and this keeps every method measured the same way).
The floor is two forward passes of the same calibration tokens through the decoder layers, one layer
at a time as the pipeline runs them: one to observe, one to propagate.
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
RUNS = {
    # the GPTQ recipe with its stage swapped for RTN: same model, data and export settings
    "rtn-w4a16": ("recipes/smollm2-w4a16-gptq.yaml", ["stages[0]={method: rtn, scheme: W4A16, group_size: 64}"]),
    "gptq-w4a16": ("recipes/smollm2-w4a16-gptq.yaml", []),
    "rtn-w8a8": ("recipes/smollm2-w8a8-rtn.yaml", []),
    "gptq-w8a8": ("recipes/smollm2-w8a8-gptq.yaml", []),
    # transforms: AWQ scales before RTN / GPTQ (same scheme, group 64), SmoothQuant before W8A8 RTN
    "awq-w4a16": ("recipes/smollm2-w4a16-awq.yaml", []),
    "awq-gptq-w4a16": ("recipes/smollm2-w4a16-awq-gptq.yaml", []),
    "smoothquant-w8a8": ("recipes/smollm2-w8a8-smoothquant.yaml", []),
    "fp8": ("recipes/smollm2-fp8.yaml", []),
    "mixed-w8a8-w4a16": ("recipes/smollm2-mixed.yaml", []),
    # fp4 weights (no CPU kernel: measured engine-free only)
    "rtn-nvfp4": ("recipes/smollm2-nvfp4a16-gptq.yaml", ["stages[0]={method: rtn, scheme: NVFP4A16}"]),
    "gptq-nvfp4": ("recipes/smollm2-nvfp4a16-gptq.yaml", []),
    "rtn-mxfp4": ("recipes/smollm2-mxfp4a16-gptq.yaml", ["stages[0]={method: rtn, scheme: MXFP4A16}"]),
    "gptq-mxfp4": ("recipes/smollm2-mxfp4a16-gptq.yaml", []),
}


def convert(name: str, out: Path, samples: int) -> dict:
    recipe, sets = RUNS[name]
    if "calibration" in (REPO / recipe).read_text():
        sets.append(f"calibration.num_samples={samples}")
    # the conversion alone: the engine pre-flight (a separate, cached step) is left out of the timing
    cmd = [sys.executable, "-m", "quantkit.cli", "--no-track", "convert", recipe, "-o", str(out), "-q", "--overwrite",
           "--preflight", "capability"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # the CLI prints the folder: keep stdout JSON
    wall = time.perf_counter() - t0
    man = json.loads((out / "manifest.json").read_text())
    return {"run": name, "wall_s": round(wall, 1), "convert_s": man["conversion"]["wall_time_s"],
            "peak_rss_mb": round(man["conversion"]["peak_rss_bytes"] / 1e6), "size_mb": round(man["size_bytes"] / 1e6, 1),
            "calibration_tokens": (man["calibration"] or {}).get("num_tokens"),
            "phases_s": man["conversion"].get("phases_s")}


def perplexity(model_dir: Path) -> float:
    code = ("import json,sys; from pathlib import Path; "
            "from quantkit.evaluate.hf_perplexity import perplexity, load_for_perplexity; "
            "m,t=load_for_perplexity(Path(sys.argv[1])); "
            "print(json.dumps(perplexity(m,t,[Path('calibration/heldout/technical.txt')])))")
    out = subprocess.run([sys.executable, "-c", code, str(model_dir)], cwd=REPO, check=True, capture_output=True, text=True)
    return round(json.loads(out.stdout.strip().splitlines()[-1])["perplexity"], 3)


def forward_floor(samples: int) -> dict:
    """Two layer-by-layer forward passes of the calibration tokens (observe + propagate), fp32."""
    code = r"""
import json, sys, time, torch
from quantkit.recipe import load_recipe
from quantkit.model.arch import arch_for
from quantkit.model.checkpoint import LazyCheckpoint, build_skeleton, materialize, release
from quantkit.model.sources import resolve_model_dir
from quantkit.data import build_calibration_set
from quantkit.quantize.walk import capture_layer_inputs
from transformers import AutoTokenizer
r = load_recipe("recipes/smollm2-w4a16-gptq.yaml", [f"calibration.num_samples={sys.argv[1]}"])
d = resolve_model_dir(r.model); tok = AutoTokenizer.from_pretrained(d)
ids = build_calibration_set(r.calibration, tok).input_ids
m = build_skeleton(d, "bfloat16"); arch = arch_for(m.config); ck = LazyCheckpoint(d)
bs = r.calibration.batch_size
h, kws = capture_layer_inputs(m, arch, ck, ids, torch.float32, bs)
layers = m.get_submodule(arch.layers)
t0 = time.perf_counter()
with torch.no_grad():
    for i, layer in enumerate(layers):
        materialize(layer, f"{arch.layers}.{i}.", ck, torch.float32)
        outs = []
        for c in h.split(bs):                       # the pipeline's chunks
            layer(c, **kws[c.shape[0]][i])          # observe
            outs.append(layer(c, **kws[c.shape[0]][i]))  # propagate
        h = torch.cat(outs)
        release(layer)
print(json.dumps({"floor_s": round(time.perf_counter() - t0, 1)}))
"""
    out = subprocess.run([sys.executable, "-c", code, str(samples)], cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def scaling(tmp: Path) -> dict:
    """Peak RSS converting random Llamas of the same width with 4 and 16 layers (GPTQ W4A16 g128)."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_tiny_model, tiny_recipe, write_recipe, SAMPLE_TEXT

    calib = tmp / "calib"
    calib.mkdir()
    for i in range(8):
        (calib / f"d{i}.txt").write_text(SAMPLE_TEXT * 20)
    out = {}
    for layers in (4, 16):
        model = make_tiny_model(tmp / f"llama{layers}", "llama", layers=layers, hidden=1024)
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        recipe = tiny_recipe(model, calib, [{"method": "gptq", "scheme": "W4A16", "group_size": 128}])
        recipe["calibration"].update(num_samples=8, seq_len=128)
        path = write_recipe(tmp / f"r{layers}.yaml", recipe)
        o = tmp / f"out{layers}"
        subprocess.run([sys.executable, "-m", "quantkit.cli", "--no-track", "convert", str(path), "-o", str(o), "-q", "--preflight",
                        "capability"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        man = json.loads((o / "manifest.json").read_text())
        out[f"layers_{layers}"] = {"peak_rss_mb": round(man["conversion"]["peak_rss_bytes"] / 1e6),
                                   "checkpoint_mb": round(weights / 1e6), "wall_s": man["conversion"]["wall_time_s"]}
    per_layer = (out["layers_16"]["checkpoint_mb"] - out["layers_4"]["checkpoint_mb"]) / 12
    out["extra_12_layers_weights_mb"] = round(12 * per_layer)
    out["peak_rss_growth_mb"] = out["layers_16"]["peak_rss_mb"] - out["layers_4"]["peak_rss_mb"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="rtn-w4a16,gptq-w4a16")
    ap.add_argument("--samples", type=int, default=128, help="calibration samples of 512 tokens")
    ap.add_argument("--floor", action="store_true", help="also measure the two-forward-pass floor")
    ap.add_argument("--scaling", action="store_true", help="only the 4 vs 16 layer memory-scaling run")
    ap.add_argument("--no-perplexity", action="store_true")
    args = ap.parse_args()
    from quantkit.hardware import hardware

    result: dict = {"hardware": hardware(), "samples": args.samples}
    with tempfile.TemporaryDirectory(prefix="qk-bench-") as td:
        tmp = Path(td)
        if args.scaling:
            result["scaling"] = scaling(tmp)
        else:
            result["runs"] = []
            if not args.no_perplexity:
                from quantkit.model.sources import ensure_demo_model

                result["float_perplexity"] = perplexity(ensure_demo_model("smollm2-135m", quiet=True))
            for name in args.runs.split(","):
                row = convert(name, tmp / name, args.samples)
                if not args.no_perplexity:
                    row["perplexity"] = perplexity(tmp / name)
                result["runs"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            if args.floor:
                result["floor"] = forward_floor(args.samples)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
