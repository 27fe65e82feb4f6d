"""Mixture-of-experts coverage, measured: scheme x family -> converts (GPTQ, every expert calibrated),
reloads exactly, serves here, quality against the bf16 model. Prints one JSON document.

    python benchmarks/moe.py [--schemes W4A16 W8A8 ...] [--families qwen3_moe mixtral] [--output runs/bench-moe]

There is no trained MoE checkpoint on this machine (no model hub), so each family is a small random model
built from its transformers config (hidden 256, 8 experts, 2 per token, head_dim 64, the demo model's
tokenizer). Its figures say whether the pipeline, the export and the engine agree; its quality column is
the quantization error on random weights, not a trained model's.

- converts: `quantkit convert` with GPTQ on 16 x 128 tokens of the builtin prose corpus; the expert token
  counts and fallbacks come from the manifest.
- reloads exactly: every quantized weight decompressed from the export (transformers, through
  compressed-tensors' compressors) equals quantkit's fake-quantized weight, bit for bit.
- serves here: the capability check first; where it allows, vLLM serves the export, generates 16 greedy
  tokens, and the engine's log-probabilities are compared with the reference's (teacher-forced).
- quality: perplexity ratio and mean KL(bf16 || quantized) of the references on 1,024 held-out tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SIZES = {
    "qwen3_moe": dict(hidden_size=256, head_dim=64, moe_intermediate_size=128, intermediate_size=256, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True),
    "mixtral": dict(hidden_size=256, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}


def build(family: str, tokenizer_dir: Path, dest: Path) -> Path:
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(family, vocab_size=len(tok), max_position_embeddings=1024,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SIZES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embed" not in name:
                p.normal_(0, 0.05)
    dest.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                                         "merges.txt")):
            shutil.copy2(f, dest / f.name)
    return dest


def quality(float_model, quant_model, ids: torch.Tensor) -> dict:
    with torch.no_grad():
        a = torch.log_softmax(float_model(ids).logits[:, :-1].float(), -1)
        b = torch.log_softmax(quant_model(ids).logits[:, :-1].float(), -1)
    tgt = ids[:, 1:, None]
    nll_a, nll_b = -a.gather(-1, tgt).mean(), -b.gather(-1, tgt).mean()
    kl = (a.exp() * (a - b)).sum(-1).mean()
    return {"ppl_ratio": round(float(torch.exp(nll_b - nll_a)), 4), "kl": round(float(kl), 5)}


def serve(out: Path, run_dir: Path, reference, prompt: list[int]) -> dict:
    import httpx

    from quantkit.engine.vllm_server import VLLMServer

    t0 = time.perf_counter()
    with VLLMServer(out, run_dir, "moe", max_model_len=512, ready_timeout_s=900) as ep:
        r = httpx.post(f"{ep.base_url}/v1/completions", timeout=300,
                       json={"model": ep.model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1,
                             "return_tokens_as_token_ids": True})
    if r.status_code != 200:
        return {"served": False, "error": r.text[:300]}
    lp = r.json()["choices"][0]["logprobs"]
    tokens = [int(t.split(":")[1]) for t in lp["tokens"]]
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        ref = torch.log_softmax(reference(seq).logits[0].float(), -1)
    ref_lp = torch.stack([ref[len(prompt) - 1 + i, t] for i, t in enumerate(tokens)])
    diff = (torch.tensor(lp["token_logprobs"]) - ref_lp).abs()
    return {"served": True, "logprob_max_abs_diff": round(float(diff.max()), 4),
            "logprob_mean_abs_diff": round(float(diff.mean()), 4), "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=["W4A16", "W8A8", "FP8_DYNAMIC", "NVFP4A16", "MXFP4A16"])
    ap.add_argument("--families", nargs="+", default=sorted(SIZES))
    ap.add_argument("--output", default="runs/bench-moe")
    ap.add_argument("--no-serve", action="store_true")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit import api, hardware
    from quantkit.engine.capability import recipe_can_run
    from quantkit.evaluate.hf_perplexity import load_for_perplexity
    from quantkit.model.sources import resolve_model_dir
    from quantkit.recipe import ModelSpec, parse_recipe

    root = Path(args.output)
    demo = resolve_model_dir(ModelSpec(path="smollm2-135m"), quiet=True)
    text = (Path(__file__).resolve().parents[1] / "calibration" / "heldout" / "technical.txt").read_text()
    rows = []
    for family in args.families:
        float_dir = build(family, demo, root / family / "bf16")
        ids = AutoTokenizer.from_pretrained(float_dir)(text, return_tensors="pt").input_ids[0, :1024].reshape(8, 128)
        float_model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
        for scheme in args.schemes:
            stage = {"method": "gptq", "scheme": scheme, "ignore": ["lm_head"]}
            if scheme.startswith("W4A16"):
                stage["group_size"] = 64
            r = parse_recipe({"name": f"{family}-{scheme}", "model": {"path": str(float_dir), "dtype": "bfloat16"},
                              "calibration": {"sources": [{"type": "builtin", "name": "prose"}], "num_samples": 16,
                                              "seq_len": 128},
                              "stages": [stage]})
            row = {"family": family, "scheme": scheme}
            cap: dict = {}
            t0 = time.perf_counter()
            try:
                out = api.convert(r, root / family / scheme, quiet=True, overwrite=True, preflight="capability",
                                  on_weight=cap.__setitem__)
            except Exception as exc:  # a cell that fails is a finding, not the end of the table
                rows.append({**row, "converts": False, "error": str(exc)[:300]})
                continue
            row["converts"], row["convert_s"] = True, round(time.perf_counter() - t0, 1)
            man = json.loads((out / "manifest.json").read_text())
            tokens = {k.rsplit(".", 1)[0]: v["expert_tokens"] for k, v in man["layers"].items() if "expert_tokens" in v}
            row["expert_tokens_min_max"] = [min(tokens.values()), max(tokens.values())]
            row["experts_fallback"] = sum(1 for k, v in man["layers"].items()
                                          if v.get("expert_calibration", "routed") != "routed") // 3
            quant, _ = load_for_perplexity(out)
            exact = True
            for name, want in cap.items():
                if ".experts." in name:
                    parts = name.split(".")
                    experts = quant.model.layers[int(parts[2])].mlp.experts
                    e, lin = int(parts[-2]), parts[-1]
                    inter = experts.down_proj.shape[-1]
                    got = (experts.down_proj[e] if lin in ("down_proj", "w2") else
                           experts.gate_up_proj[e][:inter] if lin in ("gate_proj", "w1") else experts.gate_up_proj[e][inter:])
                else:
                    got = quant.get_submodule(name).weight
                exact &= torch.equal(got.float(), want.float())
            row["reloads_exactly"] = bool(exact)
            row.update(quality(float_model, quant, ids))
            ok, why = recipe_can_run(r, "cpu")
            if args.no_serve or not ok:
                row["serves_here"] = None if args.no_serve else False
                row["serve_reason"] = "not asked" if args.no_serve else why
            else:
                res = serve(out, root / family / f"{scheme}-engine", quant, ids[0, :16].tolist())
                row["serves_here"] = res.pop("served")
                row.update(res)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"cpu": hardware.cpu_kind(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
