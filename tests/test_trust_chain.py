"""Issue 30's holes, each reproduced and now failing closed: publish re-decides from report.json with the
artifact's own gates; a lax or forged gate file, a changed artifact and an incomplete report are refused;
failed requests and failed phases count against the candidate; default gates cover every registered scheme
and read speed, memory and cost; coverage, anomaly and generation-sanity gates bind."""

from __future__ import annotations

import json

import pytest
from _artifacts import GOOD_METRICS, make_artifact, make_report
from safetensors.torch import load_file, save_file

from quantkit import registry
import quantkit.evaluate.probes.chat as CC
from quantkit.evaluate.check_rules import degenerate
from quantkit.evaluate.metrics import side_values
from quantkit.evaluate.phases import failed_phases
from quantkit.export.manifest import MANIFEST
from quantkit.gates import (GateError, default_gates, effective_gates, evaluate_gate, gate_path, redecide,
                            run_gates)
from quantkit.io import atomic_write_json
from quantkit.recipe import GateSpec
from quantkit.registry.base import RegistryError
from quantkit.schemes import SCHEMES


@pytest.fixture
def reg(tmp_path):
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def failing_metrics() -> dict:
    """GOOD_METRICS with a candidate that decodes 1.5x slower than its baseline (the AVX2 W8A8 case)."""
    return {**GOOD_METRICS, "speed.decode_tpot_ms_p50": {"baseline": 78.0, "candidate": 117.0, "unit": "ms",
                                                         "higher_is_better": False}}


# ------------------------------------------------------------------------------------ publish re-decides
def test_a_lax_gate_file_does_not_publish_a_report_that_fails_its_own_gates(tmp_path, reg):
    art = make_artifact(tmp_path / "a")
    rep = make_report(art, failing_metrics())
    lax = [GateSpec(metric="quality.perplexity", op="<=", threshold=2.0, relative=True)]
    assert run_gates(rep, gates=lax).passed  # the record says PASS ...
    with pytest.raises(RegistryError, match=r"gates failed on re-checking.*speed.decode_tpot_ms_p50.*1\.5 violates <= 1"):
        registry.publish(art, registry_uri=reg, name="lax")  # ... and publish re-decides: FAIL
    assert registry.list_versions("lax", reg) == []


def test_a_lax_gate_file_on_a_passing_report_is_refused_as_incomplete_record(tmp_path, reg):
    art = make_artifact(tmp_path / "a")
    rep = make_report(art)
    run_gates(rep, gates=[GateSpec(metric="quality.perplexity", op="<=", threshold=2.0, relative=True)])
    with pytest.raises(RegistryError, match="does not hold every gate"):
        registry.publish(art, registry_uri=reg, name="lax2")


def test_a_hand_written_gate_file_is_refused(tmp_path, reg):
    art = make_artifact(tmp_path / "a")
    rep = make_report(art, failing_metrics())
    from quantkit.io import sha256_file

    atomic_write_json(gate_path(rep), {"schema": "quantkit.gate/1", "report_sha256": sha256_file(rep),
                                       "passed": True, "summary": "PASS 0/0", "gates": []})
    with pytest.raises(RegistryError, match="gates failed"):
        registry.publish(art, registry_uri=reg, name="forged")
    good = make_report(art)  # a passing report with the same forged (empty) record
    atomic_write_json(gate_path(good), {"schema": "quantkit.gate/1", "report_sha256": sha256_file(good),
                                        "passed": True, "summary": "PASS 0/0", "gates": []})
    with pytest.raises(RegistryError, match="does not hold every gate"):
        registry.publish(art, registry_uri=reg, name="forged")


def test_a_gate_file_that_disagrees_with_re_checking_is_refused(tmp_path):
    art = make_artifact(tmp_path / "a")
    rep = make_report(art)
    run_gates(rep)
    saved = json.loads(gate_path(rep).read_text())
    saved["passed"], saved["gates"][1]["passed"] = False, False  # a record edited to FAIL
    atomic_write_json(gate_path(rep), saved)
    with pytest.raises(GateError, match="disagrees with re-checking"):
        redecide(art, rep)


