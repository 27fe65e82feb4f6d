"""Golden exports: the working tree converts exactly the bytes another commit converts (issue 32).

A restructuring must not move a single exported bit. This converts a set of tiny random models, one recipe
per method, format and pipeline path (RTN, GPTQ, AWQ, SmoothQuant, FP8, NVFP4/MXFP4, asymmetric int4,
QAT, the FP8 KV cache, two MoE families, a mixed-precision recipe, two processes), once with the working
tree and once with `--ref` (checked out into a temporary git worktree), and compares every exported file
byte for byte. manifest.json is compared without what is measured rather than decided (timings, memory,
creation time, versions, paths, the log's size), and convert.log not at all.

    python benchmarks/golden_exports.py --ref main            # or a commit; prints one JSON line per case
    python benchmarks/golden_exports.py --ref HEAD~3 --cases gptq-w4a16,qat

The inputs (tiny models, calibration text) are built once, by the working tree, and shared by both sides.
Both sides run in this Python (the same torch and thread count), so any difference is the code's.
Exit status: 0 when every case is identical, 1 when any differs or fails on one side only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEXT = """Quantization maps each weight to one of a few levels; a scale per group keeps the error small.
GPTQ spreads the rounding error of one column over the columns that are not yet quantized.
def area(w, h):\n    return w * h\n\nfor k in range(5):\n    print(area(k, k + 1))\n
{"order": 41, "items": ["bolt", "nut"], "total": 12.75}
The ferry left at 07:05 and docked at 08:50; the fare was 14.20 for a 61 km crossing.
"""
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True)
MODELS = {
    "llama": ("llama", LLAMA),
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                    num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    tie_word_embeddings=True)),
    "mixtral": ("mixtral", dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                tie_word_embeddings=False)),
}
Q4 = {"scheme": "W4A16", "group_size": 32}
# name -> (model, stages, extra recipe fields, extra convert arguments)
CASES = {
    "rtn-w4a16": ("llama", [{"method": "rtn", **Q4}], {}, []),
    "rtn-w8a8": ("llama", [{"method": "rtn", "scheme": "W8A8"}], {}, []),
    "rtn-w4a16-asym": ("llama", [{"method": "rtn", "scheme": "W4A16_ASYM", "group_size": 32}], {}, []),
    "rtn-fp8": ("llama", [{"method": "rtn", "scheme": "FP8_DYNAMIC"}], {}, []),
    "gptq-w4a16": ("llama", [{"method": "gptq", **Q4, "actorder": "static"}], {}, []),
    "gptq-w8a8": ("llama", [{"method": "gptq", "scheme": "W8A8"}], {}, []),
    "gptq-nvfp4": ("llama", [{"method": "gptq", "scheme": "NVFP4A16"}], {}, []),
    "gptq-mxfp4": ("llama", [{"method": "gptq", "scheme": "MXFP4A16"}], {}, []),
    "awq-gptq": ("llama", [{"method": "awq", "grid": 4}, {"method": "gptq", **Q4}], {}, []),
    "smoothquant-gptq": ("llama", [{"method": "smoothquant"}, {"method": "gptq", "scheme": "W8A8"}], {}, []),
    "mixed": ("llama", [{"method": "gptq", "scheme": "W8A8", "targets": ["re:.*down_proj"]},
                        {"method": "gptq", **Q4, "targets": ["Linear"], "ignore": ["lm_head", "re:.*down_proj"]}],
              {}, []),
    "qat": ("llama", [{"method": "gptq", **Q4},
                      {"method": "qat", **Q4, "steps": 3, "lr": 1e-4, "warmup_steps": 1, "batch_size": 1,
                       "seq_len": 32, "grad_accum": 1, "eval_every": 2, "eval_samples": 2, "seed": 0}], {}, []),
    "kv-fp8": ("llama", [{"method": "rtn", "scheme": "W8A8"}], {"kv_cache": {"scheme": "FP8", "strategy": "tensor"}},
               []),
    "moe-qwen3-gptq": ("qwen3_moe", [{"method": "gptq", **Q4}], {}, []),
    "moe-mixtral-w8a8": ("mixtral", [{"method": "rtn", "scheme": "W8A8"}], {}, []),
    "gptq-nproc2": ("llama", [{"method": "gptq", **Q4}], {}, ["--nproc", "2"]),
}
# manifest fields that are measured or situational, not decided by the code under comparison
VOLATILE = {"created", "conversion", "versions", "resolved_dir", "path", "wall_time_s", "seconds", "time_s",
            "peak_rss_bytes", "elapsed_s", "duration_s", "progress", "size_bytes"}


def build_inputs(root: Path) -> dict[str, Path]:
    """The tiny models (bf16 safetensors + a BPE tokenizer trained on TEXT) and a calibration folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.model.tokenizer import CHAT_TEMPLATE, build_tokenizer

    out = {}
    for name, (model_type, kw) in MODELS.items():
        folder = root / "models" / name
        folder.mkdir(parents=True)
        tok = build_tokenizer(folder, [TEXT] * 4, 384, CHAT_TEMPLATE)
        config = AutoConfig.for_model(model_type, vocab_size=len(tok), max_position_embeddings=512,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id, **kw)
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.ndim >= 2 and "embed" not in pname:
                    p.normal_(0, 0.08)
                    p[..., :3] *= 4.0  # a few loud input channels, as trained models have
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
        out[name] = folder
    calib = root / "calib"
    calib.mkdir()
    for i in range(6):
        (calib / f"doc{i}.txt").write_text((TEXT + f"\nPage {i}.\n") * 3)
    out["calib"] = calib
    return out


