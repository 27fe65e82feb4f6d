"""The eval's orchestration end to end on a stand-in engine (benchmarks/report_schema_check.py's deterministic
OpenAI server and lm-eval): every probe runs on each side, a serving variant runs the serving probes only,
the baseline cache is reused, and a failed probe makes the report incomplete (fail closed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import report_schema_check as S  # noqa: E402


@pytest.fixture(scope="module")
def tiny_art(tmp_path_factory) -> Path:
    from conftest import make_tiny_model, tiny_recipe

    from quantkit import api
    from quantkit.recipe import parse_recipe

    tmp = tmp_path_factory.mktemp("probes")
    base = make_tiny_model(tmp / "base")
    return api.convert(parse_recipe(tiny_recipe(base, None, [{"method": "rtn", "scheme": "W8A8"}])), tmp / "art",
                       quiet=True)


def _suite(tmp_path: Path) -> Path:
    from quantkit.resources import shipped

    suite = yaml.safe_load(shipped("evals", "suites", "smoke.yaml").read_text())
    suite["variants"] = [{"name": "pc", "engine_args": {"enable_prefix_caching": True}}]
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def _stand_in(monkeypatch, failing: tuple[str, ...] = ()):
    from quantkit import engine as engine_mod

    srv, url = S.serve(failing)
    monkeypatch.setitem(engine_mod.ENGINES, "vllm", S.fake_vllm(url))
    for name, mod in S.fake_lm_eval().items():
        monkeypatch.setitem(sys.modules, name, mod)
    return srv


def test_every_probe_runs_and_the_variant_runs_the_serving_probes(tiny_art, tmp_path, monkeypatch):
    from quantkit.evaluate.catalogue import metric
    from quantkit.evaluate.run import EvalOptions, run_eval

    srv = _stand_in(monkeypatch)
    said: list[str] = []
    try:
        out = run_eval(tiny_art, suite=_suite(tmp_path), output=tmp_path / "eval", progress=said.append)
        again = run_eval(tiny_art, suite=_suite(tmp_path), output=tmp_path / "again",
                         options=EvalOptions(progress=said.append))
    finally:
        srv.shutdown()
    r = json.loads((out / "report.json").read_text())
    assert r["complete"] and r["incomplete"] == []
    for role in ("baseline", "candidate"):
        side = r["details"][role]
        assert set(side["timings"]) == {"reference_s", "engine_start_s", "quality_s", "tasks_s", "checks_s", "speed_s"}
        assert {"reference", "quality", "tasks", "checks", "speed", "memory"} <= set(side)
    assert r["details"]["candidate"]["artifact"]["coverage"] == 1.0 and "artifact" not in r["details"]["baseline"]
    (variant,) = r["variants"]
    assert {"speed", "memory"} <= set(variant) and not {"quality", "tasks", "checks", "reference"} & set(variant)
    assert set(variant["timings"]) == {"engine_start_s", "speed_s"}
    for name, row in r["metrics"].items():  # every metric labelled from its catalogue entry
        assert (row["unit"], row["higher_is_better"]) == (metric(name).unit, metric(name).higher_is_better), name
    assert r["metrics"]["quality.kl_mean"]["baseline"] == 0.0 and r["metrics"]["quality.kl_mean"]["candidate"] > 0
    assert r["metrics"]["tools.baseline_agreement"]["baseline"] == 1.0
    reused = json.loads((again / "report.json").read_text())["baseline"]["reused"]
    assert reused is not None and reused["source_eval"] == str(out)
    assert any(m.startswith("[baseline] reusing the measurement of") for m in said)


def test_a_failed_probe_makes_the_report_incomplete(tiny_art, tmp_path, monkeypatch):
    from quantkit.evaluate.run import IncompleteEval, run_eval

    srv = _stand_in(monkeypatch, failing=("/v1/chat/completions",))
    try:
        with pytest.raises(IncompleteEval, match="checks.tools: every request failed") as exc:
            run_eval(tiny_art, suite=_suite(tmp_path), output=tmp_path / "eval", fresh_baseline=True,
                     progress=lambda m: None)
    finally:
        srv.shutdown()
    assert exc.value.exit_code == 3
    r = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert r["complete"] is False and any(x.startswith("candidate checks.safety") for x in r["incomplete"])
