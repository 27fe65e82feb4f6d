"""Gate evaluation: absolute and relative gates, missing/null metrics, defaults, gate.json, JUnit, CLI exit codes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from _artifacts import GOOD_METRICS, make_artifact, make_report
from pydantic import ValidationError
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.gates import (GateError, check_gate_file, evaluate_gate, gate_path, junit_xml,
                            run_gates)
from quantkit.recipe import GateSpec, RecipeError, parse_recipe


def g(metric, op, threshold, relative=False):
    return GateSpec(metric=metric, op=op, threshold=threshold, relative=relative)


def test_relative_gate_is_candidate_over_baseline():
    r = evaluate_gate(g("quality.perplexity", "<=", 1.03, True), GOOD_METRICS)
    assert r.value == pytest.approx(1.02) and r.passed
    r = evaluate_gate(g("quality.perplexity", "<=", 1.01, True), GOOD_METRICS)
    assert r.value == pytest.approx(1.02) and not r.passed and "violates <=" in r.reason
    r = evaluate_gate(g("speed.c1.tpot_ms_p50", "<=", 0.9, True), GOOD_METRICS)  # 23/31 = 0.742
    assert r.passed and r.value == pytest.approx(23 / 31)
    r = evaluate_gate(g("tasks.mean_acc", ">=", 0.995, True), GOOD_METRICS)  # recovery 0.99
    assert not r.passed and r.value == pytest.approx(0.99)


def test_absolute_gate_uses_candidate_value_only():
    r = evaluate_gate(g("quality.top1_agreement", ">=", 0.9), GOOD_METRICS)
    assert r.passed and r.value == 0.95 and r.baseline is None
    assert not evaluate_gate(g("quality.top1_agreement", ">", 0.95), GOOD_METRICS).passed  # strict
    assert evaluate_gate(g("quality.top1_agreement", ">=", 0.95), GOOD_METRICS).passed


def test_missing_metric_fails_and_says_why():
    r = evaluate_gate(g("quality.perplexty", "<=", 1.05, True), GOOD_METRICS)
    assert not r.passed and "missing from the report" in r.reason and "quality.perplexity" in r.reason  # did-you-mean
    r = evaluate_gate(g("speed.c8.tpot_ms_p95", "<=", 0.9, True), GOOD_METRICS)
    assert not r.passed and "speed.c8.tpot_ms_p95" in r.reason
    assert "no metrics at all" in evaluate_gate(g("quality.perplexity", "<=", 1, True), {}).reason


@pytest.mark.parametrize("metric, why", [
    ({"baseline": None, "candidate": 1.0}, "needs the baseline"),
    ({"baseline": 0, "candidate": 1.0}, "baseline is 0"),
    ({"baseline": 1.0, "candidate": None}, "did not measure it"),
    ({"baseline": 1.0, "candidate": float("nan")}, "did not measure it"),
])
def test_unmeasurable_relative_gate_fails(metric, why):
    r = evaluate_gate(g("quality.perplexity", "<=", 1.05, True), {"quality.perplexity": metric})
    assert not r.passed and why in r.reason


def test_recipe_gates_are_used_and_gate_json_written(tmp_path):
    art = make_artifact(tmp_path / "a", gates=[{"metric": "quality.perplexity", "op": "<=", "threshold": 1.05,
                                                "relative": True}])
    rep = make_report(art)
    gr = run_gates(rep)
    # completeness, the recipe's gate, then the W8A8 defaults on other metrics (16 rows, tasks.*.* expanded)
    assert gr.source == "recipe (1) + defaults for W8A8 (16)" and gr.passed
    assert [r.metric for r in gr.results[:2]] == ["report.complete", "quality.perplexity"]
    assert [r.threshold for r in gr.results if r.metric == "quality.perplexity" and r.bound is None] == [1.05]
    saved = json.loads(gate_path(rep).read_text())
    assert saved["passed"] is True and saved["summary"] == "PASS 18/18"
    assert saved["gates"][1]["value"] == pytest.approx(1.02)
    assert check_gate_file(rep)["passed"]


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16"])
def test_default_gates_per_scheme(tmp_path, scheme):
    art = make_artifact(tmp_path / scheme, scheme=scheme)
    weights = {"W8A8": 165e6, "W4A16": 115e6}[scheme]  # SmolLM2-135M-like: bf16 embedding kept
    metrics = {**GOOD_METRICS, "memory.weight_bytes": {**GOOD_METRICS["memory.weight_bytes"], "candidate": weights}}
    gr = run_gates(make_report(art, metrics))
    assert gr.source == f"defaults for {scheme}"
    # the table in docs/evaluation.md (Gates), written out by hand: (metric, op, threshold, relative)
    by_scheme = {"W8A8": [("quality.perplexity", "<=", 1.05, True), ("quality.top1_agreement", ">=", 0.90, False),
                          ("tasks.mean_acc", ">=", 0.97, True), ("tasks.qk_suite.acc", ">=", 0.90, True),
                          ("memory.weight_bytes", "<=", 0.65, True)],
                 "W4A16": [("quality.perplexity", "<=", 1.35, True), ("quality.top1_agreement", ">=", 0.75, False),
                           ("tasks.mean_acc", ">=", 0.90, True), ("tasks.qk_suite.acc", ">=", 0.83, True),
                           ("memory.weight_bytes", "<=", 0.45, True)]}[scheme]
    every_scheme = [("memory.engine_bytes", "<=", 1.0, True), ("speed.decode_tpot_ms_p50", "<=", 1.0, True),
                    ("speed.peak_output_tok_s", ">=", 1.0, True), ("speed.failed_requests", "<=", 0.0, False),
                    ("cost.machine_s_per_k_successful_tasks", "<=", 1.0, True),
                    ("tools.baseline_agreement", ">=", 0.75, False), ("safety.flip_rate", "<=", 0.10, False),
                    ("generation.degenerate_excess", "<=", 0.0, False), ("artifact.coverage", ">=", 1.0, False),
                    ("artifact.nonfinite_tensors", "<=", 0.0, False), ("artifact.experts_unrecorded", "<=", 0.0, False),
                    ("quality.perplexity", ">=", 1.0, True)]  # the last: the anomaly gate (interval's upper bound)
    expected = [("report.complete", "==", 1.0, False)] + by_scheme + every_scheme
    got = [(r.metric, r.op, r.threshold, r.relative) for r in gr.results]
    assert sorted(got) == sorted(expected)
    assert gr.passed, [r.reason for r in gr.results]  # within every default of its scheme
    if scheme == "W4A16":  # the W8A8-sized checkpoint would not pass W4A16's memory gate
        assert not run_gates(make_report(art), write=False).passed


def test_report_path_may_be_the_artifact_folder(tmp_path):
    art = make_artifact(tmp_path / "a")
    rep = make_report(art)
    assert run_gates(art).report_path == str(rep.resolve())


def test_stale_or_failing_gate_file_is_refused(tmp_path):
    art = make_artifact(tmp_path / "a")
    rep = make_report(art)
    with pytest.raises(GateError, match="no gate result"):
        check_gate_file(rep)
    run_gates(rep)
    make_report(art, metrics={**GOOD_METRICS, "quality.perplexity": {"baseline": 10.0, "candidate": 20.0}})
    with pytest.raises(GateError, match="different report.json"):
        check_gate_file(rep)
    assert not run_gates(rep).passed
    assert check_gate_file(rep)["passed"] is False  # a record of the failure; publish re-decides (test_trust_chain)


def test_bad_report_is_an_error_not_a_failure(tmp_path):
    p = tmp_path / "report.json"
    p.write_text('{"schema": "something/else", "metrics": {}}')
    with pytest.raises(GateError, match="expected 'quantkit.report/1'"):
        run_gates(p)
    with pytest.raises(GateError, match="no such report"):
        run_gates(tmp_path / "nope.json")
    with pytest.raises(GateError, match="empty gate list"):
        run_gates(make_report(make_artifact(tmp_path / "a")), gates=[])


def test_junit_xml_content(tmp_path):
    art = make_artifact(tmp_path / "a")
    gates = [g("quality.perplexity", "<=", 1.05, True), g("quality.top1_agreement", ">=", 0.99),
             g("cost.usd_per_mtok_output", "<=", 1.0)]
    gr = run_gates(make_report(art), gates=gates)
    root = ET.fromstring(junit_xml(gr))
    suite = root.find("testsuite")
    assert (root.tag, suite.get("tests"), suite.get("failures")) == ("testsuites", "4", "2")  # + report complete
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert set(cases) == {"report complete", "quality.perplexity ratio <= 1.05", "quality.top1_agreement >= 0.99",
                          "cost.usd_per_mtok_output <= 1"}
    assert cases["quality.perplexity ratio <= 1.05"].find("failure") is None
    f = cases["quality.top1_agreement >= 0.99"].find("failure")
    assert "0.95 violates >= 0.99" in f.get("message") and "candidate=0.95" in f.text
    assert "missing from the report" in cases["cost.usd_per_mtok_output <= 1"].find("failure").get("message")
    assert {p.get("name") for p in suite.find("properties")} == {"report", "report_sha256", "source"}


def test_cli_gate_exit_codes_and_junit(tmp_path):
    runner = CliRunner()
    art = make_artifact(tmp_path / "ok", gates=[{"metric": "quality.perplexity", "op": "<=", "threshold": 1.05,
                                                 "relative": True}])
    rep = make_report(art)
    junit = tmp_path / "out" / "gates.xml"
    res = runner.invoke(app, ["gate", str(rep), "--junit", str(junit)])
    assert res.exit_code == 0, res.output
    assert "quality.perplexity ratio <= 1.05" in res.output and "pass" in res.output and "PASS 18/18" in res.output
    assert ET.parse(junit).getroot().find("testsuite").get("failures") == "0"

    bad = make_artifact(tmp_path / "bad", gates=[{"metric": "quality.perplexity", "op": "<=", "threshold": 1.01,
                                                  "relative": True}])
    res = runner.invoke(app, ["gate", str(make_report(bad))])
    assert res.exit_code == 1 and "FAIL" in res.output and "violates <= 1.01" in res.output

    res = runner.invoke(app, ["gate", str(tmp_path / "missing.json")])
    assert res.exit_code == 2 and "no such report" in res.output


def test_recipe_rejects_metric_names_outside_the_report_families():
    with pytest.raises(ValidationError, match="not a metric name"):
        GateSpec(metric="perplexity", op="<=", threshold=1.0)
    GateSpec(metric="speed.c4.tpot_ms_p90", op="<=", threshold=0.9, relative=True)
    data = {"name": "x", "model": {"path": "m"}, "stages": [{"method": "rtn", "scheme": "W8A8"}],
            "gates": [{"metric": "latency.tpot", "op": "<=", "threshold": 1}]}
    with pytest.raises(RecipeError, match=r"gates\[0\]\.metric"):
        parse_recipe(data, "r.yaml")


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16"])
def test_default_gates_name_catalogue_metrics_in_their_direction(scheme):
    """Every default gate names a metric of the catalogue and asks for its better side (the anomaly row, the
    one exception, asks that the perplexity ratio's interval reaches 1)."""
    from quantkit.evaluate.catalogue import is_metric_name, metric
    from quantkit.gates import ANOMALY, default_gates

    for g in [g for gs in default_gates(scheme).values() for g in gs] + [ANOMALY]:
        assert is_metric_name(g.metric), g.metric
        if "*" not in g.metric and g is not ANOMALY:
            assert metric(g.metric).higher_is_better == (g.op in (">=", ">")), g.metric
