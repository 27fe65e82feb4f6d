"""Gates: thresholds on report.json metrics that decide whether an artifact may be published.

A gate is `metric op threshold`, on the candidate's value (absolute) or on candidate / baseline (relative).
Nothing is skipped silently: a missing, null or non-finite value fails the gate and says why, and an
incomplete report fails its first row. Which gates run, the defaults and the confidence rules:
docs/evaluation.md ("Gates").
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import operator
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pydantic import ValidationError

from quantkit.evaluate.catalogue import family
from quantkit.evaluate.metrics import fmt_value
from quantkit.evaluate.report import EVAL_DIR, REPORT_FILE, default_report_path
from quantkit.evaluate.report import SCHEMA as REPORT_SCHEMA
from quantkit.io import atomic_write_json, atomic_write_text, sha256_file
from quantkit.recipe import GateSpec
from quantkit.schemes import BAR_4BIT, SCHEMES, QualityBar

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


def _g(metric: str, op: str, threshold: float, relative: bool, **kw) -> GateSpec:
    return GateSpec(metric=metric, op=op, threshold=threshold, relative=relative, **kw)


def _bar(schemes: list[str]) -> QualityBar:
    """The loosest QualityBar over the named schemes (unknown names: the 4-bit bar, the loosest there is)."""
    bars = [SCHEMES[s].bar for s in schemes if s in SCHEMES] or [BAR_4BIT]
    pick = {f: (min if f == "top1_agreement" or f.startswith("task_recovery") else max) for f in
            ("perplexity_ratio", "top1_agreement", "task_recovery", "task_recovery_each", "weight_memory_ratio")}
    return QualityBar(**{f: agg(getattr(b, f) for b in bars) for f, agg in pick.items()})


def default_gates(schemes: list[str] | str | None) -> dict[str, tuple[GateSpec, ...]]:
    """family -> the default gates of an artifact in these schemes (see the module docstring)."""
    names = [schemes] if isinstance(schemes, str) else list(schemes or [])
    bar = _bar(names)
    return {
        "quality": (_g("quality.perplexity", "<=", bar.perplexity_ratio, True),
                    _g("quality.top1_agreement", ">=", bar.top1_agreement, False)),
        "tasks": (_g("tasks.mean_acc", ">=", bar.task_recovery, True),
                  _g("tasks.*.*", ">=", bar.task_recovery_each, True)),
        "memory": (_g("memory.weight_bytes", "<=", bar.weight_memory_ratio, True),
                   _g("memory.engine_bytes", "<=", 1.0, True)),
        "speed": (_g("speed.decode_tpot_ms_p50", "<=", 1.0, True), _g("speed.peak_output_tok_s", ">=", 1.0, True),
                  _g("speed.failed_requests", "<=", 0, False)),
        "cost": (_g("cost.machine_s_per_k_successful_tasks", "<=", 1.0, True),),
        "checks": (_g("tools.baseline_agreement", ">=", 0.75, False), _g("safety.flip_rate", "<=", 0.10, False)),
        "generation": (_g("generation.degenerate_excess", "<=", 0, False),),
        "artifact": (_g("artifact.coverage", ">=", 1.0, False), _g("artifact.nonfinite_tensors", "<=", 0, False),
                     _g("artifact.experts_unrecorded", "<=", 0, False)),
    }


ANOMALY = _g("quality.perplexity", ">=", 1.0, True, bound="upper",
             name="anomaly: perplexity ratio's 95% interval reaches 1 (not better than the baseline beyond the noise)")
# metric families (quantkit/evaluate/catalogue.py) always gated, whatever the recipe gates: a recipe cannot leave
# these out (the anomaly row it can accept)
INTEGRITY_FAMILIES = ("artifact",)


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
    bound: str | None = None  # the gate's `bound`: it compared this end of the interval, not the point


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
                          baseline, candidate, value, passed, reason, unit, gate.confidence, interval, gate.bound)

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
    if gate.bound is not None:
        return _on_bound(gate, m, value, result, base, cand, unit)
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


def _on_bound(gate: GateSpec, m: dict, value: float, result, base, cand, unit) -> GateResult:
    """A gate on one end of the metric's 95% interval (`bound`), not on the point value."""
    interval, missing = _interval(gate, m)
    if interval is None:
        return result(False, f"the gate compares the interval's {gate.bound} bound, but {missing}", base, cand, value,
                      unit)
    end = interval[1] if gate.bound == "upper" else interval[0]
    ok = _OPS[gate.op](end, gate.threshold)
    what = "ratio" if gate.relative else "value"
    return result(ok, f"{what} {value:.4g}; the {gate.bound} bound of its 95% interval [{interval[0]:.4g}, "
                      f"{interval[1]:.4g}] {gate.op if ok else 'violates ' + gate.op} {gate.threshold:g}",
                  base, cand, value, unit, interval)


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


def manifest_schemes(man: dict) -> list[str]:
    return [st["scheme"] for st in (man.get("quantization") or {}).get("stages") or [] if st.get("scheme")]


