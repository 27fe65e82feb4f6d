"""Quality gates: thresholds on report.json metrics that decide whether an artifact may be published.

A gate is `metric op threshold`, checked either on the candidate's value (absolute: top-1 agreement
>= 0.9) or on candidate / baseline (relative: perplexity ratio <= 1.05, accuracy recovery >= 0.97,
weight-memory ratio <= 0.45, TPOT p90 ratio <= 0.9). The rules:

- A gate whose metric is missing from the report, or whose candidate (or, for a relative gate, baseline)
  value is null, zero-baseline or not finite, FAILS and says why. Nothing is skipped silently.
- Where the gates come from, in order: the `gates` argument; the recipe stored in the artifact's
  manifest (`recipe.gates`); else the defaults for the artifact's scheme (DEFAULT_GATES below).
- With `confidence: 0.95` a gate passes only if its whole 95% interval passes too (from the metric's
  "ci95" in report.json: the candidate's interval, or the paired ratio interval for a relative gate;
  the upper bound is checked for <, <=, the lower for >, >=). A point that passes with an interval that
  does not FAILS as inconclusive, naming the interval; a metric without the interval FAILS and says so.
  gate.json records the interval judged. Without `confidence` nothing about a gate changes.
- The result is written as gate.json beside report.json, with the sha256 of the report it judged, so
  `quantkit publish` can refuse a stale or failing gate result without re-deciding anything.

Default gates (relative = candidate / baseline). They gate quality and weight memory only: speed on a
shared CI runner or a CPU is too noisy to block by default, so speed gates are opt-in in the recipe.
The memory ratios are loose because small models keep a large bf16 embedding (SmolLM2-135M: W8A8
weights are 0.61 of bf16, W4A16 0.42); for 7B+ models tighten them in the recipe (about 0.55 / 0.30).

    scheme    perplexity ratio  top-1 agreement  task accuracy recovery  weight memory ratio
    W8A8      <= 1.05           >= 0.90          >= 0.97                 <= 0.65
    FP8       <= 1.03           >= 0.92          >= 0.98                 <= 0.65
    W8A16     <= 1.03           >= 0.92          >= 0.98                 <= 0.65
    W4A16     <= 1.35           >= 0.75          >= 0.90                 <= 0.45
    other     <= 1.10           >= 0.85          >= 0.95                 (none)

W4A16's perplexity bound is wide because 4-bit weights cost tiny models far more than 7B+ ones (the
demo model is 135 M parameters); a production recipe for a large model should ask for <= 1.05.
"""

from __future__ import annotations

import difflib
import json
import math
import operator
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pydantic import ValidationError

from quantkit.evaluate.metrics import fmt_value
from quantkit.evaluate.report import EVAL_DIR, REPORT_FILE, default_report_path
from quantkit.evaluate.report import SCHEMA as REPORT_SCHEMA
from quantkit.io import atomic_write_json, atomic_write_text, sha256_file
from quantkit.recipe import GateSpec

GATE_SCHEMA = "quantkit.gate/1"
GATE_FILE = "gate.json"

_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


class GateError(ValueError):
    """A problem with the report or gate file itself (not a failing gate), phrased with the fix."""


def resolve_report_path(path: str | Path) -> Path:
    """Accept a report.json, an eval output folder, or an artifact folder; returns an absolute path."""
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        for cand in (p / REPORT_FILE, default_report_path(p)):
            if cand.is_file():
                return cand
        raise GateError(f"{p}: no {REPORT_FILE} here or in {p / EVAL_DIR}; run `quantkit eval {p}` first")
    if not p.is_file():
        raise GateError(f"{p}: no such report; run `quantkit eval ARTIFACT` first, or pass the report.json path")
    return p


def gate_path(report_path: str | Path) -> Path:
    return Path(report_path).parent / GATE_FILE


def _g(metric: str, op: str, threshold: float, relative: bool) -> GateSpec:
    return GateSpec(metric=metric, op=op, threshold=threshold, relative=relative)


def _defaults(ppl: float, top1: float, acc: float, mem: float | None) -> tuple[GateSpec, ...]:
    gates = [_g("quality.perplexity", "<=", ppl, True), _g("quality.top1_agreement", ">=", top1, False),
             _g("tasks.mean_acc", ">=", acc, True)]
    if mem is not None:
        gates.append(_g("memory.weight_bytes", "<=", mem, True))
    return tuple(gates)


