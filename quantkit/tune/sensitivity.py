"""Sensitivity-driven mixed precision: which modules to keep at a higher-precision scheme, and the recipe.

`measure` runs the layer-wise pipeline's calibration forward once (one decoder layer in memory at a time,
float activations carried from layer to layer) and, in each layer, quantizes one *unit* at a time with the
recipe's own method and scheme while the rest of the layer stays float. A unit is a sequential group of the
plan (q/k/v, o, gate/up, down for Llama-like models): exactly the modules vLLM fuses into one kernel, which
must share a scheme, so a mixed recipe never splits one. The pass records the squared error the unit adds
to its decoder layer's output over every calibration token, |y_q - y|^2, at the low scheme and (when the
high one is quantized too, W8A8) at the high one. Two normalisations of it are candidate proxies (PROXIES):
relative to the unit's own layer output ("layer": how much of that layer's work it damages), and relative to
the last layer's output ("stream": the error enters the residual stream and stays there). Which one ranks
units like the full-model KL depends on how the model carries early errors forward, so validation measures
both and the better one is used; without validation, "layer".

Validation checks the proxy against what it stands for: the full-model KL divergence from the float model
on held-out text, with only that unit quantized (transformers, fp32), for units spread over the ranking. It
reports the rank correlations and fits one factor, KL ~ factor x error, that turns a set of errors into a
predicted KL (errors of different units assumed to add; the measured KL of the chosen mix checks that).

`choose` keeps units at the high scheme in order of (error saved per byte added) until the budget is met:
- quality: the predicted KL is at most the budget;
- size: the checkpoint is at most the budget (bytes, or a multiple of the uniform low-bit checkpoint);
- latency: the engine's TPOT, measured by `quantkit eval` on the uniform low-bit and uniform high-precision
  artifacts and interpolated by weight bytes (decode streams the weights), is at most the budget.
`mixed_recipe` writes the recipe: a first stage at the high scheme whose targets are the kept modules as
anchored regexes, then the recipe's own stage for the rest (with the high scheme `none`, the kept modules
join the low stage's `ignore` and stay in the model's dtype).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from quantkit.errors import human_bytes
from quantkit.io import atomic_write_json, atomic_write_text
from quantkit.plan import Plan, Target, exact_targets
from quantkit.recipe import Recipe, RecipeError, parse_recipe
from quantkit.schemes import Scheme, WeightSpec, get_scheme

log = logging.getLogger("quantkit")
HIGH_NONE = "none"  # keep the unit in the model's dtype


# ------------------------------------------------------------------------------------------- units
@dataclass
class Unit:
    """Modules that share a scheme in the engine (one fused kernel), measured together."""

    name: str  # "3.self_attn.q_proj+k_proj+v_proj"
    layer: int
    modules: list[str]  # full module names
    params: int
    bytes_low: int
    bytes_high: int
    # |y_q - y|^2 this unit alone adds to its layer's output over every calibration token, at the low and the
    # high scheme (0: it stays float), and the layer output's energy |y|^2
    sq_low: float = float("nan")
    sq_high: float = 0.0
    layer_energy: float = float("nan")
    # the proxy (PROXIES): sq_* normalised by the layer's own energy or by the last layer's
    error_low: float = float("nan")
    error_high: float = 0.0
    kl_low: float | None = None  # full-model KL with only this unit at the low scheme (validated units)

    @property
    def bytes_added(self) -> int:
        return self.bytes_high - self.bytes_low

    @property
    def saving(self) -> float:
        """Error removed per byte added by keeping this unit at the high scheme."""
        return (self.error_low - self.error_high) / max(self.bytes_added, 1)


def weight_bytes(spec: WeightSpec | None, out_features: int, in_features: int, float_bytes: int) -> int:
    """Bytes one Linear weight takes in the export: packed codes, scales in the model dtype, packed zero
    points for asymmetric schemes; `spec` None: the float weight as it is."""
    n = out_features * in_features
    if spec is None:
        return n * float_bytes
    groups = in_features // spec.group_size if spec.strategy == "group" else 1
    b = n * spec.num_bits / 8 + out_features * groups * float_bytes
    if not spec.symmetric:
        b += out_features * groups * spec.num_bits / 8
    return int(math.ceil(b))


def _unit_name(members: list[Target], prefix: str, layer: int) -> str:
    locals_ = [t.name[len(prefix):] for t in members]
    head, _, _ = locals_[0].rpartition(".")
    tails = [loc.rpartition(".")[2] if loc.rpartition(".")[0] == head else loc for loc in locals_]
    return f"{layer}.{head + '.' if head else ''}{'+'.join(tails)}"


def plan_units(plan: Plan, shapes: dict[str, tuple[int, int]], high: Scheme | None, float_bytes: int) -> list[Unit]:
    """One unit per sequential group of every layer, with its sizes at the low and the high scheme."""
    units = []
    for lp in plan.layers:
        for members in lp.groups:
            low = sum(weight_bytes(t.scheme.weights, *shapes[t.name], float_bytes) for t in members)
            hi = sum(weight_bytes(high.weights if high else None, *shapes[t.name], float_bytes) for t in members)
            units.append(Unit(_unit_name(members, lp.prefix, lp.index), lp.index, [t.name for t in members],
                              sum(a * b for a, b in (shapes[t.name] for t in members)), low, hi))
    return units


def check_recipe(recipe: Recipe, high: str) -> Scheme | None:
    """The recipe sensitivity can work from (one quantizer stage, no transform or QAT) and the high scheme."""
    bad = [f"stages[{i}] ({st.method})" for i, st in enumerate(recipe.stages) if st.is_transform or st.method == "qat"]
    quant = [i for i, st in enumerate(recipe.stages) if not st.is_transform and st.method != "qat"]
    if bad or len(quant) != 1:
        raise RecipeError(f"recipe {recipe.name!r}: sensitivity starts from a recipe with exactly one quantizer stage "
                          f"(rtn or gptq) and no transform or qat stage; found {', '.join(bad) or f'{len(quant)} quantizer stages'}. "
                          "Use the uniform low-bit recipe (for example recipes/smollm2-w4a16-gptq.yaml)")
    if recipe.calibration is None:
        raise RecipeError(f"recipe {recipe.name!r}: sensitivity measures each module's effect on its layer's output "
                          "over calibration data; add a `calibration:` section")
    if high == HIGH_NONE:
        return None
    scheme = get_scheme(high)
    low = get_scheme(recipe.stages[quant[0]].scheme)
    if scheme.weights.num_bits <= low.weights.num_bits and scheme.weights.type == low.weights.type:
        raise RecipeError(f"--high {high}: the kept modules' scheme must have more weight bits than the recipe's "
                          f"{low.name} ({low.weights.num_bits}); use W8A8, or none to keep them in the model's dtype")
    return scheme


def _high_stage(recipe: Recipe, high: Scheme):
    """The recipe's quantizer stage with the high scheme (per-channel: no group size, no group act-order)."""
    st = recipe.stages[0]
    upd = {"scheme": high.name, "group_size": None}
    if getattr(st, "actorder", None) == "group":
        upd["actorder"] = "static"
    return st.model_copy(update=upd)