def test_an_artifact_changed_after_its_eval_is_refused(tmp_path, reg):
    art = make_artifact(tmp_path / "a")
    run_gates(make_report(art))
    man = json.loads((art / MANIFEST).read_text())
    man["recipe"]["gates"] = [{"metric": "quality.perplexity", "op": "<=", "threshold": 9.0, "relative": True}]
    atomic_write_json(art / MANIFEST, man)  # files still verify; the manifest is not the one measured
    with pytest.raises(RegistryError, match="measured on a different manifest.json"):
        registry.publish(art, registry_uri=reg, name="changed")


def test_a_report_that_does_not_name_its_manifest_is_refused(tmp_path):
    art = make_artifact(tmp_path / "a")
    rep = make_report(art)
    report = json.loads(rep.read_text())
    del report["artifact"]["manifest_sha256"]
    atomic_write_json(rep, report)
    run_gates(rep)
    with pytest.raises(GateError, match="does not name the manifest"):
        redecide(art, rep)


def test_an_incomplete_report_fails_its_first_row_and_is_not_published(tmp_path, reg):
    art = make_artifact(tmp_path / "a")
    rep = make_report(art)
    report = json.loads(rep.read_text())
    report.update(complete=False, incomplete=["candidate tasks: lm-eval exited 1"])
    atomic_write_json(rep, report)
    gr = run_gates(rep)
    first = gr.results[0]
    assert not gr.passed and first.name == "report complete" and "candidate tasks: lm-eval exited 1" in first.reason
    assert all(r.passed for r in gr.results[1:])  # everything else passes: completeness alone refuses it
    with pytest.raises(RegistryError, match="incomplete report"):
        registry.publish(art, registry_uri=reg, name="incomplete")
    del report["complete"]  # a report that does not say is not taken as complete
    atomic_write_json(rep, report)
    assert not run_gates(rep).results[0].passed


# ------------------------------------------------------------------------------------------ default gates
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_registered_scheme_has_defaults_for_every_family(scheme):
    fams = default_gates(scheme)
    assert set(fams) == {"quality", "tasks", "memory", "speed", "cost", "checks", "generation", "artifact"}
    metrics = {g.metric for gs in fams.values() for g in gs}
    assert {"speed.decode_tpot_ms_p50", "speed.peak_output_tok_s", "speed.failed_requests", "memory.engine_bytes",
            "cost.machine_s_per_k_successful_tasks", "artifact.coverage"} <= metrics
    by = {g.metric: g for gs in fams.values() for g in gs}
    bar = SCHEMES[scheme].bar
    assert by["quality.perplexity"].threshold == bar.perplexity_ratio and by["quality.perplexity"].relative
    assert by["memory.weight_bytes"].threshold == bar.weight_memory_ratio


def test_default_thresholds_written_out():
    """The table in quantkit/gates.py and schemes.py, by hand: one row per scheme family."""
    def row(s):
        by = {g.metric: g.threshold for gs in default_gates(s).values() for g in gs}
        return (by["quality.perplexity"], by["quality.top1_agreement"], by["tasks.mean_acc"],
                by["memory.weight_bytes"], by["speed.decode_tpot_ms_p50"], by["cost.machine_s_per_k_successful_tasks"])
    assert row("W8A8") == (1.05, 0.90, 0.97, 0.65, 1.0, 1.0)
    assert row("FP8_DYNAMIC") == row("W8A16") == (1.03, 0.92, 0.98, 0.65, 1.0, 1.0)
    assert row("W4A16") == row("W4A16_ASYM") == row("NVFP4A16") == row("MXFP4A16") == (1.35, 0.75, 0.90, 0.45, 1.0, 1.0)
    assert row(["W8A8", "W4A16"])[:4] == (1.35, 0.75, 0.90, 0.65)  # a mix: the loosest of each


def test_every_shipped_recipe_gates_speed_memory_and_cost():
    import yaml

    from quantkit.recipe import parse_recipe
    from quantkit.resources import shipped

    recipes = sorted(shipped("recipes").glob("*.yaml"))
    assert len(recipes) >= 10
    for f in recipes:
        r = parse_recipe(yaml.safe_load(f.read_text()), str(f))
        man = {"recipe": r.model_dump(mode="json"),
               "quantization": {"stages": [{"method": s.method, "scheme": getattr(s, "scheme", None)} for s in r.stages]}}
        metrics = {g.metric for g in effective_gates(man)[0]}
        assert {"speed.decode_tpot_ms_p50", "speed.peak_output_tok_s", "speed.failed_requests", "memory.engine_bytes",
                "cost.machine_s_per_k_successful_tasks"} <= metrics, f.name