def effective_gates(man: dict) -> tuple[list[GateSpec], str]:
    """The gates an artifact answers to (see the module docstring), and where they came from."""
    recipe = man.get("recipe") or {}
    try:
        own = [GateSpec.model_validate(g) for g in recipe.get("gates") or []]
    except ValidationError as exc:
        raise GateError(f"the artifact's manifest has invalid recipe.gates ({exc.errors()[0]['msg']}); "
                        "re-convert with a fixed recipe") from None
    gated = {g.metric for g in own}
    schemes = manifest_schemes(man)
    added = [g for gs in default_gates(schemes).values() for g in gs
             if (g.metric not in gated or family(g.metric) in INTEGRITY_FAMILIES) and g not in own]
    anomaly = [] if recipe.get("accept_anomalies") else [ANOMALY]
    source = (f"recipe ({len(own)}) + defaults for {'+'.join(schemes) or 'an unknown scheme'} "
              f"({len(added) + len(anomaly)})" if own else f"defaults for {'+'.join(schemes) or 'an unknown scheme'}")
    return own + added + anomaly, source


def select_gates(report_path: Path, report: dict) -> tuple[list[GateSpec], str]:
    man = find_manifest(report_path, report)
    if man is None:
        raise GateError(f"{report_path}: no gates given and no artifact manifest found (looked at report.artifact.path "
                        "and the report's parent folders); pass gates explicitly or keep the report in <artifact>/eval/")
    try:
        return effective_gates(man)
    except GateError as exc:
        raise GateError(f"{report_path}: {exc}") from None


def _expand(gate: GateSpec, metrics: dict) -> list[GateSpec]:
    """A gate over 'tasks.*.acc' is one gate per matching metric (the gate itself, failing, when none does)."""
    if "*" not in gate.metric:
        return [gate]
    found = sorted(n for n in metrics if fnmatch.fnmatchcase(n, gate.metric) and n.count(".") == gate.metric.count("."))
    return [gate.model_copy(update={"metric": n, "name": None if gate.name is None else f"{gate.name} ({n})"})
            for n in found] or [gate]


def completeness(report: dict) -> GateResult:
    """The first row of every verdict: a report some phase of which failed is not evidence."""
    missing = "complete" not in report
    bad = list(report.get("incomplete") or []) if not missing else ["the report does not say whether it is complete "
                                                                     "(written before quantkit recorded it)"]
    reason = "every phase ran" if not bad else "incomplete report: " + "; ".join(bad) + "; re-run the eval"
    return GateResult("report complete", "report.complete", "==", 1.0, False, None, float(not bad),
                      float(not bad), not bad, reason)


def judge(report: dict, gates: list[GateSpec]) -> list[GateResult]:
    """The verdict's rows: completeness, then every gate (expanded) on the report's metrics."""
    metrics = report["metrics"]
    return [completeness(report)] + [evaluate_gate(g, metrics) for gate in gates for g in _expand(gate, metrics)]


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
                    judge(report, gates))
    if write:
        atomic_write_json(gate_path(report_path), gr.to_dict())
    return gr


def _row_key(row: dict) -> tuple:
    return (row.get("metric"), row.get("op"), float(row.get("threshold", "nan")), bool(row.get("relative")),
            row.get("confidence"), row.get("bound"))


def redecide(artifact: Path, report_path: Path) -> dict:
    """For publish: the verdict recomputed from report.json with the artifact's own effective gates. Refuses
    (GateError) an artifact that changed since its eval, a gate.json that is missing, stale, lacks any of
    those gates or disagrees with the recomputed verdict, and a verdict that fails. Returns the gate.json
    record it checked (what the version stores beside the report)."""
    from quantkit.export.manifest import MANIFEST

    report = read_report(report_path)
    measured = (report.get("artifact") or {}).get("manifest_sha256")
    if not measured:
        raise GateError(f"{report_path}: the report does not name the manifest it measured (a report from before "
                        f"quantkit recorded it, or an edited one); re-run `quantkit eval {artifact}`")
    if measured != sha256_file(artifact / MANIFEST):
        raise GateError(f"{report_path} was measured on a different {MANIFEST} (the artifact changed after the eval); "
                        f"re-run `quantkit eval {artifact}` and `quantkit gate`")
    recorded = check_gate_file(report_path)
    gates, source = effective_gates(json.loads((artifact / MANIFEST).read_text(encoding="utf-8")))
    gr = GateReport(str(report_path), sha256_file(report_path), report.get("artifact") or {}, source,
                    judge(report, gates))
    if not gr.passed:
        failed = [f"{r.name}: {r.reason}" for r in gr.results if not r.passed]
        raise GateError(f"gates failed on re-checking {report_path} with the artifact's own gates ({gr.summary}): "
                        + "; ".join(failed))
    have = {_row_key(r): bool(r.get("passed")) for r in recorded.get("gates", [])}
    lacking = [r.name for r in gr.results if _row_key(asdict(r)) not in have]
    if lacking:
        raise GateError(f"{gate_path(report_path)} does not hold every gate the artifact's recipe and scheme require "
                        f"(missing: {'; '.join(lacking[:5])}{' ...' if len(lacking) > 5 else ''}); run "
                        f"`quantkit gate {report_path}` without explicit gates")
    differ = [r.name for r in gr.results if have[_row_key(asdict(r))] != r.passed]
    if differ or not recorded.get("passed"):
        raise GateError(f"{gate_path(report_path)} disagrees with re-checking the same report "
                        f"({', '.join(differ[:5]) or 'its verdict'}): it is not what `quantkit gate` wrote; "
                        f"re-run `quantkit gate {report_path}`")
    return recorded


def check_gate_file(report_path: Path) -> dict:
    """The gate.json beside `report_path`, which must parse and match the report byte for byte (a record)."""
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
