"""The Intel auto-round anchor (SignRound, W4 group 64 symmetric), run on CPU with quantkit's own calibration tokens.

auto-round pins other versions of transformers than quantkit, so it lives in its own venv:

    python3.11 -m venv /tmp/autoround-venv
    /tmp/autoround-venv/bin/pip install torch==2.13.0 && /tmp/autoround-venv/bin/pip install "auto-round==0.16.*" torch==2.13.0
    python benchmarks/anchor_autoround.py --python /tmp/autoround-venv/bin/python --samples 8 --seq-len 256 --iters 10

The script (in quantkit's venv) writes the calibration token ids of `recipes/smollm2-w4a16-gptq.yaml` (with the
given sample count and sequence length) to a safetensors file, runs auto-round's `AutoRound(...).quantize()` in the
auto-round venv as a child process, and saves the fake-quantized model (the dequantized int4 weights, in the dtype
auto-round loaded the model in: bfloat16) as a plain transformers checkpoint, so that the perplexity is measured by
the same transformers code as `benchmarks/convert.py` without auto-round installed. Prints one JSON document.

The token ids are passed to auto-round as they are (a list of {input_ids, attention_mask} batches of one sample; no
text, no re-tokenization). auto-round leaves the positions holding the tokenizer's pad token (<|im_end|> for SmolLM2,
which the chat calibration text contains) and each sample's last position out of its block-output loss: its own rule.
`layers=N` quantizes only the first N decoder layers (auto-round's `to_quant_block_names`; the others stay float) so a
slow setting still gives a per-layer time; `per_layer_s` is auto-round's logged tuning time over the layers it tuned.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import torch
from anchor_child import demo_calibration, first_ids, run_child

CHILD = r"""
import json, sys, time, torch
from safetensors.torch import load_file
from transformers import AutoTokenizer
import auto_round
from auto_round import AutoRound

model_dir, ids_file, out_dir, cfg = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
t0 = time.perf_counter()
ids = load_file(ids_file)["input_ids"]                                  # [samples, seq_len], our exact tokens
data = [{"input_ids": row[None], "attention_mask": torch.ones_like(row[None])} for row in ids]
kw = {"lr": cfg["lr"]} if cfg["lr"] is not None else {}
if cfg.get("dtype") == "float32":                                      # no mixed precision: fp32 throughout
    kw.update(amp=False, model_dtype="float32")
if cfg["layers"] is not None:                                           # only the first N decoder layers
    kw["to_quant_block_names"] = [[f"model.layers.{i}" for i in range(cfg["layers"])]]
ar = AutoRound(model_dir, scheme="W4A16", bits=cfg["bits"], group_size=cfg["group_size"], sym=cfg["sym"],
               dataset=data, iters=cfg["iters"], nsamples=ids.shape[0], seqlen=ids.shape[1],
               batch_size=cfg["batch_size"], device_map="cpu", **kw)
t1 = time.perf_counter()
model, layer_config = ar.quantize()                                     # weights are now quantize-dequantized in place
t2 = time.perf_counter()
model.config.quantization_config = None
model.save_pretrained(out_dir)                                          # a plain float checkpoint
AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))  # KiB, this process only
print(json.dumps({"convert_s": round(time.perf_counter() - t0, 1), "quantize_s": round(t2 - t1, 1),
                  "peak_rss_mb": round(hwm * 1024 / 1e6), "auto_round": auto_round.__version__,
                  "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": str(model.dtype)}))
"""


def _block_times(log: str) -> tuple[list[int], list[int]]:
    """Per decoder block: seconds from the previous block's end (the first from 'caching done'; it includes
    torch.compile's warm-up where auto-round enables it, iters >= 10) to the log line after its 'quantized ...
    in the block' line, and the SignRound step whose loss was kept (0: no step beat round-to-nearest)."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", log).replace("\r", "\n").splitlines()
    stamp = lambda l: re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) ", l)  # noqa: E731
    secs = lambda m: time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))  # noqa: E731
    last, pending, block_s, best = None, False, [], []
    for line in lines:
        m = stamp(line)
        if m and "caching done" in line:
            last = secs(m)
        elif m and pending and last is not None:
            block_s.append(round(secs(m) - last))
            last, pending = secs(m), False
        if (b := re.search(r"layers in the block, loss iter 0: \S+ -> iter (\d+)", line)):
            best.append(int(b.group(1)))
            pending = True
    return block_s, best