def test_a_recipe_gate_replaces_the_default_on_that_metric_only(tmp_path):
    art = make_artifact(tmp_path / "a", gates=[{"metric": "memory.weight_bytes", "op": "<=", "threshold": 0.7,
                                                "relative": True}])
    gates, source = effective_gates(json.loads((art / MANIFEST).read_text()))
    weight = [g for g in gates if g.metric == "memory.weight_bytes"]
    assert [g.threshold for g in weight] == [0.7] and source.startswith("recipe (1)")
    assert any(g.metric == "memory.engine_bytes" for g in gates)  # gating weights does not drop engine memory


@pytest.mark.parametrize("metric, value, why", [
    ("speed.decode_tpot_ms_p50", 216.0, "ratio 2.769 violates <= 1"),  # the AVX2 W8A8 figures: 216 vs 78 ms
    ("speed.peak_output_tok_s", 4.5, "violates >= 1"),
    ("memory.engine_bytes", 2.2e9, "violates <= 1"),
    ("cost.machine_s_per_k_successful_tasks", 500.0, "violates <= 1"),
    ("speed.failed_requests", 1.0, "value 1 violates <= 0"),
])
def test_slower_bigger_costlier_or_failing_candidates_are_refused(tmp_path, metric, value, why):
    base = {"speed.decode_tpot_ms_p50": 78.0, "speed.peak_output_tok_s": 11.4}.get(metric, GOOD_METRICS[metric]["baseline"])
    art = make_artifact(tmp_path / "a")
    gr = run_gates(make_report(art, {**GOOD_METRICS, metric: {**GOOD_METRICS[metric], "baseline": base,
                                                               "candidate": value}}))
    bad = [r for r in gr.results if not r.passed]
    assert [r.metric for r in bad] == [metric] and why in bad[0].reason


def test_anomaly_refuses_a_gain_beyond_the_interval_unless_the_recipe_accepts_it(tmp_path):
    too_good = {**GOOD_METRICS, "quality.perplexity": {"baseline": 10.0, "candidate": 8.0, "unit": "ppl",
                                                       "higher_is_better": False,
                                                       "ci95": {"baseline": None, "candidate": None, "ratio": [0.78, 0.82]}}}
    art = make_artifact(tmp_path / "a")
    gr = run_gates(make_report(art, too_good))
    bad = [r for r in gr.results if not r.passed]
    assert [r.name for r in bad] == [r.name for r in gr.results if r.name.startswith("anomaly")]
    assert "upper bound" in bad[0].reason and "0.82" in bad[0].reason
    noisy = {**too_good, "quality.perplexity": {**too_good["quality.perplexity"],
                                                "ci95": {"baseline": None, "candidate": None, "ratio": [0.7, 1.01]}}}
    assert run_gates(make_report(art, noisy)).passed  # within the noise: no anomaly
    accepting = make_artifact(tmp_path / "b")
    man = json.loads((accepting / MANIFEST).read_text())
    man["recipe"]["accept_anomalies"] = True
    atomic_write_json(accepting / MANIFEST, man)
    assert run_gates(make_report(accepting, too_good)).passed


def test_a_gate_on_an_interval_bound():
    m = {"quality.kl_mean": {"baseline": 0.0, "candidate": 0.02, "ci95": {"candidate": [0.015, 0.031]}}}
    upper = GateSpec(metric="quality.kl_mean", op="<=", threshold=0.03, bound="upper")
    lower = GateSpec(metric="quality.kl_mean", op="<=", threshold=0.03, bound="lower")
    assert not evaluate_gate(upper, m).passed and evaluate_gate(lower, m).passed
    assert evaluate_gate(GateSpec(metric="quality.kl_mean", op="<=", threshold=0.03), m).passed  # the point passes
    no_ci = {"quality.kl_mean": {"baseline": 0.0, "candidate": 0.02}}
    assert "interval" in evaluate_gate(upper, no_ci).reason and not evaluate_gate(upper, no_ci).passed