# ------------------------------------------------------------------------------------------ measure
def _forward(layer: nn.Module, pieces) -> torch.Tensor:
    from quantkit.model.checkpoint import to_layer_device

    outs = []
    for h, kw in pieces:
        o = layer(to_layer_device(h, layer), **kw)
        outs.append(o[0] if isinstance(o, tuple) else o)
    return torch.cat(outs)


def _sq_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).pow(2).sum())


@torch.no_grad()
def measure(recipe: Recipe, high: Scheme | None, weights_dir: Path | None = None, device: str = "auto",
            progress: Callable[[str], None] | None = None) -> tuple[list[Unit], dict]:
    """Every unit's layer-output error at the low (and high) scheme, in one layer-by-layer pass.

    With `weights_dir`, each layer's quantized weights (low and high) are saved there as
    layer_NNNNN.safetensors, for `validate` to put into the full model later.
    """
    from safetensors.torch import save_file

    from quantkit.data import build_calibration_set
    from quantkit.distributed import ChunkLayout
    from quantkit.export.shards import stored_bytes
    from quantkit.hardware import compute_dtype, conversion_device
    from quantkit.model.arch import arch_for
    from quantkit.model.checkpoint import LazyCheckpoint, build_skeleton, materialize, release
    from quantkit.model.sources import load_tokenizer, resolve_model_dir
    from quantkit.plan import make_plan
    from quantkit.quantize.layers import GroupInputs, _to_device, capture_layer_inputs
    from quantkit.quantize.methods import QUANTIZERS
    from quantkit.algorithms.rtn import activation_pre_hook

    t0 = time.perf_counter()
    say = progress or (lambda m: None)
    dev, _ = conversion_device(device)
    compute = getattr(torch, compute_dtype(recipe.model.compute_dtype, dev)[0])
    model_dir = resolve_model_dir(recipe.model, quiet=True)
    tok = load_tokenizer(model_dir, recipe.model.trust_remote_code)
    calib = build_calibration_set(recipe.calibration, tok)
    model = build_skeleton(model_dir, recipe.model.dtype, recipe.model.trust_remote_code)
    arch = arch_for(model.config)
    plan = make_plan(model, arch, recipe)
    ckpt = LazyCheckpoint(model_dir)
    shapes = {t: tuple(ckpt.layout(t + ".weight")[1]) for t in plan.targets}
    float_bytes = torch.empty((), dtype=getattr(torch, recipe.model.dtype)).element_size()
    units = plan_units(plan, shapes, high, float_bytes)
    by_layer: dict[int, list[Unit]] = {}
    for u in units:
        by_layer.setdefault(u.layer, []).append(u)
    scale_dtype = getattr(torch, recipe.model.dtype)
    low_stage = recipe.stages[next(t.stage for t in plan.targets.values())]
    method = QUANTIZERS[low_stage.method]
    hi_stage = _high_stage(recipe, high) if high is not None else None

    bs = recipe.calibration.batch_size
    hidden, by_size = capture_layer_inputs(model, arch, ckpt, calib.input_ids, compute, bs)
    hidden = hidden.to(dev)
    layout = ChunkLayout.of(hidden.shape[0], bs, hidden.shape[1])
    layers = model.get_submodule(arch.layers)
    if weights_dir is not None:
        weights_dir.mkdir(parents=True, exist_ok=True)
    say(f"sensitivity: {len(units)} units in {len(plan.layers)} layers, {calib.input_ids.numel()} calibration tokens")
    for lp in plan.layers:
        tl = time.perf_counter()
        layer = layers[lp.index]
        materialize(layer, lp.prefix, ckpt, compute, dev)
        kws = {size: _to_device(kw[lp.index], dev, compute) for size, kw in by_size.items()}
        pieces = [(h, kws[h.shape[0]]) for h in hidden.split(bs)]
        needs = method.needs == "hessian"
        inputs = [GroupInputs(needs, layout) for _ in lp.groups]
        handles = [layer.get_submodule(name[len(lp.prefix):]).register_forward_pre_hook(
            lambda _m, args, g=g: inputs[g].add(args[0])) for g, name in enumerate(lp.group_inputs)]
        try:
            ref = _forward(layer, pieces)
        finally:
            for h in handles:
                h.remove()
        saved: dict[str, torch.Tensor] = {}
        for g, (members, unit) in enumerate(zip(lp.groups, by_layer[lp.index])):
            obs = inputs[g].observations()
            inputs[g] = None
            mods = [layer.get_submodule(t.name[len(lp.prefix):]) for t in members]
            originals = [m.weight.data.clone() for m in mods]
            for which, scheme, stage in (("low", members[0].scheme, low_stage), ("high", high, hi_stage)):
                if scheme is None:
                    continue
                got = method.quantize([w.float() for w in originals], obs, scheme.weights, stage, scale_dtype)
                hooks = []
                for m, q in zip(mods, got):
                    m.weight.data = q.weight.to(m.weight.dtype)
                    if scheme.activations is not None:
                        hooks.append(m.register_forward_pre_hook(activation_pre_hook(scheme.activations)))
                try:
                    sq = _sq_error(_forward(layer, pieces), ref)
                finally:
                    for h in hooks:
                        h.remove()
                    for m, w in zip(mods, originals):
                        m.weight.data = w
                setattr(unit, f"sq_{which}", sq)
                if weights_dir is not None:
                    for t, q in zip(members, got):
                        saved[f"{which}.{t.name}"] = q.weight.float().contiguous().cpu()  # exact
        if weights_dir is not None:
            save_file(saved, str(weights_dir / f"layer_{lp.index:05d}.safetensors"))
        energy = float(ref.double().pow(2).sum())
        for u in by_layer[lp.index]:
            u.layer_energy = energy
        hidden = ref  # the float model's activations go on to the next layer
        release(layer)
        worst = max(by_layer[lp.index], key=lambda u: u.sq_low)
        say(f"layer {lp.index + 1}/{len(plan.layers)} in {time.perf_counter() - tl:.1f}s: most sensitive "
            f"{worst.name} (error {worst.sq_low / energy:.3g} of this layer's output)")
    use_proxy(units, "layer", energy)
    facts = {"model_dir": str(model_dir), "calibration_tokens": int(calib.input_ids.numel()),
             "calibration_fingerprint": calib.fingerprint, "compute_dtype": str(compute).replace("torch.", ""),
             "device": str(dev), "float_bytes": float_bytes, "seconds": round(time.perf_counter() - t0, 1),
             "other_bytes": stored_bytes(ckpt, {n + ".weight" for n in shapes}), "final_energy": energy}
    return units, facts


