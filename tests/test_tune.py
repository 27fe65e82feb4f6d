"""quantkit tune without an engine: study expansion and validation, the runner's resume and skip logic with
recorded steps, the Pareto front and the recommendation on recorded cell results, and the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from quantkit.evaluate.metrics import metrics_table
from quantkit.tune import report as R
from quantkit.tune.choose import COST, LATENCY, QUALITY, pareto, recommend
from quantkit.tune.run import Steps, load_records, run_study
from quantkit.tune.study import StudyError, load_study

ROOT = Path(__file__).resolve().parents[1]


def _study(tmp_path: Path, **over) -> Path:
    data = {"name": "t", "base": str(ROOT / "recipes" / "smollm2-w8a8-rtn.yaml"), "price_per_hour": 3.6,
            "load": {"normal": 1, "peak": 4},
            "axes": [{"name": "method", "values": [
                {"label": "w4", "recipe": str(ROOT / "recipes" / "smollm2-w4a16-gptq.yaml")},
                {"label": "sq", "recipe": str(ROOT / "recipes" / "smollm2-w8a8-smoothquant.yaml")}]},
                {"name": "engine", "values": [{"label": "pc", "engine_args": {"enable_prefix_caching": True}}]}]}
    data.update(over)
    p = tmp_path / "study.yaml"
    p.write_text(yaml.safe_dump(data), encoding="utf-8")
    return p


# ------------------------------------------------------------------------------------------- expansion
def test_one_at_a_time_cells_share_artifacts_and_carry_the_study_eval(tmp_path):
    st = load_study(_study(tmp_path, eval={"task_limit": 7}))
    ids = [c.id for c in st.cells]
    assert ids == ["base", "method=w4", "method=sq", "engine=pc"]  # artifact cells first, the base leading
    by = {c.id: c for c in st.cells}
    assert by["engine=pc"].serving and by["engine=pc"].quant_id == "base"
    assert by["engine=pc"].recipe.hash() == by["base"].recipe.hash()  # the same artifact
    assert by["method=w4"].recipe.stages[0].scheme == "W4A16" and by["method=w4"].recipe.calibration is not None
    assert by["base"].recipe.calibration is None  # RTN W8A8: the swap takes calibration with the stages
    for c in st.cells:  # every cell: the base's gates, the study's eval (fields, load and price)
        assert c.recipe.gates == st.base.gates
        assert c.recipe.eval.task_limit == 7 and c.recipe.eval.price_per_hour == 3.6
        assert c.recipe.eval.workload.concurrency == [1, 4]
    assert len({c.recipe.name for c in st.cells}) == 3


def test_grid_is_every_combination_with_the_base(tmp_path):
    st = load_study(_study(tmp_path, mode="grid"))
    assert sorted(c.id for c in st.cells) == sorted(
        ["base", "method=w4", "method=sq", "engine=pc", "method=w4,engine=pc", "method=sq,engine=pc"])
    assert {c.quant_id for c in st.cells if c.serving} == {"base", "method=w4", "method=sq"}
    with pytest.raises(StudyError, match="max_cells"):
        load_study(_study(tmp_path, mode="grid", max_cells=5))


def test_a_set_that_breaks_the_recipe_is_an_invalid_cell_not_a_crash(tmp_path):
    st = load_study(_study(tmp_path, axes=[{"name": "g", "values": [
        {"label": "g32", "set": {"stages[0].group_size": 32}},
        {"label": "bad", "set": {"stages[0].no_such_field": 1}}]}]))
    assert [c.id for c in st.cells] == ["base", "g=g32"]
    assert "no_such_field" in st.invalid["g=bad"] and "cell g=bad" in st.invalid["g=bad"]


@pytest.mark.parametrize("value, needle", [
    ({"label": "x", "recipe": "recipes/smollm2-fp8.yaml", "engine_args": {"max_num_seqs": 2}}, "exactly one of"),
    ({"label": "x"}, "exactly one of"),
    ({"label": "base", "engine_args": {"max_num_seqs": 2}}, "not 'base'"),
    ({"label": "x", "engine_args": {"tensor_parallel_size": 0}}, "tensor_parallel_size"),
])
def test_bad_values_are_refused_naming_the_file_and_field(tmp_path, value, needle):
    p = _study(tmp_path, axes=[{"name": "a", "values": [value]}])
    with pytest.raises(StudyError) as e:
        load_study(p)
    assert str(p) in str(e.value) and "axes[0].values" in str(e.value) and needle in str(e.value)


def test_unknown_recipe_and_missing_price(tmp_path):
    with pytest.raises(StudyError, match="axes\\[0\\].values\\[0\\].recipe: 'nope.yaml'"):
        load_study(_study(tmp_path, axes=[{"name": "a", "values": [{"label": "x", "recipe": "nope.yaml"}]}]))
    p = _study(tmp_path)
    data = yaml.safe_load(p.read_text())
    del data["price_per_hour"]
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(StudyError, match="price_per_hour: required"):
        load_study(p)


# ----------------------------------------------------------------------------------- runner (recorded)
def _report(ppl: float, acc: float, req_s: float, e2e_p99: float, price: float = 3.6, artifact: str = "") -> dict:
    lvl = {"requests_s": req_s, "output_tok_s": req_s * 40, "ttft_ms_p99": e2e_p99 / 4, "tpot_ms_p99": 20.0,
           "e2e_ms_p99": e2e_p99}

    def side(p, a):
        return {"quality": {"perplexity": p, "divergence": {"kl_mean": (p - 10) / 10, "top1_agreement": 1 - (p - 10) / 10}},
                "tasks": {"tasks": {"x": {"metric": "acc", "value": a, "items": 100, "successes": round(100 * a)}}},
                "speed": {"c4": lvl}, "memory": {"weight_bytes": 100 * p}}

    from quantkit.evaluate.metrics import cost_figures

    b, c = side(10.0, 0.8), side(ppl, acc)
    return {"metrics": metrics_table(b, c, price), "cost": {"candidate": cost_figures(c, price)},
            "artifact": {"path": artifact}, "engine": {"name": "vllm", "version": "test"}, "workload": {},
            "hardware": {"cpu": "test"}}


class Recorder:
    """Steps that record their calls and write synthetic reports; `crash_on` raises KeyboardInterrupt (a kill)."""

    def __init__(self, servable=lambda r: (True, ""), crash_on: str | None = None, fail_on: str | None = None):
        self.calls: list[tuple[str, str]] = []
        self.servable, self.crash_on, self.fail_on = servable, crash_on, fail_on

    def steps(self) -> Steps:
        def convert(recipe, out):
            self.calls.append(("convert", recipe.name))
            if self.fail_on == recipe.name:
                raise RuntimeError("conversion exploded")
            out.mkdir(parents=True, exist_ok=True)
            return out

        def evaluate(art, spec, out):
            self.calls.append(("eval", art.name))
            if self.crash_on == art.name:
                raise KeyboardInterrupt
            out.mkdir(parents=True, exist_ok=True)
            scheme_ppl = {"t-base": 10.3, "t-method-w4": 12.5, "t-method-sq": 10.2}
            rep = _report(scheme_ppl.get(art.name, 11.0), 0.75, 2.0, 900.0, artifact=str(art))
            (out / "report.json").write_text(json.dumps(rep))
            return out / "report.json"

        def serve(art, spec, args, quality_report, out):
            self.calls.append(("serve", art.name))
            out.mkdir(parents=True, exist_ok=True)
            assert json.loads(quality_report.read_text())["artifact"]["path"] == str(art)  # its own artifact's eval
            rep = _report(10.3, 0.75, 2.5, 800.0, artifact=str(art))  # faster: cheaper per successful task
            (out / "report.json").write_text(json.dumps(rep))
            return out / "report.json"

        def gate(report):
            f = json.loads(Path(report).read_text())["metrics"]["quality.perplexity"]
            ok = f["candidate"] / f["baseline"] <= 1.10
            return {"passed": ok, "results": [{"gate": "quality.perplexity <= 1.1x", "passed": ok,
                                               "reason": f"ratio {f['candidate'] / f['baseline']:.4g}"}]}

        return Steps(can_run=self.servable, convert=convert, evaluate=evaluate, serve=serve, gate=gate)


def test_a_killed_study_resumes_without_rerunning_finished_cells(tmp_path):
    st = load_study(_study(tmp_path))
    out = tmp_path / "out"
    rec = Recorder(crash_on="t-method-sq")
    with pytest.raises(KeyboardInterrupt):
        run_study(st, out, steps=rec.steps(), progress=lambda m: None)
    assert [c for c in rec.calls if c[0] == "eval"] == [("eval", "t-base"), ("eval", "t-method-w4"),
                                                        ("eval", "t-method-sq")]
    assert [r["status"] for r in load_records(st, out)] == ["done", "done", None, None]

    rec2 = Recorder()
    run_study(st, out, steps=rec2.steps(), progress=lambda m: None)
    assert rec2.calls == [("convert", "t-method-sq"), ("eval", "t-method-sq"), ("serve", "t-base")]
    assert [r["status"] for r in load_records(st, out)] == ["done"] * 4

    rec3 = Recorder()  # finished: nothing runs again, unless a cell is named with rerun
    run_study(st, out, steps=rec3.steps(), progress=lambda m: None)
    assert rec3.calls == []
    run_study(st, out, cells=["engine=pc"], rerun=True, steps=rec3.steps(), progress=lambda m: None)
    assert rec3.calls == [("serve", "t-base")]


def test_skips_say_why_and_failures_are_recorded_not_retried(tmp_path):
    st = load_study(_study(tmp_path))
    out = tmp_path / "out"

    def servable(recipe):
        w4 = any(getattr(s, "scheme", None) == "W4A16" for s in recipe.stages)
        return (False, "no int4 kernel on this CPU (AVX2 only)") if w4 else (True, "")

    rec = Recorder(servable=servable, fail_on="t-base")
    run_study(st, out, steps=rec.steps(), progress=lambda m: None)
    recs = {r["id"]: r for r in load_records(st, out)}
    assert recs["method=w4"]["status"] == "skipped" and "no int4 kernel" in recs["method=w4"]["reason"]
    assert ("convert", "t-method-w4") not in rec.calls  # decided before spending a conversion
    assert recs["base"]["status"] == "failed" and "conversion exploded" in recs["base"]["reason"]
    assert (out / "cells" / "base" / "error.log").is_file()
    assert recs["engine=pc"]["status"] == "skipped" and "artifact cell base is failed" in recs["engine=pc"]["reason"]

    rec2 = Recorder(servable=servable)
    run_study(st, out, steps=rec2.steps(), progress=lambda m: None)
    assert rec2.calls == []  # a failure repeats: retried only when asked
    run_study(st, out, retry_failed=True, steps=rec2.steps(), progress=lambda m: None)
    assert ("convert", "t-base") in rec2.calls
    assert load_records(st, out)[0]["status"] == "done"


def test_unknown_cell_is_refused(tmp_path):
    st = load_study(_study(tmp_path))
    with pytest.raises(StudyError, match="no cell 'method=w5'"):
        run_study(st, tmp_path / "o", cells=["method=w5"], steps=Recorder().steps(), progress=lambda m: None)


def test_the_tables_plots_and_recommendation_of_a_recorded_study(tmp_path):
    st = load_study(_study(tmp_path))
    out = tmp_path / "out"
    run_study(st, out, steps=Recorder().steps(), progress=lambda m: None)
    data = R.write(st, out)
    # base 10.3 (1.03x) at 2 req/s; sq 10.2 (1.02x) at 2 req/s; w4 1.25x fails the gate; pc: base at 2.5 req/s
    assert data["recommended"]["id"] == "engine=pc"
    assert data["recommended"]["ranked"] == ["engine=pc", "method=sq", "base"]  # cost, then quality on a tie
    cost = {r["id"]: r["figures"][COST] for r in data["cells"]}
    # $3.6/h = $0.001/s; 2.5 req/s; 75 of 100 items right: 1000 x 0.001 / 2.5 / 0.75
    assert cost["engine=pc"] == pytest.approx(1000 * 0.001 / 2.5 / 0.75)
    assert data["pareto"]["cost"] == ["engine=pc", "method=sq"]
    md = (out / "tune.md").read_text()
    assert "**engine=pc**" in md and "| method=w4 | done | fail |" in md and "--cell engine=pc --rerun" in md
    assert "## Gate failures" in md and "ratio 1.25" in md
    assert (out / "plots" / "pareto_cost.png").stat().st_size > 1000
    assert (out / "plots" / "pareto_latency.png").is_file()


# ----------------------------------------------------------------------------------- choosing (pure)
def _rec(cid, q, cost, lat, passed=True, status="done"):
    return {"id": cid, "status": status, "figures": {QUALITY: q, COST: cost, LATENCY: lat},
            "gates": {"passed": passed, "results": [{"gate": "g", "passed": passed, "reason": "r"}]}}


def test_pareto_front_and_dominance():
    recs = [_rec("a", 1.02, 0.30, 900), _rec("b", 1.05, 0.20, 800), _rec("c", 1.06, 0.25, 700),
            _rec("d", 1.01, 0.50, 1000), _rec("e", 1.10, 0.60, 1200), _rec("f", None, 0.1, 100),
            _rec("g", 1.0, 0.1, 100, status="failed")]
    assert pareto(recs, COST) == ["b", "a", "d"]  # c is beaten by b on both; e by everyone
    assert pareto(recs, LATENCY) == ["c", "b", "a", "d"]
    assert pareto([], COST) == []


def test_recommendation_cheapest_passing_and_reasons():
    recs = [_rec("a", 1.02, 0.30, 900), _rec("b", 1.05, 0.20, 800, passed=False), _rec("c", 1.01, 0.30, 700)]
    r = recommend(recs)
    assert r["id"] == "c" and r["ranked"] == ["c", "a"]  # a tie on cost goes to the better perplexity ratio
    none = recommend([_rec("a", 1.2, 0.3, 9, passed=False), _rec("b", 1.3, 0.2, 9, passed=False)])
    assert none["id"] is None and "no cell passes every gate" in none["reason"] and "a: g: r" in none["reason"]
    assert "no cell finished" in recommend([{"id": "x", "status": "skipped", "reason": "no kernel"}])["reason"]
    unpriced = recommend([_rec("a", 1.0, None, 9)])
    assert unpriced["id"] is None and "cost per successful task" in unpriced["reason"]


def test_the_shipped_study_expands_to_six_cells():
    st = load_study(ROOT / "studies" / "smollm2-tune.yaml")
    assert [c.id for c in st.cells] == ["base", "method=w8a8-smoothquant", "method=w4a16-gptq", "method=fp8",
                                        "engine=prefix-caching", "engine=max-seqs-2"]
    assert not st.invalid and st.eval.price_per_hour == 0.10
    assert {c.recipe.publish.name for c in st.cells} == {"smollm2-135m-tuned"}


def test_costs_within_the_tolerance_are_a_tie_won_by_quality():
    recs = [_rec("fast", 1.04, 0.0537, 900), _rec("good", 1.01, 0.0490, 800), _rec("slow", 1.00, 0.0600, 700)]
    assert recommend(recs)["id"] == "good"  # no tolerance: the cheapest
    r = recommend(recs, tolerance=0.15)  # 0.0600 is 22% above 0.0490: out; 0.0537 is 9.6%: tied
    assert r["id"] == "good" and r["tied"] == ["good", "fast"] and "within 15%" in r["reason"]
    recs[0]["figures"][QUALITY] = 1.005  # now the tied, slightly dearer cell has the better perplexity ratio
    assert recommend(recs, tolerance=0.15)["id"] == "fast"
    assert recommend(recs, tolerance=0.0)["id"] == "good"