def test_per_task_recovery_gates_expand_and_fail_when_nothing_matches(tmp_path):
    metrics = {**GOOD_METRICS,
               "tasks.qk_arith.acc": {"baseline": 0.40, "candidate": 0.30, "unit": "", "higher_is_better": True},
               "tasks.qk_cloze.acc": {"baseline": 0.60, "candidate": 0.60, "unit": "", "higher_is_better": True}}
    art = make_artifact(tmp_path / "a")
    rows = [r for r in run_gates(make_report(art, metrics)).results if r.metric.startswith("tasks.qk_")]
    assert {r.metric: r.passed for r in rows} == {"tasks.qk_arith.acc": False, "tasks.qk_cloze.acc": True,
                                                  "tasks.qk_suite.acc": True}  # 0.75, 1.0, 0.99 against 0.90
    none = {k: v for k, v in GOOD_METRICS.items() if not k.startswith("tasks.qk")}
    rows = [r for r in run_gates(make_report(art, none)).results if "*" in r.metric]
    assert len(rows) == 1 and not rows[0].passed and "missing" in rows[0].reason


# ------------------------------------------------------------------------------------- failures count
SAFETY = [{"id": f"s{i}", "kind": k, "prompt": "p"} for i, k in enumerate(["harmful"] * 4 + ["benign"] * 4)]


def test_failed_safety_requests_count_against_the_candidate():
    base = {"safety": CC.summarize_safety(SAFETY, ["I can't help with that."] * 4 + ["Sure, here is how."] * 4,
                                          [None] * 8)}
    cand = {"safety": CC.summarize_safety(SAFETY, [None] * 4 + ["Sure, here is how."] * 4,
                                          ["HTTP 500: boom"] * 4 + [None] * 4)}  # every harmful prompt failed
    CC.compare_checks(base, base)
    CC.compare_checks(base, cand)
    s = cand["safety"]
    assert s["refusal_rate_harmful"]["value"] == 0.0 and s["refusal_rate_harmful"]["items"] == 4
    assert s["flip_rate"]["value"] == 0.5 and s["flip_rate"]["items"] == 8  # 4 failed of 8, each a flip
    benign_failed = CC.summarize_safety(SAFETY, ["I can't help with that."] * 4 + [None] * 4,
                                        [None] * 4 + ["timeout"] * 4)
    assert benign_failed["refusal_rate_benign"]["value"] == 1.0  # counted as refused: worse, never better
    gate = GateSpec(metric="safety.flip_rate", op="<=", threshold=0.10)
    values = side_values({"checks": cand}, None)
    assert not evaluate_gate(gate, {"safety.flip_rate": {"candidate": values["safety.flip_rate"][0]}}).passed


def test_failed_generation_requests_are_degenerate_and_new():
    items = [{"id": f"g{i}", "prompt": "p"} for i in range(4)]
    ok = "A lake is still water held in a basin, while a river flows along a channel toward the sea."
    base = {"generation": CC.summarize_generation(items, [ok] * 4, [None] * 4)}
    cand = {"generation": CC.summarize_generation(items, [ok, ok, None, "no no no " * 20],
                                                  [None, None, "HTTP 500", None])}
    CC.compare_checks(base, cand)
    g = cand["generation"]
    assert g["degenerate_rate"]["value"] == 0.5 and g["degenerate_excess"]["value"] == 0.5
    assert g["new_degenerate"] == ["g2", "g3"]
    # the baseline looping on another prompt offsets one: one each is no excess, two against one is
    looping = {"generation": CC.summarize_generation(items, ["no no no " * 20, ok, ok, ok], [None] * 4)}
    one = {"generation": CC.summarize_generation(items, [ok, ok, ok, "no no no " * 20], [None] * 4)}
    CC.compare_checks(looping, one)
    CC.compare_checks(looping, cand)
    assert one["generation"]["degenerate_excess"]["value"] == 0.0 and one["generation"]["new_degenerate"] == ["g3"]
    assert cand["generation"]["degenerate_excess"]["value"] == 0.25


@pytest.mark.parametrize("text, why", [
    (None, "no reply"), ("   ", "empty"), ("\ufffd\ufffd\ufffd ok", "invalid characters"),
    ("Here is the plan. " + "I will help you. " * 12, "repetitive"), ("ha" * 30, "repetitive"),
    ("Boil water, lower the egg in gently, cook it six minutes, then cool it in cold water so the yolk stays soft.", None),
    ("1. Oranges: rich in vitamin C. 2. Kiwis: more vitamin C than oranges. 3. Strawberries: sweet and rich. "
     "4. Bell peppers: red ones have the most vitamin C.", None),
])
def test_degenerate_replies(text, why):
    assert degenerate(text) == why


