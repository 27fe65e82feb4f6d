"""`quantkit compare`: one page for several evals of one baseline; reports of different baselines refused."""

from __future__ import annotations

import json

import pytest

from quantkit import compare as cmp

from _artifacts import GOOD_METRICS, make_artifact, make_report


def _report(tmp_path, name, ppl, baseline="/models/base"):
    art = make_artifact(tmp_path / name, name=name)
    metrics = json.loads(json.dumps(GOOD_METRICS))
    metrics["quality.perplexity"]["candidate"] = ppl
    path = make_report(art, metrics)
    rep = json.loads(path.read_text())
    rep["baseline"] = {"path": baseline, "description": "the float model"}
    rep["recovery"] = {"tasks.mean_acc": 10.0 / ppl, "tasks.qk_suite.acc": 10.0 / ppl}
    path.write_text(json.dumps(rep))
    return path


def test_one_row_per_candidate_with_its_own_ratios_and_three_plots(tmp_path):
    a, b = _report(tmp_path, "cand-a", 10.5), _report(tmp_path, "cand-b", 12.0)
    md = cmp.write(cmp.load([a, b.parent.parent]), tmp_path / "out")  # a report.json, or the artifact folder
    text = md.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| cand-")]
    assert [r.split("|")[1].strip() for r in rows] == ["cand-a", "cand-b"]
    # perplexity ratio = candidate / baseline (10.0), printed to 3 significant digits; no gate.json yet
    assert [r.split("|")[4].strip() for r in rows] == ["1.05", "1.2"]
    assert all(r.split("|")[2].strip() == "not gated" for r in rows)
    pngs = sorted(p.name for p in (tmp_path / "out" / "plots").glob("*.png"))
    assert pngs == ["latency.png", "quality_cost.png", "recovery.png"]
    assert all((tmp_path / "out" / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "the float model" in text


def test_reports_of_different_baselines_are_refused(tmp_path):
    a = _report(tmp_path, "cand-a", 10.5)
    b = _report(tmp_path, "cand-b", 11.0, baseline="/models/other")
    with pytest.raises(cmp.CompareError, match="different baselines"):
        cmp.load([a, b])
    with pytest.raises(cmp.CompareError, match="two or more"):
        cmp.load([a])


def test_the_verdict_comes_from_the_candidates_gate_json(tmp_path):
    from quantkit.gates import run_gates

    a, b = _report(tmp_path, "cand-a", 10.5), _report(tmp_path, "cand-b", 30.0)
    verdicts = {p.parent.parent.name: run_gates(p).summary for p in (a, b)}
    entries = cmp.load([a, b])
    assert {e.name: e.verdict for e in entries} == verdicts
    assert verdicts["cand-b"].startswith("FAIL")  # perplexity ratio 3.0 fails the default bar