def run_autoround(python: str, model_dir: Path, ids: torch.Tensor, out_dir: Path, iters: int, nsamples: int,
                  seqlen: int, group_size: int = 64, bits: int = 4, sym: bool = True, lr: float | None = None,
                  layers: int | None = None, batch_size: int = 8, dtype: str | None = None) -> dict:
    """Quantize `model_dir` with auto-round (in the venv of `python`) on the first `nsamples` x `seqlen` of `ids`
    ([samples, seq_len] int64), writing a fake-quantized transformers checkpoint to `out_dir`. Returns what was run,
    the parent's wall time, the child's convert time and peak RSS, and the per-layer tuning time from its log.
    `dtype`: None runs auto-round's default (bf16 autocast on the CPU, native or emulated); "float32" turns its
    mixed precision off (`amp=False, model_dtype="float32"`), to compare with a float32 row at the same dtype."""
    from safetensors.torch import save_file

    ids = first_ids(ids, nsamples, seqlen)      # auto-round skips shorter samples and does not cut longer ones
    cfg = {"iters": iters, "group_size": group_size, "bits": bits, "sym": sym, "lr": lr, "layers": layers,
           "batch_size": batch_size, "dtype": dtype}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qk-autoround-") as td:
        ids_file = Path(td) / "ids.safetensors"
        save_file({"input_ids": ids}, str(ids_file))
        child, log, wall = run_child(python, CHILD, [str(model_dir), str(ids_file), str(out_dir), json.dumps(cfg)],
                                     "auto-round")
    (out_dir / "autoround.log").write_text(log)
    tuning = re.search(r"quantization tuning time ([\d.]+)", log)
    summary = re.search(r"Summary: quantized (\d+)/(\d+)", log)
    tuning_s = float(tuning.group(1)) if tuning else None
    block_s, best_iter = _block_times(log)
    blocks = len(best_iter)
    return {"anchor": "auto-round", "run": f"AutoRound(scheme=W4A16, bits={bits}, group_size={group_size}, sym={sym}, "
                                           f"iters={iters}, lr={lr or '1/iters'}, batch_size={batch_size}, "
                                           + ("amp=False, model_dtype=float32, " if dtype == "float32" else "")
                                           + "device_map=cpu).quantize()", **cfg, "nsamples": nsamples,
            "seqlen": seqlen, "wall_s": round(wall, 1), **child, "tuning_s": tuning_s, "blocks_tuned": blocks,
            "per_layer_s": round(tuning_s / blocks, 2) if tuning_s and blocks else None,  # mean, 1st block too
            "block_s": block_s, "best_iter": best_iter,   # per block, from log timestamps (1 s); best SignRound step
            "linears_quantized": f"{summary.group(1)}/{summary.group(2)}" if summary else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the auto-round venv's python")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=200, help="SignRound steps per layer (auto-round's default 200)")
    ap.add_argument("--lr", type=float, default=None, help="default: auto-round's 1/iters")
    ap.add_argument("--layers", type=int, default=None, help="quantize only the first N decoder layers")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", choices=["float32"], default=None,
                    help="float32: auto-round without mixed precision (default: its own, bf16 on the CPU)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the fake-quantized checkpoint in this folder")
    args = ap.parse_args()
    from convert import perplexity
    from quantkit.hardware import hardware

    model_dir, calib = demo_calibration(args.samples, args.seq_len)
    with tempfile.TemporaryDirectory(prefix="qk-anchor-") as td:
        out = args.keep or Path(td) / "autoround"
        res = run_autoround(args.python, model_dir, calib.input_ids, out, iters=args.iters, nsamples=args.samples,
                            seqlen=args.seq_len, lr=args.lr, layers=args.layers, batch_size=args.batch_size, dtype=args.dtype)
        result = {"hardware": hardware(), "calibration_fingerprint": calib.fingerprint[:16], **res,
                  "perplexity": perplexity(out)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
