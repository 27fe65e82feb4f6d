"""Validation: the proxy checked against what it stands for, the full-model KL from the float model on
held-out text with only the chosen units quantized (transformers, fp32), and the factor that turns summed
proxy errors into a predicted KL."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from quantkit.schemes import Scheme
from quantkit.tune.sensitivity.units import PROXIES, Unit, use_proxy


class FullModelKL:
    """KL(float || quantized) per token on held-out windows, with chosen modules' weights swapped in."""

    def __init__(self, model_dir: Path, files: list[Path], tokens: int = 1024, window: int = 512,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from quantkit.evaluate.hf_perplexity import token_windows

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True,
                                                          trust_remote_code=trust_remote_code).eval()
        tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        self.files = [Path(f) for f in files]
        per_file = max(tokens // max(len(files), 1), window)
        self.windows = [w for f in files for w in token_windows(Path(f).read_text(encoding="utf-8"), tok, window, per_file)]
        if not self.windows:
            raise ValueError(f"{', '.join(map(str, files))}: no held-out text to measure KL on")
        self.ref = [self._logp(w) for w in self.windows]
        self.tokens = sum(len(w) for w in self.windows)

    @staticmethod
    @torch.no_grad()
    def _logp_of(model, w: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(model(input_ids=w.unsqueeze(0)).logits[0].float(), dim=-1)

    def _logp(self, w: torch.Tensor) -> torch.Tensor:
        return self._logp_of(self.model, w)

    @torch.no_grad()
    def kl_to(self, model) -> float:
        """Mean per-token KL(float || `model`) on the same windows: another model, e.g. a converted artifact."""
        total = 0.0
        for w, ref in zip(self.windows, self.ref):
            lq = self._logp_of(model, w)
            total += float((ref.exp() * (ref - lq)).sum(-1).double().sum())
        return total / self.tokens

    @torch.no_grad()
    def kl(self, weights: dict[str, torch.Tensor], activations: dict | None = None) -> float:
        """Mean per-token KL with `weights` (module name -> weight) in place and, for the modules in
        `activations` (name -> ActivationSpec), their inputs quantized as the engine does; restored after."""
        from quantkit.algorithms.rtn import activation_pre_hook

        mods = {n: self.model.get_submodule(n) for n in weights}
        kept = {n: m.weight.data for n, m in mods.items()}
        hooks = [self.model.get_submodule(n).register_forward_pre_hook(activation_pre_hook(spec))
                 for n, spec in (activations or {}).items()]
        try:
            for n, m in mods.items():
                m.weight.data = weights[n].to(torch.float32)
            return self.kl_to(self.model)
        finally:
            for h in hooks:
                h.remove()
            for n, m in mods.items():
                m.weight.data = kept[n]


def load_unit_weights(weights_dir: Path, units: list[Unit], which: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for layer in sorted({u.layer for u in units}):
        with safe_open(str(weights_dir / f"layer_{layer:05d}.safetensors"), "pt") as f:
            for u in units:
                if u.layer == layer:
                    for name in u.modules:
                        out[name] = f.get_tensor(f"{which}.{name}")
    return out


def spread(units: list[Unit], n: int) -> list[Unit]:
    """`n` units spread evenly over the ranking by error (the most and the least sensitive included)."""
    ranked = sorted(units, key=lambda u: -u.error_low)
    if n >= len(ranked):
        return ranked
    if n <= 1:
        return ranked[:n]
    idx = sorted({round(i * (len(ranked) - 1) / (n - 1)) for i in range(n)})
    return [ranked[i] for i in idx]


def spearman(a: list[float], b: list[float]) -> float | None:
    """Rank correlation (average ranks for ties)."""
    if len(a) < 3:
        return None

    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else None


def kl_factor(measured_low_kl: float, units: list[Unit]) -> float | None:
    """KL per unit of proxy error: the measured KL of the uniform low-bit model over the summed errors of its
    units (exact at that end; docs/sensitivity.md)."""
    total = sum(u.error_low for u in units)
    return measured_low_kl / total if total > 0 else None


def end_weights(weights_dir: Path, units: list[Unit], high: Scheme | None, kept: set[str]):
    """(weights, activation specs) of the model with the `kept` units at the high scheme, the rest low."""
    w = load_unit_weights(weights_dir, [u for u in units if u.name not in kept], "low")
    acts = {}
    if high is not None:
        hi_units = [u for u in units if u.name in kept]
        w.update(load_unit_weights(weights_dir, hi_units, "high"))
        if high.activations is not None:
            acts = {m: high.activations for u in hi_units for m in u.modules}
    return w, acts


def validate_proxy(fm: FullModelKL, high: Scheme | None, units: list[Unit], facts: dict, weights_dir: Path, n: int,
                   say) -> dict:
    """Full-model KL of `n` units spread over the ranking (each alone at the low scheme) and of both ends;
    the proxy whose ranking agrees better with the per-unit KLs."""
    say(f"validation: full-model KL on {', '.join(f.name for f in fm.files)} for {min(n, len(units))} units")
    sample = spread(units, n)
    kl_low = {}
    for i, u in enumerate(sample):
        kl_low[u.name] = fm.kl(load_unit_weights(weights_dir, [u], "low"))
        say(f"  {i + 1}/{len(sample)} {u.name}: error {u.error_low:.3g}, KL {kl_low[u.name]:.4g}")
    rho = {}
    for p in PROXIES:  # the proxy whose ranking agrees best with the full-model KL is the one used
        use_proxy(units, p, facts["final_energy"])
        rho[p] = spearman([u.error_low for u in sample], [kl_low[u.name] for u in sample])
    proxy = max(PROXIES, key=lambda p: (rho[p] if rho[p] is not None else -2, p == "layer"))
    measured = {"low": fm.kl(*end_weights(weights_dir, units, high, set()))}
    if high is not None:
        measured["high"] = fm.kl(*end_weights(weights_dir, units, high, {u.name for u in units}))
    return {"units": [u.name for u in sample], "tokens": fm.tokens, "files": [str(f) for f in fm.files],
            "kl_low": kl_low, "proxy": proxy, "spearman_by_proxy": rho, "spearman": rho[proxy], "measured": measured}