PROXIES = {
    "layer": "the error relative to the unit's own layer output (how much of that layer's work it damages)",
    "stream": "the error relative to the last layer's output (the residual stream the error ends up in)",
}


def use_proxy(units: list[Unit], proxy: str, final_energy: float) -> None:
    """Set every unit's error_low / error_high from its squared errors under `proxy` (PROXIES)."""
    for u in units:
        norm = u.layer_energy if proxy == "layer" else final_energy
        u.error_low, u.error_high = u.sq_low / norm, u.sq_high / norm


# ----------------------------------------------------------------------------------------- validate
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
    units. Calibrated at that end, so predictions are exact there; the measured KL of the chosen mix shows
    how well the errors add in between."""
    total = sum(u.error_low for u in units)
    return measured_low_kl / total if total > 0 else None


# ------------------------------------------------------------------------------------------- choose
@dataclass(frozen=True)
class Budget:
    kind: str  # "kl" | "size" | "tpot"
    value: float  # KL; bytes; milliseconds
    text: str  # as the user wrote it

    @staticmethod
    def parse(text: str, uniform_low_bytes: int | None = None) -> "Budget":
        """`kl=0.05`, `size=80MB` / `size=1.05x` (of the uniform low-bit checkpoint), `tpot=9ms`."""
        kind, _, val = text.partition("=")
        kind, val = kind.strip().lower(), val.strip()
        try:
            if kind == "kl":
                return Budget("kl", float(val), text)
            if kind == "size":
                m = re.fullmatch(r"([0-9.]+)\s*(x|b|kb|mb|gb|kib|mib|gib)?", val.lower())
                if m is None:
                    raise ValueError(val)
                num, unit = float(m.group(1)), m.group(2) or "b"
                if unit == "x":
                    if uniform_low_bytes is None:
                        raise ValueError("a multiple needs the uniform size")
                    return Budget("size", num * uniform_low_bytes, text)
                mult = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3}[unit]
                return Budget("size", num * mult, text)
            if kind == "tpot":
                return Budget("tpot", float(val.lower().removesuffix("ms")), text)
        except ValueError:
            pass
        raise ValueError(f"--budget {text!r}: expected kl=<predicted KL, e.g. 0.05>, size=<bytes: 80MB, 76MiB, or a "
                         "multiple of the uniform low-bit checkpoint: 1.05x> or tpot=<ms, e.g. 9ms>")


@dataclass
class LatencyModel:
    """Engine-measured TPOT at both ends (every unit low, every unit high), linear in weight bytes between."""

    low_ms: float
    high_ms: float
    low_bytes: int
    high_bytes: int
    source: list[str] = field(default_factory=list)

    def predict(self, nbytes: int) -> float:
        if self.high_bytes == self.low_bytes:
            return self.low_ms
        return self.low_ms + (self.high_ms - self.low_ms) * (nbytes - self.low_bytes) / (self.high_bytes - self.low_bytes)


def latency_model(reports: list[Path], high: Scheme | None, metric: str, units: list[Unit]) -> LatencyModel:
    """From `quantkit eval` reports: the first report's candidate is the uniform low-bit artifact; the high end
    is that report's baseline when the high scheme is `none` (the float model), else the second report's
    candidate (the uniform high-precision artifact)."""
    def value(path: Path, role: str) -> float:
        data = json.loads(Path(path).read_text())
        v = ((data.get("metrics") or {}).get(metric) or {}).get(role)
        if not isinstance(v, (int, float)):
            raise ValueError(f"{path}: no {role} value for {metric} (the report's speed levels are "
                             f"{sorted({k.split('.')[1] for k in data.get('metrics', {}) if k.startswith('speed.')})}); "
                             "choose --latency-metric from them")
        return float(v)

    if high is None:
        if len(reports) != 1:
            raise ValueError("--latency-from: with --high none give one eval report, of the uniform low-bit artifact "
                             "(its baseline is the float model)")
        hi = value(reports[0], "baseline")
    else:
        if len(reports) != 2:
            raise ValueError(f"--latency-from: with --high {high.name} give two eval reports: the uniform low-bit "
                             f"artifact's, then the uniform {high.name} artifact's")
        hi = value(reports[1], "candidate")
    return LatencyModel(value(reports[0], "candidate"), hi, sum(u.bytes_low for u in units),
                        sum(u.bytes_high for u in units), [str(p) for p in reports])


def predicted(linear_bytes: int, error: float, other_bytes: int, factor: float | None,
              latency: LatencyModel | None) -> dict:
    """What a model whose quantized Linears take `linear_bytes` and add up to `error` is predicted to be."""
    return {"error": error, "linear_bytes": linear_bytes, "checkpoint_bytes": linear_bytes + other_bytes,
            "predicted_kl": factor * error if factor is not None else None,
            "predicted_tpot_ms": latency.predict(linear_bytes) if latency is not None else None}


def choose(units: list[Unit], budgets: Budget | list[Budget], other_bytes: int, factor: float | None = None,
           latency: LatencyModel | None = None) -> dict:
    """Keep units at the high scheme, best error removed per byte added first, until the budgets are met.

    A budget either caps what may be added (size; TPOT where the high scheme is the slower one) or is a
    target that adding reaches (KL; TPOT where the high scheme is the faster one, as W8A8 is against
    W4A16 on the 2-core AVX-512 CPU we measured). Units are added, skipping any that would break a cap, until every target is
    met; with caps only, every unit that fits is added (the best quality within them). Returns the kept
    unit names, the predicted figures and whether every budget is met."""
    budgets = [budgets] if isinstance(budgets, Budget) else list(budgets)
    if any(b.kind == "kl" for b in budgets) and factor is None:
        raise ValueError("a kl budget needs the KL factor from validation (--validate N with N >= 1)")
    if any(b.kind == "tpot" for b in budgets) and latency is None:
        raise ValueError("a tpot budget needs the engine's measured TPOT: --latency-from REPORT [REPORT]")
    order = sorted((u for u in units if u.error_low > u.error_high), key=lambda u: (-u.saving, u.name))
    kept: list[Unit] = []
    lin = sum(u.bytes_low for u in units)
    err = sum(u.error_low for u in units)

    def figures(lin: int, err: float) -> dict:
        return predicted(lin, err, other_bytes, factor, latency)

    def within(b: Budget, f: dict) -> bool:
        return f[{"kl": "predicted_kl", "size": "checkpoint_bytes", "tpot": "predicted_tpot_ms"}[b.kind]] <= b.value

    high_faster = latency is not None and latency.high_ms <= latency.low_ms
    caps = [b for b in budgets if b.kind == "size" or (b.kind == "tpot" and not high_faster)]
    targets = [b for b in budgets if b not in caps]
    for u in order:
        if targets and all(within(b, figures(lin, err)) for b in targets):
            break
        trial = figures(lin + u.bytes_added, err + u.error_high - u.error_low)
        if not all(within(b, trial) for b in caps):
            continue  # a smaller unit further down may still fit
        kept.append(u)
        lin, err = trial["linear_bytes"], trial["error"]
    final = figures(lin, err)
    return {"budget": " ".join(b.text for b in budgets), "met": all(within(b, final) for b in budgets),
            "kept": [u.name for u in kept], **final}


# -------------------------------------------------------------------------------------------- recipe
def mixed_recipe(recipe: Recipe, high: Scheme | None, units: list[Unit], kept: list[str], name: str,
                 header: str = "") -> tuple[str, Recipe]:
    """The mixed-precision recipe as YAML text (and parsed, to prove it is valid): the kept units at the high
    scheme as anchored targets, the recipe's stage for everything else."""
    import yaml

    keep = {u.name for u in units if u.name in set(kept)}
    modules = sorted(m for u in units if u.name in keep for m in u.modules)
    data = recipe.model_dump(mode="json", exclude_defaults=True)
    # every stage field explicit (unset overrides left out)
    data["stages"] = [{k: v for k, v in st.model_dump(mode="json").items() if v is not None} for st in recipe.stages]
    data["name"] = name
    st = next(st for st in recipe.stages if not st.is_transform)
    low_desc = st.scheme + (f" group {st.group_size}" if st.group_size else "")
    data["description"] = (f"mixed precision by measured sensitivity, from {recipe.name}: {len(keep)} of {len(units)} "
                           f"fused module groups at {high.name if high else 'the model dtype'}, the rest {low_desc} "
                           f"({st.method})")
    data.setdefault("export", {}).pop("output_dir", None)
    if data.get("publish", {}).get("name"):
        data["publish"]["name"] = f"{data['publish']['name']}-mixed"
    qi = next(i for i, st in enumerate(recipe.stages) if not st.is_transform)
    low = data["stages"][qi]
    if modules:
        if high is None:
            low["ignore"] = list(low["ignore"]) + exact_targets(modules)
        else:
            hi = json.loads(json.dumps(low))  # its own lists: no YAML anchors
            hi.update(scheme=high.name, targets=exact_targets(modules))
            hi.pop("group_size", None)
            if hi.get("actorder") == "group":
                hi["actorder"] = "static"
            data["stages"].insert(qi, hi)
    parsed = parse_recipe(json.loads(json.dumps(data)), f"mixed recipe {name}")
    text = yaml.safe_dump(data, sort_keys=False, width=120)
    return (header + text), parsed