# Explicit table (no discovery): scheme name -> default gates. See the module docstring for the reasons.
DEFAULT_GATES: dict[str, tuple[GateSpec, ...]] = {
    "W8A8": _defaults(1.05, 0.90, 0.97, 0.65),
    "FP8": _defaults(1.03, 0.92, 0.98, 0.65),
    "W8A16": _defaults(1.03, 0.92, 0.98, 0.65),
    "W4A16": _defaults(1.35, 0.75, 0.90, 0.45),
}
FALLBACK_GATES = _defaults(1.10, 0.85, 0.95, None)


def default_gates(scheme: str | None) -> tuple[GateSpec, ...]:
    return DEFAULT_GATES.get(scheme or "", FALLBACK_GATES)


def gate_label(g: GateSpec) -> str:
    if g.name:
        return g.name
    return f"{g.metric}{' ratio' if g.relative else ''} {g.op} {g.threshold:g}"


@dataclass
class GateResult:
    name: str
    metric: str
    op: str
    threshold: float
    relative: bool
    baseline: float | None
    candidate: float | None
    value: float | None  # what was compared: candidate, or candidate / baseline
    passed: bool
    reason: str
    unit: str = ""
    confidence: float | None = None  # the gate's `confidence`, if it asked for one
    interval: list[float] | None = None  # the interval it judged ([low, high] of what was compared)


