"""Real model shapes on this machine: random-weight checkpoints with the exact configs of Llama-3.1-8B,
Qwen2.5-7B and a K-layer slice of Llama-3.1-70B, converted with GPTQ W4A16 g128 (static act-order), W8A8
SmoothQuant + GPTQ, W8A8 RTN, rotation + GPTQ with MSE scales (rot-gptq-mse) or autoround (METHODS). Prints one JSON document (and writes it to --json-out when given).

    python benchmarks/scale.py                                  # the default plan below (about 40 min on 2 cores)
    python benchmarks/scale.py --runs llama8b-2:gptq --samples 16 --seq-len 512
    python benchmarks/scale.py --runs llama8b-32:rtn            # the whole 8B depth: memory flat in depth?
    bash benchmarks/device_check.sh                             # the GPU check (see that script)

A run is `<shape>-<layers>:<method>`. Checkpoints are written shard by shard through quantkit's streaming
shard writer, one tensor generated at a time (never the model in memory), into --work (default: a
temporary folder; they are reused between runs and between invocations with the same --work). Each carries
its own tokenizer, built in code (quantkit.model.tokenizer: one token per byte, ids below 259, under every
shape's vocabulary), so nothing here needs the demo model. Calibration reads all five of quantkit's
builtin corpora: one token per byte gives about 400,000 tokens, enough for 128 x 2048.

Per run: per-layer seconds (from convert.log), peak RSS (the conversion's own VmHWM, from the manifest),
the disk the conversion said it needs and the artifact's size, and the full-depth time extrapolated from
the mean per-layer time. `bound_mb` is what the peak should stay within: the import baseline, the
largest layer's weights in the compute dtype, its largest Hessian (fp32) and the calibration activations
(the layer's input and output, in the compute dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {  # the published configs (config.json of each model), minus what a random checkpoint cannot use
    "llama8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                   num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                   rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "llama70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                     num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                     rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
    # not a published model: the Llama layout at toy size, for `device_check.sh --simulate` and quick tests
    "toy": dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
}
METHODS = {
    "gptq": [{"method": "gptq", "scheme": "W4A16", "group_size": 128, "actorder": "static"}],
    "sq-gptq": [{"method": "smoothquant", "alpha": 0.5},
                {"method": "gptq", "scheme": "W8A8", "actorder": "static"}],
    "rtn": [{"method": "rtn", "scheme": "W8A8"}],
    # issue 33's best W4A16 combination and the learned rounding, at the same scheme as "gptq"
    "rot-gptq-mse": [{"method": "rotate"},
                     {"method": "gptq", "scheme": "W4A16", "group_size": 128, "actorder": "static", "observer": "mse"}],
    "autoround": [{"method": "autoround", "scheme": "W4A16", "group_size": 128, "actorder": "static"}],
}
CALIBRATED = ("gptq", "smoothquant", "awq", "autoround")  # stage methods that read calibration data
CORPORA = ("prose", "chat", "code", "json", "numbers")
DEFAULT_RUNS = "llama8b-2:gptq,qwen7b-2:gptq,llama8b-2:rtn,llama8b-32:rtn,llama70b-1:gptq"


def write_checkpoint(folder: Path, shape: str, layers: int, seed: int = 0) -> Path:
    """A random bf16 checkpoint of `shape` cut to `layers` decoder layers, one tensor in memory at a time, with
    a byte-level tokenizer built here (never the demo model's). An existing one is reused as it is."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.export.shards import TensorRef, write_shards
    from quantkit.model.tokenizer import build_tokenizer

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = build_tokenizer(tmp)  # tokenizer.json, tokenizer_config.json, chat template
    cfg = dict(SHAPES[shape])
    if len(tok) > cfg["vocab_size"]:
        raise ValueError(f"{shape}: vocabulary {cfg['vocab_size']} is smaller than the tokenizer's {len(tok)} ids")
    cfg.update(num_hidden_layers=layers, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    config = AutoConfig.for_model(cfg.pop("model_type"), torch_dtype="bfloat16", **cfg)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)

    def make(name: str, shp: tuple[int, ...]):
        def read():
            g = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, name)) * 7919 + len(name))
            if name.endswith("norm.weight"):
                return torch.ones(shp, dtype=torch.bfloat16)
            std = 0.02 if len(shp) == 2 else 0.01
            return (torch.randn(shp, generator=g) * std).to(torch.bfloat16)
        return TensorRef(name, "BF16", tuple(shp), read)

    refs = [make(n, tuple(p.shape)) for n, p in skeleton.named_parameters()]
    write_shards(tmp, refs, 4 << 30)
    config.save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


def import_baseline_mb(cache: Path | None = None) -> float:
    """The peak RSS of a process that only imports what a conversion imports; measured once per `cache` file
    (one per --work folder: the steps of one device check share it)."""
    if cache is not None and cache.is_file():
        return float(cache.read_text())
    # (numba: GPTQ's compiled sweep, imported at the first solve where it is installed, ~140 MB; the device
    # image has none and runs the torch loop.)
    # quantkit.io.peak_rss_bytes (VmHWM), not ru_maxrss: Linux carries ru_maxrss across exec, so a child of a
    # process that has grown (one that wrote a checkpoint) would report the parent's size
    code = ("import importlib.util, torch, transformers, quantkit.convert, quantkit.quantize.layers, compressed_tensors,"
            " quantkit.io;"
            "importlib.util.find_spec('numba') and __import__('numba');"
            "print(quantkit.io.peak_rss_bytes() / 2**20)")
    mb = float(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip())
    if cache is not None:
        cache.write_text(str(mb))
    return mb


