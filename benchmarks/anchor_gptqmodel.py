"""The GPTQModel anchor (GPTQ, W4 group 64 symmetric, its defaults otherwise), run on CPU with quantkit's own
calibration tokens.

GPTQModel pins other versions of transformers than quantkit, and 7.7 needs a torch newer than vLLM's, so it lives in
its own venv (7.6.0 is the newest that takes torch 2.13.0; its C++/CUDA kernels are not built, which the CPU run
does not need):

    python3.11 -m venv /tmp/gq-venv
    /tmp/gq-venv/bin/pip install torch==2.13.0 setuptools wheel
    BUILD_CUDA_EXT=0 /tmp/gq-venv/bin/pip install --no-build-isolation "gptqmodel<7.7" torch==2.13.0
    python benchmarks/anchor_gptqmodel.py --python /tmp/gq-venv/bin/python --samples 8 --seq-len 256

The child (in GPTQModel's venv) loads the model in float32, runs `GPTQModel.load(model, QuantizeConfig(bits=4,
group_size=64, sym=True)).quantize(...)` on our exact token ids (a list of {input_ids, attention_mask}, one sample
each; no text, no re-tokenization), saves its GPTQ checkpoint, loads that back with its pure-torch kernel and writes
every quantized Linear's dequantized weight (its own unpacking, the fp16 scales multiplied in float32) into a plain transformers
checkpoint, so the perplexity is measured by the same transformers code as `benchmarks/convert.py` without GPTQModel
installed there. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from anchor_child import demo_calibration, first_ids, run_child

CHILD = r"""
import json, sys, time, torch
from safetensors.torch import load_file
from transformers import AutoTokenizer
import gptqmodel
# its thread pool gives the CPU (cores + 1) // 2 workers and its model loader 2 of them: on 2 cores it refuses to
# start ("requests 2 workers but parent 'cpu' only has 1"); 2 CPU workers, as on 3 or 4 cores
gptqmodel._default_cpu_workers = lambda: max(2, ((__import__("os").cpu_count() or 1) + 1) // 2)
from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
from gptqmodel.nn_modules.qlinear.torch import TorchLinear

model_dir, ids_file, out_dir, q_dir, cfg = sys.argv[1:5] + [json.loads(sys.argv[5])]
t0 = time.perf_counter()
ids = load_file(ids_file)["input_ids"]                                  # [samples, seq_len], our exact tokens
data = [{"input_ids": row[None], "attention_mask": torch.ones_like(row[None])} for row in ids]
qc = QuantizeConfig(bits=cfg["bits"], group_size=cfg["group_size"], sym=cfg["sym"], offload_to_disk=False)
model = GPTQModel.load(model_dir, qc, device="cpu", dtype=torch.float32)
t1 = time.perf_counter()
model.quantize(data, batch_size=cfg["batch_size"], calibration_sort=None)
t2 = time.perf_counter()
model.save(q_dir)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))  # KiB, to here
q = GPTQModel.load(q_dir, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)  # its kernel: fp16/bf16 only
hf, n = q.model, 0
for name, mod in list(hf.named_modules()):
    if isinstance(mod, TorchLinear):                                    # its own dequantization, in float32
        lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, dtype=torch.float32)
        with torch.no_grad():  # scales as stored (fp16), multiplied in fp32: each code x scale exact
            mod.scales = mod.scales.float()
            lin.weight.copy_(super(TorchLinear, mod).dequantize_weight().T.float())  # not its compiled, cached path
            if mod.bias is not None:
                lin.bias.copy_(mod.bias.float())
        parent, _, leaf = name.rpartition(".")
        setattr(hf.get_submodule(parent), leaf, lin)
        n += 1
del hf.config.quantization_config
hf.to(torch.float32).save_pretrained(out_dir)                           # a plain float checkpoint
AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
print(json.dumps({"convert_s": round(t2 - t0, 1), "quantize_s": round(t2 - t1, 1), "peak_rss_mb": round(hwm * 1024 / 1e6),
                  "gptqmodel": gptqmodel.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "desc_act": qc.desc_act, "damp_percent": qc.damp_percent, "linears_quantized": n}))
"""


def run_gptqmodel(python: str, model_dir: Path, ids: torch.Tensor, out_dir: Path, nsamples: int, seqlen: int,
                  group_size: int = 64, bits: int = 4, sym: bool = True, batch_size: int = 1) -> dict:
    """Quantize `model_dir` with GPTQModel (in the venv of `python`) on the first `nsamples` x `seqlen` of `ids`
    ([samples, seq_len] int64), writing a dequantized float32 transformers checkpoint to `out_dir`. Returns what was
    run, the parent's wall time and the child's convert time (load + quantize; not the save and dequantization
    that only serve this measurement) and its peak RSS to the end of the quantization's save."""
    from safetensors.torch import save_file

    ids = first_ids(ids, nsamples, seqlen)
    cfg = {"group_size": group_size, "bits": bits, "sym": sym, "batch_size": batch_size}
    out_dir = Path(out_dir).resolve()  # the child runs in its own folder
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qk-gptqmodel-") as td:
        ids_file = Path(td) / "ids.safetensors"
        save_file({"input_ids": ids}, str(ids_file))
        # cwd: GPTQModel writes a log folder (logs/gptq_log_*.log) into its working directory
        child, log, wall = run_child(python, CHILD, [str(model_dir), str(ids_file), str(out_dir), str(Path(td) / "q"),
                                                     json.dumps(cfg)], "GPTQModel", cwd=Path(td))
    (out_dir / "gptqmodel.log").write_text(log)
    return {"anchor": "GPTQModel", "run": f"GPTQModel.load(model, QuantizeConfig(bits={bits}, group_size={group_size}, "
                                          f"sym={sym}), dtype=float32).quantize(batch_size={batch_size})",
            **cfg, "nsamples": nsamples, "seqlen": seqlen, "wall_s": round(wall, 1), **child}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the GPTQModel venv's python")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=1)
    args = ap.parse_args()
    from convert import perplexity
    from quantkit.hardware import hardware

    model_dir, calib = demo_calibration(args.samples, args.seq_len)
    with tempfile.TemporaryDirectory(prefix="qk-anchor-") as td:
        out = Path(td) / "gptqmodel"
        res = run_gptqmodel(args.python, model_dir, calib.input_ids, out, nsamples=args.samples,
                            seqlen=args.seq_len, batch_size=args.batch_size)
        result = {"hardware": hardware(), "calibration_fingerprint": calib.fingerprint[:16], **res,
                  "perplexity": perplexity(out)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