@dataclass
class GateReport:
    report_path: str
    report_sha256: str
    artifact: dict
    source: str  # "explicit", "recipe", or "defaults for <scheme>"
    results: list[GateResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def summary(self) -> str:
        n_ok = sum(r.passed for r in self.results)
        return f"{'PASS' if self.passed else 'FAIL'} {n_ok}/{len(self.results)}"

    def to_dict(self) -> dict:
        return {"schema": GATE_SCHEMA, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "report": self.report_path, "report_sha256": self.report_sha256, "artifact": self.artifact,
                "source": self.source, "passed": self.passed, "summary": self.summary,
                "gates": [asdict(r) for r in self.results]}


# ------------------------------------------------------------------------------------------ evaluation
def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def evaluate_gate(gate: GateSpec, metrics: dict) -> GateResult:
    """Check one gate against report.json's `metrics` dict; every way to be unmeasurable is a failure."""
    def result(passed: bool, reason: str, baseline=None, candidate=None, value=None, unit="",
               interval=None) -> GateResult:
        return GateResult(gate_label(gate), gate.metric, gate.op, gate.threshold, gate.relative,
                          baseline, candidate, value, passed, reason, unit, gate.confidence, interval)

    if gate.metric not in metrics:
        close = difflib.get_close_matches(gate.metric, list(metrics), n=3, cutoff=0.6)
        if close:
            hint = f"; did you mean {', '.join(close)}?"
        elif metrics:
            names = sorted(metrics)
            hint = f"; the report has {', '.join(names[:8])}" + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        else:
            hint = "; the report has no metrics at all"
        return result(False, f"metric {gate.metric!r} is missing from the report{hint}")
    m = metrics[gate.metric] or {}
    base, cand, unit = _num(m.get("baseline")), _num(m.get("candidate")), str(m.get("unit", ""))
    if cand is None or not math.isfinite(cand):
        return result(False, f"candidate value is {m.get('candidate')!r}: the eval did not measure it", base, cand, unit=unit)
    if gate.relative:
        if base is None or not math.isfinite(base):
            return result(False, f"baseline value is {m.get('baseline')!r}: a relative gate needs the baseline "
                                 "measured (run the eval with its baseline)", base, cand, unit=unit)
        if base == 0:
            return result(False, "baseline is 0, so candidate/baseline is undefined; use an absolute gate",
                          base, cand, unit=unit)
        value = cand / base
    else:
        value = cand
    ok = _OPS[gate.op](value, gate.threshold)
    what = "ratio" if gate.relative else "value"
    reason = f"{what} {value:.4g} {gate.op if ok else 'violates ' + gate.op} {gate.threshold:g}"
    if gate.confidence is None:
        return result(ok, reason, base, cand, value, unit)
    interval, missing = _interval(gate, m)
    if not ok:  # the point fails: as without `confidence`, with the interval for the reader
        shown = f" ({gate.confidence:.0%} interval [{interval[0]:.4g}, {interval[1]:.4g}])" if interval else ""
        return result(False, reason + shown, base, cand, value, unit, interval)
    if interval is None:
        return result(False, f"{reason}, but the gate asks for confidence {gate.confidence:g} and {missing}",
                      base, cand, value, unit)
    lo, hi = interval
    bound = hi if gate.op in ("<=", "<") else lo  # the end of the interval nearest failing
    shown = f"the {gate.confidence:.0%} interval [{lo:.4g}, {hi:.4g}]"
    if _OPS[gate.op](bound, gate.threshold):
        return result(True, f"{reason}, and so does all of {shown}", base, cand, value, unit, interval)
    return result(False, f"point {value:.4g} passes {gate.op} {gate.threshold:g} but {shown} does not: inconclusive, "
                         "the sample is too small to be sure; score more windows/items", base, cand, value, unit,
                  interval)


def _interval(gate: GateSpec, m: dict) -> tuple[list[float] | None, str]:
    """(the 95% interval of what the gate compares, or None and why not) from a metric's "ci95"."""
    ci = m.get("ci95") if isinstance(m.get("ci95"), dict) else {}
    key = "ratio" if gate.relative else "candidate"
    iv = ci.get(key)
    if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(_num(x) is not None and math.isfinite(x) for x in iv):
        return [float(iv[0]), float(iv[1])], ""
    if gate.relative and ci.get("baseline") is not None and ci.get("candidate") is not None:
        return None, ("the report has each side's interval but no paired interval of the ratio (combining the two "
                      "would be a guess); gate the candidate's value, or drop `confidence`")
    if not ci:
        return None, (f"the report has no interval for {gate.metric} (a report from before intervals, or a metric "
                      "without one; see quantkit/evaluate/confidence.py); re-run the eval, or drop `confidence`")
    return None, (f"the report has no {'ratio' if gate.relative else 'candidate'} interval for {gate.metric} "
                  f"(too few windows or items, or none for this kind of metric); drop `confidence` or measure more")


def read_report(report_path: Path) -> dict:
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise GateError(f"{report_path}: not valid JSON ({exc}); re-run `quantkit eval`") from None
    if not isinstance(report, dict) or report.get("schema") != REPORT_SCHEMA:
        got = report.get("schema") if isinstance(report, dict) else type(report).__name__
        raise GateError(f"{report_path}: schema is {got!r}, expected {REPORT_SCHEMA!r}; is this a quantkit eval report?")
    if not isinstance(report.get("metrics"), dict):
        raise GateError(f"{report_path}: 'metrics' must be a mapping of metric name -> "
                        "{baseline, candidate, unit, higher_is_better}")
    return report


def find_manifest(report_path: Path, report: dict) -> dict | None:
    """The manifest of the artifact the report describes: report.artifact.path, else a parent folder."""
    from quantkit.export.manifest import MANIFEST

    cands = []
    art = (report.get("artifact") or {}).get("path")
    if art:
        cands.append(Path(art))
    cands += [report_path.parent.parent, report_path.parent]
    for c in cands:
        if (c / MANIFEST).is_file():
            return json.loads((c / MANIFEST).read_text(encoding="utf-8"))
    return None


def select_gates(report_path: Path, report: dict) -> tuple[list[GateSpec], str]:
    man = find_manifest(report_path, report)
    if man is None:
        raise GateError(f"{report_path}: no gates given and no artifact manifest found (looked at report.artifact.path "
                        "and the report's parent folders); pass gates explicitly or keep the report in <artifact>/eval/")
    recipe_gates = (man.get("recipe") or {}).get("gates") or []
    if recipe_gates:
        try:
            return [GateSpec.model_validate(g) for g in recipe_gates], "recipe"
        except ValidationError as exc:
            raise GateError(f"{report_path}: the artifact's manifest has invalid recipe.gates ({exc.errors()[0]['msg']}); "
                            "pass gates explicitly or re-convert with a fixed recipe") from None
    stages = (man.get("quantization") or {}).get("stages") or [{}]
    scheme = stages[-1].get("scheme")
    return list(default_gates(scheme)), f"defaults for {scheme or 'an unknown scheme'}"


def run_gates(report_path: str | Path, gates: list[GateSpec] | None = None, write: bool = True) -> GateReport:
    """Evaluate gates on a report; write gate.json beside it (unless write=False) and return the GateReport."""
    report_path = resolve_report_path(report_path)
    report = read_report(report_path)
    if gates is None:
        gates, source = select_gates(report_path, report)
    else:
        gates, source = list(gates), "explicit"
    if not gates:
        raise GateError(f"{report_path}: no gates to run; an empty gate list would pass anything")
    gr = GateReport(str(report_path.resolve()), sha256_file(report_path), report.get("artifact") or {}, source,
                    [evaluate_gate(g, report["metrics"]) for g in gates])
    if write:
        atomic_write_json(gate_path(report_path), gr.to_dict())
    return gr


def check_gate_file(report_path: Path) -> dict:
    """For publish: the gate.json beside `report_path`, which must match the report byte for byte and pass."""
    gp = gate_path(report_path)
    if not gp.is_file():
        raise GateError(f"{gp}: no gate result; run `quantkit gate {report_path}` first")
    try:
        gate = json.loads(gp.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise GateError(f"{gp}: not valid JSON ({exc}); re-run `quantkit gate {report_path}`") from None
    if gate.get("schema") != GATE_SCHEMA:
        raise GateError(f"{gp}: schema {gate.get('schema')!r} is not {GATE_SCHEMA!r}; re-run `quantkit gate`")
    if gate.get("report_sha256") != sha256_file(report_path):
        raise GateError(f"{gp}: was computed for a different {report_path.name} (sha256 differs); "
                        f"re-run `quantkit gate {report_path}`")
    if not gate.get("passed"):
        failed = [g["name"] + ": " + g["reason"] for g in gate.get("gates", []) if not g.get("passed")]
        raise GateError(f"{gp}: gates failed ({gate.get('summary')}): " + "; ".join(failed or ["no gates ran"]))
    return gate


# -------------------------------------------------------------------------------------------- output
def format_table(gr: GateReport) -> str:
    rows = [("gate", "baseline", "candidate", "compared", "threshold", "result")]
    for r in gr.results:
        rows.append((r.name, fmt_value(r.baseline), fmt_value(r.candidate),
                     ((fmt_value(r.value) + (" (ratio)" if r.relative else "")) if r.value is not None else "-")
                     + (f" [{fmt_value(r.interval[0])}, {fmt_value(r.interval[1])}]" if r.interval else ""),
                     f"{r.op} {r.threshold:g}", "pass" if r.passed else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for r in gr.results:
        if not r.passed:
            lines.append(f"  ! {r.name}: {r.reason}")
    lines.append(f"{gr.summary} ({gr.source}) -> {gate_path(gr.report_path)}")
    return "\n".join(lines)


def junit_xml(gr: GateReport) -> str:
    """One <testcase> per gate; a failing gate carries <failure message=reason>."""
    fails = sum(not r.passed for r in gr.results)
    name = (gr.artifact or {}).get("name") or Path(gr.report_path).parent.name
    suites = ET.Element("testsuites", name="quantkit.gates", tests=str(len(gr.results)), failures=str(fails))
    suite = ET.SubElement(suites, "testsuite", name=f"quantkit.gates.{name}", tests=str(len(gr.results)),
                          failures=str(fails), errors="0", skipped="0")
    props = ET.SubElement(suite, "properties")
    for k, v in (("report", gr.report_path), ("report_sha256", gr.report_sha256), ("source", gr.source)):
        ET.SubElement(props, "property", name=k, value=v)
    for r in gr.results:
        case = ET.SubElement(suite, "testcase", classname=f"quantkit.gates.{name}", name=r.name, time="0")
        ci = f" interval=[{fmt_value(r.interval[0])}, {fmt_value(r.interval[1])}]" if r.interval else ""
        out = (f"metric={r.metric} baseline={fmt_value(r.baseline)} candidate={fmt_value(r.candidate)} "
               f"compared={fmt_value(r.value)}{ci} {r.op} {r.threshold:g}: {r.reason}")
        if not r.passed:
            ET.SubElement(case, "failure", message=r.reason, type="GateFailed").text = out
        ET.SubElement(case, "system-out").text = out
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def write_junit(gr: GateReport, path: str | Path) -> None:
    atomic_write_text(path, junit_xml(gr))
