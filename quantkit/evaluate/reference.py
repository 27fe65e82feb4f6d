"""The engine-free reference column: perplexity of the same weights on the same token windows, computed
by transformers in float32, beside the engine's figure.

Why: a candidate can lose more inside the engine than its weights lose in a reference computation (the
export may mean something slightly different to the engine, or its kernels compute differently). With
both figures for both sides the report separates the two:

    engine_vs_reference (per side) = ppl_engine / ppl_reference - 1
    engine_gap (candidate)         = (ppl_engine_c / ppl_engine_b) / (ppl_reference_c / ppl_reference_b) - 1
                                   = (1 + evr_c) / (1 + evr_b) - 1

i.e. how much more the candidate degrades in the engine than in the reference; 0 for the baseline by
definition (as its KL is). A gate can use `quality.engine_gap`; report.md flags a candidate above
ENGINE_GAP_FLAG.

The windows are quantkit.evaluate.quality.windows over the suite's perplexity files with the suite's
window and per-file limit, tokenized by the same tokenizer: exactly the tokens the engine scored, and no
more (the cost bound). The model is loaded with `hf_perplexity.load_for_perplexity` (safetensors only;
a compressed-tensors export is decompressed by transformers' compressed-tensors integration, which also
applies the scheme's dynamic activation quantization in its forward), in float32 on the CPU. A model
whose float32 weights would not fit in half of the memory available now is skipped, with the reason on
record, rather than risk the machine.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import psutil


ENGINE_GAP_FLAG = 0.02  # report.md flags a candidate whose engine degradation exceeds the reference's by > 2%
MEMORY_SHARE = 0.5  # float32 weights may use at most this share of the memory available at the time


def _param_count(model_dir: Path) -> int | None:
    """Parameters of a model from its config (attention with grouped k/v heads, gated MLP, experts, embeddings;
    norms and biases left out), None if the config lacks the sizes."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    h, layers, vocab = cfg.get("hidden_size"), cfg.get("num_hidden_layers"), cfg.get("vocab_size")
    inter = cfg.get("intermediate_size") or (4 * h if h else None)
    if not all(isinstance(x, int) for x in (h, layers, vocab, inter)):
        return None
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 1
    tied = bool(cfg.get("tie_word_embeddings"))
    heads = cfg.get("num_attention_heads") or 1
    head_dim = cfg.get("head_dim") or h // heads
    kv = (cfg.get("num_key_value_heads") or heads) * head_dim  # grouped-query attention: smaller k and v
    attn = 2 * h * heads * head_dim + 2 * h * kv
    return layers * (attn + 3 * h * inter * experts) + vocab * h * (1 if tied else 2)


def reference_perplexity(model_dir: Path, files: list[Path], tokenizer, window: int, max_tokens: int | None,
                         batch: int = 4) -> dict:
    """{"perplexity", "tokens", "per_file", "windows": {"logprob_sum", "positions"}, "dtype", "engine",
    "seconds"} for one model on the suite's windows, or {"skipped": reason} (see the module docstring)."""
    import torch
    import transformers

    from quantkit.evaluate.hf_perplexity import file_window_nlls, load_for_perplexity

    params = _param_count(model_dir)
    avail = psutil.virtual_memory().available
    if params is not None and params * 4 > MEMORY_SHARE * avail:
        return {"skipped": f"float32 weights (~{params * 4 / 2**30:.1f} GiB) exceed {MEMORY_SHARE:.0%} of the "
                           f"{avail / 2**30:.1f} GiB available"}
    t0 = time.perf_counter()
    model, _ = load_for_perplexity(model_dir, torch.float32)
    try:
        sums, sizes, per_file = [], [], {}
        for name, per in file_window_nlls(model, tokenizer, files, window, max_tokens, batch).items():
            nll, n = math.fsum(x for x, _ in per), sum(k for _, k in per)
            per_file[name] = {"tokens": n, "perplexity": math.exp(nll / n)}
            sums += [-x for x, _ in per]
            sizes += [k for _, k in per]
    finally:
        del model
    total = sum(sizes)
    return {"perplexity": math.exp(-math.fsum(sums) / total), "tokens": total, "per_file": per_file,
            "windows": {"logprob_sum": sums, "positions": sizes}, "dtype": "float32",
            "engine": f"transformers {transformers.__version__}", "seconds": time.perf_counter() - t0}


def engine_vs_reference(engine_ppl: float | None, reference_ppl: float | None) -> float | None:
    if not isinstance(engine_ppl, (int, float)) or not isinstance(reference_ppl, (int, float)) or reference_ppl <= 0:
        return None
    return engine_ppl / reference_ppl - 1.0


def engine_gap(base: dict | None, cand: dict | None) -> float | None:
    """(1 + evr_candidate) / (1 + evr_baseline) - 1 from two sides' quality/reference figures; None if a
    figure is missing."""
    evr = [engine_vs_reference(((s or {}).get("quality") or {}).get("perplexity"),
                               ((s or {}).get("reference") or {}).get("perplexity")) for s in (base, cand)]
    if evr[0] is None or evr[1] is None:
        return None
    return (1.0 + evr[1]) / (1.0 + evr[0]) - 1.0