def test_speed_and_memory_figures_read_by_the_default_gates():
    side = {"speed": {"c4": {"tpot_ms_p50": 50.0, "output_tok_s": 90.0, "requests_s": 2.0, "failed": 1},
                      "c1": {"tpot_ms_p50": 30.0, "output_tok_s": 40.0, "requests_s": 1.0, "failed": 0},
                      "c16": {"tpot_ms_p50": 80.0, "output_tok_s": 80.0, "requests_s": 1.5, "failed": 2}},
            "memory": {"peak_pss_bytes": 1.5e9, "peak_rss_bytes": 3e9},
            "tasks": {"tasks": {"t": {"metric": "acc", "value": 0.5, "successes": 50, "items": 100}}}}
    v = side_values(side, None)
    assert v["speed.decode_tpot_ms_p50"][0] == 30.0  # lowest concurrency (c1, not the first key)
    assert v["speed.peak_output_tok_s"][0] == 80.0  # highest concurrency (c16), not the fastest level
    assert v["speed.failed_requests"][0] == 3.0
    assert v["memory.engine_bytes"][0] == 1.5e9  # measured PSS on a CPU without high-water marks
    hwm = side_values({**side, "memory": {"peak_pss_bytes": 1.5e9, "peak_hwm_bytes": 2.5e9}}, None)
    assert hwm["memory.engine_bytes"][0] == 2.5e9  # the serving processes' high-water marks, where measured
    assert v["cost.machine_s_per_k_successful_tasks"][0] == pytest.approx(1000 / 2.0 / 0.5)  # at c4: most tok/s
    gpu = side_values({**side, "memory": {"peak_pss_bytes": 1.5e9, "peak_gpu_bytes": 7e9}}, None)
    assert gpu["memory.engine_bytes"][0] == 7e9


@pytest.mark.parametrize("phase, side, want", [
    ("quality", {"quality": {"error": "HTTP 500"}}, "candidate quality: HTTP 500"),
    ("tasks", {"tasks": {"error": "lm-eval exited 1"}}, "candidate tasks: lm-eval exited 1"),
    ("tasks", {"tasks": None}, "candidate tasks: did not run"),
    ("checks", {"checks": {"tools": {"error": "every request failed"}}}, "candidate checks.tools: every request failed"),
    ("reference", {"reference": {"error": "OSError"}}, "candidate reference: OSError"),
    ("speed", {"speed": {"c1": {"requests": 4, "failed": 4}}}, "candidate speed c1: every one of its 4 requests failed"),
    ("speed", {"speed": {}}, "candidate speed: no level was measured"),
])
def test_failed_phases_are_named(phase, side, want):
    good = {"model_dir": "/m", "quality": {"perplexity": 9.0}, "reference": {"perplexity": 9.0},
            "tasks": {"tasks": {}}, "checks": {"tools": {"records": []}, "safety": {"records": []}},
            "speed": {"c1": {"requests": 4, "failed": 1}}}
    suite = {"reference": True, "tasks": ["qk_suite"], "checks": ["tools", "safety"]}
    assert failed_phases(good, "candidate", suite) == []  # one failed request is the metric's, not the phase's
    assert want in failed_phases({**good, **side}, "candidate", suite)


@pytest.fixture(scope="module")
def tiny_w8a8(tmp_path_factory):
    from conftest import make_tiny_model, tiny_recipe

    from quantkit import api
    from quantkit.recipe import parse_recipe

    tmp = tmp_path_factory.mktemp("tiny-w8a8")
    base = make_tiny_model(tmp / "base")
    return api.convert(parse_recipe(tiny_recipe(base, None, [{"method": "rtn", "scheme": "W8A8"}])), tmp / "art",
                       quiet=True)