def convert(model: Path, out: Path, method: str, samples: int, seq_len: int, device: str) -> dict:
    import yaml

    recipe = {"name": out.name, "model": {"path": str(model), "dtype": "bfloat16"}, "stages": METHODS[method],
              "export": {"max_shard_size_mb": 4096}}
    if any(st["method"] in CALIBRATED for st in METHODS[method]):
        recipe["calibration"] = {"sources": [{"type": "builtin", "name": n} for n in CORPORA],
                                 "num_samples": samples, "seq_len": seq_len, "batch_size": 8}
    rfile = out.with_suffix(".yaml")
    rfile.write_text(yaml.safe_dump(recipe))
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    # pre-flight: the format rules and the capability check only (the engine check starts vLLM, which is no
    # part of a conversion's cost and is absent on the GPU machine)
    subprocess.run([sys.executable, "-m", "quantkit.cli", "--no-track", "convert", str(rfile), "-o", str(out), "-q", "--restart",
                    "--device", device, "--preflight", "capability"], cwd=REPO, check=True)
    wall = time.perf_counter() - t0
    man = json.loads((out / "manifest.json").read_text())
    log = (out / "convert.log").read_text()
    per_layer = [float(s) for s in re.findall(r"layer \d+ done in ([\d.]+)s", log)]
    need = re.search(r"about ([\d.]+ [KMGT]?B) of disk needed", log)
    return {"wall_s": round(wall, 1), "convert_s": man["conversion"]["wall_time_s"],
            "peak_rss_mb": round(man["conversion"]["peak_rss_bytes"] / 1e6), "per_layer_s": per_layer,
            "peak_gpu_mb": round(man["conversion"]["peak_gpu_bytes"] / 1e6) if man["conversion"].get("peak_gpu_bytes") else None,
            "device": man["conversion"]["device"], "compute_dtype": man["conversion"]["compute_dtype"],
            "artifact_mb": round(man["size_bytes"] / 1e6), "disk_needed": need.group(1) if need else None,
            "calibration_tokens": (man["calibration"] or {}).get("num_tokens"),
            "phases_s": man["conversion"].get("phases_s"), "peak_at_start_mb": man["conversion"].get("peak_at_start_mb"),
            "peak_raised_mb": man["conversion"].get("peak_raised_mb")}


def linears(shape: str) -> list[tuple[str, int, int, int]]:
    """(name, out, in, sequential group) of one decoder layer's Linears."""
    s = SHAPES[shape]
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    return [("q_proj", h, h, 0), ("k_proj", kv, h, 0), ("v_proj", kv, h, 0), ("o_proj", h, h, 1),
            ("gate_proj", i, h, 2), ("up_proj", i, h, 2), ("down_proj", h, i, 3)]


def bound_parts_mb(shape: str, method: str, samples: int, seq_len: int, baseline_mb: float, compute: str) -> dict:
    """What the conversion's peak RSS should stay within, part by part (MB): the imports, the largest layer's
    weights in the compute dtype, its largest GPTQ Hessian (fp32) and the calibration activations (a layer's
    input and output for the whole batch, in the compute dtype)."""
    s = SHAPES[shape]
    h, i = s["hidden_size"], s["intermediate_size"]
    layer_params = sum(o * n for _, o, n, _ in linears(shape))
    size = 2 if compute == "bfloat16" else 4
    calibrated = any(st["method"] in CALIBRATED for st in METHODS[method])
    hessian = max(h, i) ** 2 * 4 if any(st["method"] in ("gptq", "autoround") for st in METHODS[method]) else 0
    acts = 2 * samples * seq_len * h * size if calibrated else 0
    return {"imports": round(baseline_mb), "layer_weights": round(layer_params * size / 1e6),
            "hessian": round(hessian / 1e6), "activations": round(acts / 1e6)}


def bound_mb(shape: str, method: str, samples: int, seq_len: int, baseline_mb: float, compute: str) -> float:
    return sum(bound_parts_mb(shape, method, samples, seq_len, baseline_mb, compute).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--samples", type=int, default=16, help="calibration samples for GPTQ")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--work", type=Path, default=None, help="where checkpoints and outputs go (kept)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (quantkit convert --device)")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the JSON document to this file")
    args = ap.parse_args()
    from quantkit.hardware import hardware

    work = args.work or Path(tempfile.mkdtemp(prefix="quantkit-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    base = import_baseline_mb(work / "import_baseline_mb.txt")
    rows = []
    for run in args.runs.split(","):
        target, method = run.split(":")
        shape, layers = target.rsplit("-", 1)
        t0 = time.perf_counter()
        model = write_checkpoint(work / f"{shape}-{layers}", shape, int(layers))
        write_s = time.perf_counter() - t0
        r = convert(model, work / f"out-{shape}-{layers}-{method}", method, args.samples, args.seq_len, args.device)
        full = SHAPES[shape]["num_hidden_layers"]
        mean = sum(r["per_layer_s"]) / len(r["per_layer_s"])
        r.update(run=run, layers=int(layers), full_layers=full, checkpoint_write_s=round(write_s, 1),
                 mean_layer_s=round(mean, 1), extrapolated_full_model_s=round(mean * full),
                 bound_mb=round(bound_mb(shape, method, args.samples, args.seq_len, base, r["compute_dtype"])),
                 bound_parts_mb=bound_parts_mb(shape, method, args.samples, args.seq_len, base, r["compute_dtype"]))
        r["peak_over_bound"] = round(r["peak_rss_mb"] / r["bound_mb"], 3)
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
        shutil.rmtree(work / f"out-{shape}-{layers}-{method}", ignore_errors=True)
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"hardware": hardware(), "import_baseline_mb": round(base), "samples": args.samples,
           "seq_len": args.seq_len, "runs": rows}
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