# -------------------------------------------------------------------------------------------- report
def write_report(out: Path, result: dict, plot: bool = True) -> list[Path]:
    """sensitivity.json, sensitivity.md and the plots."""
    atomic_write_json(out / "sensitivity.json", result)
    plots = _plots(out, result) if plot else []
    atomic_write_text(out / "sensitivity.md", render_markdown(result, plots))
    return [out / "sensitivity.json", out / "sensitivity.md", *plots]


def render_markdown(r: dict, plots: list[Path]) -> str:
    v, c = r.get("validation") or {}, r["choice"]
    lines = [f"# Sensitivity: {r['recipe']}", "",
             f"Low scheme {r['low_scheme']} ({r['method']}), high {r['high_scheme']}; {len(r['units'])} units "
             f"(modules the engine fuses), {r['facts']['calibration_tokens']} calibration tokens, "
             f"{r['facts']['seconds']} s ({r['facts']['device']}, {r['facts']['compute_dtype']}).", "",
             "## Choice", "",
             f"Budget `{c['budget']}`: {'met' if c['met'] else '**not met**'}; {len(c['kept'])} units kept high.", "",
             "| | uniform low | mixed | uniform high |", "|---|---:|---:|---:|"]
    ends = r["ends"]
    lines.append(f"| checkpoint | {human_bytes(ends['low']['checkpoint_bytes'])} | {human_bytes(c['checkpoint_bytes'])} | "
                 f"{human_bytes(ends['high']['checkpoint_bytes'])} |")
    lines.append(f"| summed layer error | {ends['low']['error']:.4g} | {c['error']:.4g} | {ends['high']['error']:.4g} |")
    if c.get("predicted_kl") is not None:
        lines.append(f"| predicted KL | {ends['low']['predicted_kl']:.4f} | {c['predicted_kl']:.4f} | "
                     f"{ends['high']['predicted_kl']:.4f} |")
    if v.get("measured"):
        m = v["measured"]
        lines.append(f"| measured KL (transformers fp32) | {_f(m.get('low'))} | {_f(m.get('mixed'))} | {_f(m.get('high'))} |")
    if c.get("predicted_tpot_ms") is not None:
        lines.append(f"| TPOT (engine ends, interpolated) | {ends['low']['predicted_tpot_ms']:.2f} ms | "
                     f"{c['predicted_tpot_ms']:.2f} ms | {ends['high']['predicted_tpot_ms']:.2f} ms |")
    lines += ["", f"Recipe: `{r['recipe_path']}`", ""]
    if v:
        lines += ["## Validation against the full-model KL", "",
                  f"{len(v['units'])} units spread over the ranking, each quantized alone in the full model "
                  f"({v['tokens']} held-out tokens). Rank correlation (Spearman) with the proxy: "
                  + ", ".join(f"{p} {_f(x, '.3f')}" for p, x in (v.get("spearman_by_proxy") or {}).items())
                  + f"; used: **{v.get('proxy')}** ({PROXIES.get(v.get('proxy'), '')}). "
                  f"KL factor {_f(v.get('kl_factor'), '.4g')} per unit of proxy error.", ""]
    lines += ["## Ranking (most sensitive first)", "", "| unit | error low | error high | KL alone | bytes added | kept |",
              "|---|---:|---:|---:|---:|:-:|"]
    kept = set(c["kept"])
    for u in sorted(r["units"], key=lambda u: -u["error_low"])[:40]:
        lines.append(f"| {u['name']} | {u['error_low']:.3g} | {u['error_high']:.3g} | {_f(u.get('kl_low'), '.4g')} | "
                     f"{human_bytes(u['bytes_high'] - u['bytes_low'])} | {'yes' if u['name'] in kept else ''} |")
    if len(r["units"]) > 40:
        lines.append(f"| ... {len(r['units']) - 40} more in sensitivity.json | | | | | |")
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _f(x, fmt: str = ".4f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _plots(out: Path, r: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover (matplotlib is a dependency)
        return []
    paths = []
    units = r["units"]
    kinds = sorted({u["name"].split(".", 1)[1] for u in units})
    fig, ax = plt.subplots(figsize=(9, 4))
    for k in kinds:
        pts = [(u["layer"], u["error_low"]) for u in units if u["name"].split(".", 1)[1] == k]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=k)
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("layer-output error, unit alone at low scheme")
    ax.set_title(f"{r['recipe']}: sensitivity by layer")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "sensitivity_by_layer.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    v = r.get("validation") or {}
    pts = [(u["error_low"], u["kl_low"]) for u in units if u.get("kl_low") is not None and u["kl_low"] > 0]
    if len(pts) >= 2:
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("layer-output error (proxy)")
        ax.set_ylabel("full-model KL, unit alone")
        ax.set_title(f"proxy vs KL: Spearman {_f(v.get('spearman'), '.2f')}")
        fig.tight_layout()
        p = out / "proxy_vs_kl.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