def recipe_for(case: str, inputs: dict[str, Path]) -> dict:
    model, stages, extra, _ = CASES[case]
    return {"name": f"golden-{case}", "model": {"path": str(inputs[model]), "dtype": "bfloat16",
                                                "compute_dtype": "float32"},
            "calibration": {"sources": [{"type": "text", "path": str(inputs["calib"] / "*.txt")}],
                            "num_samples": 8, "seq_len": 32, "seed": 0, "batch_size": 3},
            "stages": stages, **extra}


def convert(tree: Path, recipe: Path, out: Path, extra: list[str], home: Path) -> tuple[bool, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "QUANTKIT_HOME": str(home), "QUANTKIT_PREFLIGHT": "capability",
           "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "quantkit", "convert", str(recipe), "-o", str(out), "-q", *extra],
                       cwd=tree, env=env, capture_output=True, text=True)
    return p.returncode == 0, (p.stderr or p.stdout).strip()[-400:]


def stable(obj):
    """manifest.json without what is measured rather than decided."""
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items() if k not in VOLATILE and not k.endswith("_s")}
    if isinstance(obj, list):
        return [stable(v) for v in obj]
    return obj


def fingerprint(folder: Path) -> dict[str, str]:
    out = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = str(f.relative_to(folder))
        if rel.endswith(".log"):  # the conversion's log: timestamps and timings
            continue
        if rel == "manifest.json":
            man = stable(json.loads(f.read_text()))
            man.pop("files", None)  # the file table holds manifest-independent hashes, compared below anyway
            out[rel] = hashlib.sha256(json.dumps(man, sort_keys=True).encode()).hexdigest()
        else:
            out[rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def compare(case: str, inputs: dict, trees: dict[str, Path], work: Path) -> dict:
    import yaml

    recipe = work / f"{case}.yaml"
    recipe.write_text(yaml.safe_dump(recipe_for(case, inputs), sort_keys=False))
    prints, row = {}, {"case": case}
    for side, tree in trees.items():
        t0 = time.time()
        ok, tail = convert(tree, recipe, work / side / case, CASES[case][3], work / side / "home")
        row[f"{side}_s"] = round(time.time() - t0, 1)
        prints[side] = fingerprint(work / side / case) if ok else None
        if not ok:
            row[f"{side}_error"] = tail
    a, b = prints["ref"], prints["tree"]
    if a is None or b is None:
        row["status"] = "both failed" if a is None and b is None else "FAILED on one side"
    else:
        diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        row.update(status="identical" if not diff else "DIFFERENT", files=len(b), differing=diff)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="the commit (or branch) whose exports are the golden ones")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    work = Path(tempfile.mkdtemp(prefix="quantkit-golden."))
    ref_tree = work / "ref-tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(ref_tree), args.ref], check=True)
    try:
        sha = subprocess.run(["git", "-C", str(ref_tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        print(json.dumps({"ref": args.ref, "ref_commit": sha, "work": str(work)}), flush=True)
        inputs = build_inputs(work / "inputs")
        rows = [compare(c, inputs, {"ref": ref_tree, "tree": REPO}, work) for c in cases]
        for r in rows:
            print(json.dumps(r), flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(ref_tree)], check=False)
        if not args.keep:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    bad = [r["case"] for r in rows if r["status"] not in ("identical",)]
    print(json.dumps({"summary": True, "cases": len(rows), "identical": len(rows) - len(bad), "not_identical": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