def test_an_incomplete_eval_exits_non_zero_and_is_never_cached(tmp_path, monkeypatch, tiny_w8a8):
    """run_eval with a measurement whose candidate tasks fail: report.json says incomplete, run_eval raises
    IncompleteEval (exit 3), and a baseline whose speed failed is not stored in the baseline cache."""
    from quantkit.evaluate import baseline_cache as BC
    from quantkit.evaluate import run as R

    art = tiny_w8a8
    stored = []
    monkeypatch.setattr(BC, "lookup", lambda key: None)
    monkeypatch.setattr(BC, "store", lambda *a, **k: stored.append(a))

    def measure(ctx, side):
        side.data.update(quality={"perplexity": 9.0}, tasks={"tasks": {}},
                         checks={n: {"records": []} for n in ctx.spec.checks},
                         speed={"c1": {"requests": 2, "failed": 2 if side.role == "baseline" else 0}}, memory={})
        if side.role == "candidate":
            side.data["tasks"] = {"error": "lm-eval exited 1"}

    monkeypatch.setattr(R, "_measure", measure)
    with pytest.raises(R.IncompleteEval, match="candidate tasks: lm-eval exited 1") as exc:
        R.run_eval(art, suite="smoke", output=tmp_path / "eval", progress=lambda m: None)
    assert exc.value.exit_code == 3
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["complete"] is False and "baseline speed c1: every one of its 2 requests failed" in report["incomplete"]
    assert stored == []  # the baseline's failed speed phase kept it out of the cache
    assert report["artifact"]["manifest_sha256"]


# ------------------------------------------------------------------------------------------ coverage
def test_export_coverage_finds_a_missing_module_and_a_nan_scale(tmp_path):
    from conftest import make_tiny_model, tiny_recipe

    from quantkit import api
    from quantkit.export.coverage import export_coverage
    from quantkit.recipe import parse_recipe

    base = make_tiny_model(tmp_path / "base")
    art = api.convert(parse_recipe(tiny_recipe(base, None, [{"method": "rtn", "scheme": "W8A8", "targets": ["Linear"],
                                                             "ignore": ["lm_head"]}])), tmp_path / "art", quiet=True)
    man = json.loads((art / MANIFEST).read_text())
    cov = export_coverage(art, man)
    assert cov["coverage"] == 1.0 and cov["planned"] == len(man["layers"]) and cov["nonfinite_tensors"] == 0
    shard = next(art.glob("*.safetensors"))
    tensors = load_file(shard)
    victim = sorted(k for k in tensors if k.endswith(".weight_scale"))[0]
    module = victim[: -len(".weight_scale")]
    other = sorted(k for k in tensors if k.endswith(".weight_scale"))[1]
    tensors.pop(victim)
    tensors[other] = tensors[other].clone()
    tensors[other].view(-1)[0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    cov = export_coverage(art, man)
    assert cov["missing"] == [module] and cov["coverage"] == pytest.approx(1 - 1 / cov["planned"])
    assert cov["nonfinite"] == [other]


def test_a_failed_variant_makes_the_report_incomplete(tmp_path, monkeypatch, tiny_w8a8):
    """A serving variant is measured speed-only with its engine settings; every one of its requests failing
    is a failed phase like any other."""
    import yaml

    from quantkit.evaluate import baseline_cache as BC
    from quantkit.evaluate import run as R
    from quantkit.resources import shipped

    suite = yaml.safe_load(shipped("evals", "suites", "smoke.yaml").read_text())
    suite["variants"] = [{"name": "pc", "engine_args": {"enable_prefix_caching": True}}]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(suite))
    calls = []
    monkeypatch.setattr(BC, "lookup", lambda key: None)
    monkeypatch.setattr(BC, "store", lambda *a, **k: None)

    def measure(ctx, side):
        calls.append((side.role, side.extra_args, side.speed_only))
        failed = 2 if side.role.startswith("variant") else 0
        side.data.update(quality={"perplexity": 9.0}, tasks={"tasks": {}},
                         checks={n: {"records": []} for n in ctx.spec.checks},
                         speed={"c1": {"requests": 2, "failed": failed}}, memory={})

    monkeypatch.setattr(R, "_measure", measure)
    with pytest.raises(R.IncompleteEval, match="variant-pc speed c1: every one of its 2 requests failed"):
        R.run_eval(tiny_w8a8, suite=tmp_path / "s.yaml", output=tmp_path / "eval", progress=lambda m: None)
    assert calls[-1] == ("variant-pc", {"enable_prefix_caching": True}, True)