# ----------------------------------------------------------------------------------------------- run
def run(recipe: Recipe, budget: str | list[str], output: Path, high: str = "W8A8", validate: int = 16,
        latency_from: list[Path] | None = None, latency_metric: str = "speed.c1.tpot_ms_p50",
        kl_tokens: int = 1024, device: str = "auto", progress: Callable[[str], None] | None = None) -> dict:
    """Measure, validate, choose and write: output/{sensitivity.json, sensitivity.md, plots, <name>.yaml}.

    The measurement (measured.json, with the units' quantized weights in weights/) and the validation
    (validation.json) are kept for their inputs: a second call with another budget reuses both."""
    say = progress or (lambda m: None)
    hi = check_recipe(recipe, high)
    output.mkdir(parents=True, exist_ok=True)
    weights_dir = output / "weights"
    mkey = {"recipe": recipe.hash(), "high": high, "version": MEASURE_VERSION, "weights": bool(validate)}
    cached = _cached(output / "measured.json", mkey)
    if cached is not None:
        units, facts = [Unit(**u) for u in cached["units"]], cached["facts"]
        say(f"sensitivity: reusing the measurement in {output / 'measured.json'}")
    else:
        units, facts = measure(recipe, hi, weights_dir if validate else None, device, say)
        atomic_write_json(output / "measured.json", {"key": mkey, "units": [asdict(u) for u in units], "facts": facts})
    use_proxy(units, "layer", facts["final_energy"])
    validation = None
    fm: FullModelKL | None = None

    def full_model() -> FullModelKL:  # loaded once, and only when a KL is to be measured
        nonlocal fm
        if fm is None:
            from quantkit.evaluate.suite import resolve_file

            fm = FullModelKL(Path(facts["model_dir"]), [resolve_file(f) for f in recipe.eval.perplexity_files],
                             kl_tokens, trust_remote_code=recipe.model.trust_remote_code)
        return fm

    if validate:
        vkey = {**mkey, "validate": validate, "kl_tokens": kl_tokens, "files": list(recipe.eval.perplexity_files)}
        validation = _cached(output / "validation.json", vkey)
        if validation is not None:
            validation.pop("key")
            say(f"sensitivity: reusing the validation in {output / 'validation.json'}")
        else:
            validation = _validate(full_model(), hi, units, facts, weights_dir, validate, say)
            atomic_write_json(output / "validation.json", {"key": vkey, **validation})
        for u in units:
            u.kl_low = validation["kl_low"].get(u.name)
        use_proxy(units, validation["proxy"], facts["final_energy"])
        validation["kl_factor"] = kl_factor(validation["measured"]["low"], units)
    factor = (validation or {}).get("kl_factor")
    other = facts["other_bytes"]
    uniform_low = sum(u.bytes_low for u in units) + other
    budgets = [Budget.parse(t, uniform_low) for t in ([budget] if isinstance(budget, str) else budget)]
    lat = latency_model(latency_from, hi, latency_metric, units) if latency_from else None
    choice = choose(units, budgets, other, factor, lat)
    ends = {"low": predicted(sum(u.bytes_low for u in units), sum(u.error_low for u in units), other, factor, lat),
            "high": predicted(sum(u.bytes_high for u in units), sum(u.error_high for u in units), other, factor, lat)}
    if validation and choice["kept"]:
        validation["measured"]["mixed"] = full_model().kl(*_end_weights(weights_dir, units, hi, set(choice["kept"])))
    tag = "-".join(re.sub(r"[^A-Za-z0-9._-]+", "", b.text.replace("=", "-")) for b in budgets)
    name = f"{recipe.name}-mixed-{tag}"
    header = (f"# Written by `quantkit sensitivity` from {recipe.name} (budget {choice['budget']}, high scheme {high}):\n"
              f"# {len(choice['kept'])} of {len(units)} units kept high; checkpoint ~{human_bytes(choice['checkpoint_bytes'])}"
              + (f", predicted KL {choice['predicted_kl']:.4f}" if choice.get("predicted_kl") is not None else "")
              + (f", TPOT ~{choice['predicted_tpot_ms']:.2f} ms (engine ends, interpolated)"
                 if choice.get("predicted_tpot_ms") is not None else "") + ". See sensitivity.md beside it.\n")
    text, _ = mixed_recipe(recipe, hi, units, choice["kept"], name, header)
    recipe_path = output / f"{name}.yaml"
    atomic_write_text(recipe_path, text)
    result = {"recipe": recipe.name, "recipe_path": str(recipe_path), "method": recipe.stages[0].method,
              "low_scheme": recipe.stages[0].scheme, "high_scheme": high, "facts": facts, "validation": validation,
              "latency": asdict(lat) if lat is not None else None, "choice": choice, "ends": ends,
              "units": [asdict(u) for u in units]}
    write_report(output, result)
    return result


