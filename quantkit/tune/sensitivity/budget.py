"""The budgets (a predicted KL, a checkpoint size, an engine TPOT) and the choice of units to keep at the high
scheme, best error removed per byte added first."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.schemes import Scheme
from quantkit.tune.sensitivity.units import Unit


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
    """Keep units at the high scheme, best error removed per byte added first, until the budgets are met: a
    cap (size, a TPOT that grows) skips units that would break it, a target (KL, a TPOT that falls) stops the
    adding (docs/sensitivity.md). Returns the kept unit names, the predicted figures and whether every budget
    is met."""
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