MEASURE_VERSION = 1  # bump when the measurement's definition changes: cached measurements are then redone


def _cached(path: Path, key: dict) -> dict | None:
    data = json.loads(path.read_text()) if path.is_file() else None
    return data if data and data.get("key") == key else None


def _end_weights(weights_dir: Path, units: list[Unit], high: Scheme | None, kept: set[str]):
    """(weights, activation specs) of the model with the `kept` units at the high scheme, the rest low."""
    w = load_unit_weights(weights_dir, [u for u in units if u.name not in kept], "low")
    acts = {}
    if high is not None:
        hi_units = [u for u in units if u.name in kept]
        w.update(load_unit_weights(weights_dir, hi_units, "high"))
        if high.activations is not None:
            acts = {m: high.activations for u in hi_units for m in u.modules}
    return w, acts


def _validate(fm: FullModelKL, high: Scheme | None, units: list[Unit], facts: dict, weights_dir: Path, n: int,
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
    measured = {"low": fm.kl(*_end_weights(weights_dir, units, high, set()))}
    if high is not None:
        measured["high"] = fm.kl(*_end_weights(weights_dir, units, high, {u.name for u in units}))
    return {"units": [u.name for u in sample], "tokens": fm.tokens, "files": [str(f) for f in fm.files],
            "kl_low": kl_low, "proxy": proxy, "spearman_by_proxy": rho, "spearman": rho[proxy], "measured": measured}


__all__ = ["Unit", "Budget", "LatencyModel", "FullModelKL", "weight_bytes", "plan_units", "check_recipe", "measure",
           "spread", "spearman", "kl_factor", "choose", "latency_model", "mixed_recipe", "write_report",
           "load_unit_weights", "run", "HIGH_NONE"]
