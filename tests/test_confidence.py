"""95% confidence intervals (issue 14, part 3): per-window data from scoring, the bootstrap over windows,
the paired ratio, Wilson task intervals in the metrics table, gates with `confidence`, and report.md.
Real math on synthetic windows; no engine, no model."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from _artifacts import GOOD_METRICS, make_artifact, make_report

from quantkit.evaluate import baseline_cache as BC
from quantkit.evaluate import confidence as C
from quantkit.evaluate import quality as Q
from quantkit.evaluate.check_rules import wilson
from quantkit.evaluate.metrics import metrics_table
from quantkit.evaluate.report import build_report, render_markdown
from quantkit.evaluate.suite import load_suite
from quantkit.gates import evaluate_gate, run_gates
from quantkit.recipe import GateSpec, RecipeError, parse_recipe


# ------------------------------------------------------------------------------------------ helpers
def _lp_windows(n_windows: int, seed: int, per_window: int = 50, shift: float = 0.0) -> list[list[float]]:
    """Per-position log-probs of n windows; windows differ in difficulty (what the bootstrap must see)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_windows):
        level = rng.uniform(2.5, 4.5)  # this window's mean NLL
        out.append([-(level + rng.gauss(0, 1.0)) - shift for _ in range(per_window)])
    return out


def _quality(lps: list[list[float]]) -> dict:
    flat = [x for w in lps for x in w]
    return {"perplexity": Q.perplexity(flat), "tokens": len(flat),
            "windows": {"logprob_sum": [math.fsum(w) for w in lps], "positions": [len(w) for w in lps]}}


def _divergence(kls: list[list[float]], agrees: list[list[int]]) -> dict:
    n = sum(len(w) for w in kls)
    return {"kl_mean": sum(x for w in kls for x in w) / n, "top1_agreement": sum(x for w in agrees for x in w) / n,
            "kl_p99": max(x for w in kls for x in w), "positions": n, "top_k": 20,
            "windows": {"kl_sum": [math.fsum(w) for w in kls], "top1_agree": [sum(w) for w in agrees],
                        "positions": [len(w) for w in kls]}}


def _tasks(rows: dict[str, tuple[int, int]]) -> dict:
    return {"tasks": {t: {"metric": "acc", "value": s / n, "items": n, "successes": s, "extra": {"acc_norm": 0.5}}
                      for t, (s, n) in rows.items()}}


def _sides(n_windows: int = 64, shift: float = 0.02, seed: int = 0) -> tuple[dict, dict]:
    base_lp = _lp_windows(n_windows, seed)
    cand_lp = [[x - shift for x in w] for w in base_lp]
    ones = [[1] * len(w) for w in base_lp]
    base = {"quality": {**_quality(base_lp), "divergence": _divergence([[0.0] * len(w) for w in base_lp], ones)},
            "tasks": _tasks({"qk_cloze": (120, 145), "qk_facts": (150, 175)})}
    rng = random.Random(seed + 1)
    cand_agree = [[int(rng.random() < 0.97) for _ in w] for w in base_lp]
    cand_kl = [[rng.expovariate(1 / 0.01) for _ in w] for w in base_lp]
    cand = {"quality": {**_quality(cand_lp), "divergence": _divergence(cand_kl, cand_agree)},
            "tasks": _tasks({"qk_cloze": (119, 145), "qk_facts": (149, 175)})}
    return base, cand


def _width(iv) -> float:
    return iv[1] - iv[0]


# ---------------------------------------------------------------------------- per-window data
def test_score_texts_and_divergence_record_windows(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("x")

    def tok(text, add_special_tokens=False):
        return {"input_ids": list(range(1, 11))}  # windows of 4: [1..4] [5..8] [9,10]

    def query(ids):  # token t predicted with p = 1 / (t + 1); 99 is the runner-up
        return [None] + [{t: (math.log(1 / (t + 1)), 1), 99: (math.log(0.01), 2)} for t in ids[1:]]

    run = Q.score_texts([f], tok, query, window=4, max_tokens=None)
    assert run.window_positions == [3, 3, 1]
    w = run.window_sums()
    assert w["positions"] == [3, 3, 1]
    assert w["logprob_sum"] == pytest.approx([-math.log(3 * 4 * 5), -math.log(7 * 8 * 9), -math.log(11)])
    assert math.exp(-sum(w["logprob_sum"]) / 7) == pytest.approx(Q.perplexity(run.actual_logprobs()))
    d = Q.divergence(run, run, 2)
    assert d["windows"] == {"kl_sum": [0.0, 0.0, 0.0], "top1_agree": [3, 3, 1], "positions": [3, 3, 1]}
    assert run.window_sums() is not None and Q.QualityRun(actual=[1], positions=[{1: (-1.0, 1)}]).window_sums() is None

    # a baseline-cache entry keeps the layout; an older one (no window_positions) still loads, and the
    # layout can be recomputed from the same files and settings
    back = BC.quality_from_json(json.loads(json.dumps(BC.quality_to_json(run))))
    assert back == run
    old = BC.quality_to_json(run)
    del old["window_positions"]
    legacy = BC.quality_from_json(old)
    assert legacy.window_positions == [] and legacy.window_sums() is None
    assert "windows" in Q.divergence(legacy, run, 2)  # the candidate's layout serves both (same tokens)
    assert "windows" not in Q.divergence(legacy, legacy, 2)
    assert Q.restore_windows(legacy, [f], tok, 4, None) and legacy.window_positions == [3, 3, 1]
    other = BC.quality_from_json(old)
    assert not Q.restore_windows(other, [f], tok, 3, None) and other.window_positions == []  # other layout: refused


# ---------------------------------------------------------------------------------- bootstrap
def test_bootstrap_interval_contains_point_and_narrows_with_more_windows():
    widths = []
    for n in (16, 256):
        side = {"quality": _quality(_lp_windows(n, seed=3))}
        ci = C.intervals(None, side)["quality.perplexity"]
        lo, hi = ci["candidate"]
        assert lo < side["quality"]["perplexity"] < hi
        assert ci["baseline"] is None and ci["ratio"] is None
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2  # about 1/sqrt(16) as wide; at least half as wide


def test_bootstrap_interval_covers_the_true_perplexity_about_95_percent_of_the_time():
    """Coverage on synthetic data whose true perplexity is known. Each trial draws 50 windows of 64-512
    positions; a window's mean NLL is uniform on [2.5, 4.5] (windows differ in difficulty) and its tokens
    add N(0, 1) noise each, so the per-token NLL has mean 3.5 and the true perplexity is exp(3.5). Over
    1000 trials a 95% interval should contain it in about 950. Binomial spread at p = 0.95, n = 1000:
    sd 0.0069, so 3 sd is about 0.021 either side; below, a further 0.02 is allowed for the percentile
    bootstrap's known shortfall at 50 windows (it uses the plug-in variance and normal-like tails:
    measured 0.940 over 8000 trials). A 90% or a 99% interval fails here (0.872 and 0.983 on these trials)."""
    rng = np.random.default_rng(2024)
    truth, trials, n = math.exp(3.5), 1000, 50
    covered = 0
    for _ in range(trials):
        pos = rng.integers(64, 513, size=n)
        nll = pos * rng.uniform(2.5, 4.5, size=n) + np.sqrt(pos) * rng.normal(0.0, 1.0, size=n)
        side = {"quality": {"perplexity": math.exp(nll.sum() / pos.sum()),
                            "windows": {"logprob_sum": (-nll).tolist(), "positions": pos.tolist()}}}
        lo, hi = C.intervals(None, side)["quality.perplexity"]["candidate"]
        covered += lo <= truth <= hi
    assert 0.91 <= covered / trials <= 0.975, covered / trials


def test_paired_ratio_of_identical_sides_is_exactly_one_and_deterministic():
    base, _ = _sides()
    ci = C.intervals(base, json.loads(json.dumps(base)))
    assert ci["quality.perplexity"]["ratio"] == [1.0, 1.0]
    assert ci["quality.top1_agreement"]["ratio"] == [1.0, 1.0]
    assert ci["quality.kl_mean"]["ratio"] is None  # baseline KL is 0: no ratio
    assert ci["quality.perplexity"]["baseline"] == ci["quality.perplexity"]["candidate"]
    b, c = _sides()
    assert metrics_table(b, c, None) == metrics_table(*_sides(), None)  # same input, same intervals


def test_paired_ratio_sees_a_uniform_shift_the_sides_do_not():
    base, cand = _sides(n_windows=32, shift=0.1)  # every position 0.1 nats worse: ratio exactly e^0.1
    ci = C.intervals(base, cand)["quality.perplexity"]
    assert ci["ratio"] == pytest.approx([math.exp(0.1)] * 2, rel=1e-9)
    assert _width(ci["baseline"]) > 1.0 and _width(ci["candidate"]) > 1.0  # each side alone is uncertain
    # different window layouts cannot be paired
    cand["quality"]["windows"]["positions"] = cand["quality"]["windows"]["positions"][::-1][:-1] + [49]
    assert C.intervals(base, cand)["quality.perplexity"]["ratio"] is None


def test_kl_and_agreement_intervals_and_too_few_windows():
    base, cand = _sides(n_windows=40)
    t = metrics_table(base, cand, None)
    for name in ("quality.kl_mean", "quality.top1_agreement"):
        lo, hi = t[name]["ci95"]["candidate"]
        assert lo <= t[name]["candidate"] <= hi and lo < hi
    assert t["quality.kl_mean"]["ci95"]["baseline"] == [0.0, 0.0]
    assert t["quality.top1_agreement"]["ci95"]["baseline"] == [1.0, 1.0]
    assert "ci95" not in t["quality.kl_p99"]
    few_b, few_c = _sides(n_windows=C.MIN_WINDOWS - 1)
    t = metrics_table(few_b, few_c, None)
    assert "ci95" not in t["quality.perplexity"] and "ci95" not in t["quality.kl_mean"]
    assert "ci95" in t["tasks.qk_cloze.acc"]


# ------------------------------------------------------------------------------------- Wilson
def test_task_intervals_are_wilson():
    base, cand = _sides()
    t = metrics_table(base, cand, None)
    assert t["tasks.qk_cloze.acc"]["ci95"] == {"baseline": list(wilson(120, 145)), "candidate": list(wilson(119, 145)),
                                               "ratio": None}
    assert t["tasks.qk_facts.acc"]["ci95"]["candidate"] == list(wilson(149, 175))
    assert t["tasks.success_rate"]["ci95"]["candidate"] == list(wilson(119 + 149, 145 + 175))
    assert "ci95" not in t["tasks.qk_cloze.acc_norm"]  # not a count of successes
    # mean_acc: the Wilson interval at the effective sample size of an unweighted mean of two rates
    p1, p2 = 119 / 145, 149 / 175
    m = (p1 + p2) / 2
    n_eff = m * (1 - m) / ((p1 * (1 - p1) / 145 + p2 * (1 - p2) / 175) / 4)
    assert t["tasks.mean_acc"]["candidate"] == pytest.approx(m)
    assert t["tasks.mean_acc"]["ci95"]["candidate"] == pytest.approx(list(wilson(m * n_eff, n_eff)))
    lo, hi = t["tasks.mean_acc"]["ci95"]["candidate"]
    assert lo < m < hi
    # equal items and rates: the pooled Wilson interval
    same = metrics_table(None, {"tasks": _tasks({"a": (30, 40), "b": (30, 40)})}, None)
    assert same["tasks.mean_acc"]["ci95"]["candidate"] == pytest.approx(list(wilson(60, 80)))
    # a value that is not successes / items gets no interval
    odd = {"tasks": {"tasks": {"a": {"metric": "acc", "value": 0.5, "items": 10, "successes": 9, "extra": {}}}}}
    assert "ci95" not in metrics_table(None, odd, None)["tasks.a.acc"]


# -------------------------------------------------------------------------------------- gates
def gate(metric, op, threshold, relative=False, confidence=0.95):
    return GateSpec(metric=metric, op=op, threshold=threshold, relative=relative, confidence=confidence)


def test_confidence_gate_passes_a_clearly_good_report(tmp_path):
    art = make_artifact(tmp_path / "art")
    base, cand = _sides(n_windows=64, shift=0.02)
    report = make_report(art, metrics_table(base, cand, None))
    gates = [gate("quality.perplexity", "<=", 1.05, True), gate("quality.top1_agreement", ">=", 0.9)]
    gr = run_gates(report, gates)
    assert gr.passed, [r.reason for r in gr.results]
    assert gr.results[0].name == "report complete"  # every verdict's first row
    ppl = gr.results[1]
    assert ppl.interval == pytest.approx([math.exp(0.02)] * 2) and "so does all of the 95% interval" in ppl.reason
    saved = json.loads((report.parent / "gate.json").read_text())
    assert saved["gates"][1]["confidence"] == 0.95 and saved["gates"][1]["interval"] == ppl.interval
    assert saved["gates"][2]["interval"][0] > 0.9


def test_confidence_gate_fails_an_inconclusive_report():
    # per-window degradation that varies a lot: the point ratio passes, the interval does not
    base_lp = _lp_windows(12, seed=7)
    rng = random.Random(11)
    cand_lp = [[x - d for x in w] for w, d in zip(base_lp, [rng.uniform(-0.2, 0.55) for _ in base_lp])]
    m = metrics_table({"quality": _quality(base_lp)}, {"quality": _quality(cand_lp)}, None)
    point = m["quality.perplexity"]["candidate"] / m["quality.perplexity"]["baseline"]
    lo, hi = m["quality.perplexity"]["ci95"]["ratio"]
    assert lo < point < hi and hi > point * 1.02
    threshold = round((point + hi) / 2, 3)
    r = evaluate_gate(gate("quality.perplexity", "<=", threshold, True), m)
    assert not r.passed and r.interval == [lo, hi]
    assert f"point {point:.4g} passes <= {threshold:g} but the 95% interval [{lo:.4g}, {hi:.4g}] does not" in r.reason
    assert "inconclusive" in r.reason and "too small" in r.reason
    assert evaluate_gate(gate("quality.perplexity", "<=", threshold, True, None), m).passed  # the point alone passes
    # >=: the lower bound decides
    acc = metrics_table(None, {"tasks": _tasks({"a": (18, 20)})}, None)
    r = evaluate_gate(gate("tasks.a.acc", ">=", 0.8), acc)
    assert not r.passed and "inconclusive" in r.reason and r.interval == list(wilson(18, 20))
    assert evaluate_gate(gate("tasks.a.acc", ">=", 0.65), acc).passed
    # a point that fails still fails, as before, with the interval shown
    r = evaluate_gate(gate("tasks.a.acc", ">=", 0.95), acc)
    assert not r.passed and "violates >=" in r.reason and "interval" in r.reason


def test_confidence_gate_without_an_interval_fails_and_says_so():
    old = {k: {f: v for f, v in m.items() if f != "ci95"} for k, m in GOOD_METRICS.items()}  # a report before intervals
    r = evaluate_gate(gate("quality.perplexity", "<=", 1.05, True), old)
    assert not r.passed and "no interval for quality.perplexity" in r.reason and r.interval is None
    r = evaluate_gate(gate("speed.c1.tpot_ms_p50", "<=", 0.9, True), GOOD_METRICS)
    assert not r.passed and "no interval" in r.reason
    r = evaluate_gate(gate("quality.perplexity", "<=", 1.01, True), old)  # the point fails: said as before
    assert not r.passed and r.reason == "ratio 1.02 violates <= 1.01"
    # a relative task gate: each side has an interval, the ratio has none; refused, not guessed
    base, cand = _sides()
    r = evaluate_gate(gate("tasks.mean_acc", ">=", 0.9, True), metrics_table(base, cand, None))
    assert not r.passed and "no paired interval of the ratio" in r.reason


def test_old_report_gates_exactly_as_before_without_confidence(tmp_path):
    art = make_artifact(tmp_path / "art", gates=[{"metric": "quality.perplexity", "op": "<=", "threshold": 1.05,
                                                   "relative": True}])
    report = make_report(art)  # GOOD_METRICS: a ci95 on the perplexity only (for the anomaly gate)
    gr = run_gates(report)
    assert gr.passed and gr.source.startswith("recipe (1)")
    r = gr.results[1]  # after "report complete"
    assert (r.value, r.reason, r.confidence, r.interval) == (pytest.approx(1.02), "ratio 1.02 <= 1.05", None, None)
    # the same gate on a report with intervals: without `confidence` they change nothing
    base, cand = _sides(n_windows=12, shift=0.3)
    m = metrics_table(base, cand, None)
    plain = evaluate_gate(gate("quality.perplexity", "<=", 1.4, True, None), m)
    stripped = {k: {f: v for f, v in x.items() if f != "ci95"} for k, x in m.items()}
    assert plain == evaluate_gate(gate("quality.perplexity", "<=", 1.4, True, None), stripped)


def test_confidence_field_validation_and_recipe_hash_stability():
    data = {"name": "r", "model": {"path": "org/m"}, "stages": [{"method": "rtn", "scheme": "W8A8"}],
            "gates": [{"metric": "quality.perplexity", "op": "<=", "threshold": 1.05, "relative": True,
                       "confidence": 0.9}]}
    with pytest.raises(RecipeError, match=r"gates\[0\]\.confidence: .*0\.9 is not supported.*confidence: 0\.95"):
        parse_recipe(data, "r.yaml")
    data["gates"][0]["confidence"] = True
    with pytest.raises(RecipeError, match=r"gates\[0\]\.confidence"):
        parse_recipe(data, "r.yaml")
    data["gates"][0]["confidence"] = 0.95
    assert parse_recipe(data, "r.yaml").gates[0].confidence == 0.95
    del data["gates"][0]["confidence"]
    r = parse_recipe(data, "r.yaml")
    assert "confidence" not in r.model_dump(mode="json")["gates"][0]  # dumps (and hashes) as before the field


# ------------------------------------------------------------------------------------- report.md
def test_report_md_renders_intervals():
    base, cand = _sides(n_windows=32, shift=0.05)
    context = {"artifact": {"path": "/a", "name": "art", "quantization": {"stages": [{"method": "rtn", "scheme": "W8A8"}]}},
               "baseline": {"path": "/b", "url": None}, "suite": load_suite("smoke").model_dump(mode="json"),
               "hardware": {"cpu": "test cpu", "cpu_count": 2, "memory_bytes": 2**30}, "wall_s": 1.0,
               "workload_items": []}
    rep = build_report(context, base, cand, [])
    md = render_markdown(rep)
    m = rep["metrics"]["quality.perplexity"]
    blo, bhi = m["ci95"]["baseline"]
    assert f"| quality.perplexity (engine) ↓ | {m['baseline']:.2f} [{blo:.2f}, {bhi:.2f}] |" in md
    assert f"ratio [{math.exp(0.05):.3f}, {math.exp(0.05):.3f}]" in md
    lo, hi = wilson(119, 145)
    assert f"| qk_cloze.acc | {120 / 145:.3f} [" in md and f"{119 / 145:.3f} [{lo:.3f}, {hi:.3f}]" in md
    assert "percentile bootstrap over the scored windows" in md and "Wilson" in md
    # an old report's metrics (no ci95) render as before, without the explanation
    for x in rep["metrics"].values():
        x.pop("ci95", None)
    old = render_markdown(rep)
    assert "bootstrap" not in old and f"| quality.perplexity (engine) ↓ | {m['baseline']:.2f} | " in old


def test_reused_baseline_from_an_older_cache_entry_gets_its_windows(tmp_path):
    from quantkit.evaluate.probes import Side as _Side
    from quantkit.evaluate.run import _restore_cached_windows
    from quantkit.recipe import EvalSpec

    f = tmp_path / "t.txt"
    f.write_text("x")

    def tok(text, add_special_tokens=False):
        return {"input_ids": list(range(1, 41))}  # windows of 16: 15 + 15 + 7 scored positions

    def query(ids):
        return [None] + [{t: (-0.01 * t, 1), 99: (-5.0, 2)} for t in ids[1:]]

    spec = EvalSpec(perplexity_window=16, perplexity_max_tokens=None, logprobs_top_k=2)
    run = Q.score_texts([f], tok, query, spec.perplexity_window, spec.perplexity_max_tokens)
    old = BC.quality_to_json(run)
    del old["window_positions"]  # an entry written before windows were recorded
    side = _Side("baseline", None, None)
    side.quality = BC.quality_from_json(old)
    side.data["quality"] = {"perplexity": Q.perplexity(run.actual_logprobs()),
                            "divergence": {k: v for k, v in Q.divergence(run, run, 2).items() if k != "windows"}}
    _restore_cached_windows(side, spec, [f], tok)
    assert side.quality.window_positions == [15, 15, 7]
    assert side.data["quality"]["windows"] == run.window_sums()
    assert side.data["quality"]["divergence"] == Q.divergence(run, run, 2)
    # a side whose quality failed is left alone
    failed = _Side("baseline", None, None)
    failed.quality, failed.data["quality"] = BC.quality_from_json(old), {"error": "x"}
    _restore_cached_windows(failed, spec, [f], tok)
    assert "windows" not in failed.data["quality"]


def test_eval_quality_phase_feeds_the_intervals(tmp_path, monkeypatch):
    """The quality probe (engine answers faked): both sides' window data reach the metrics table."""
    import quantkit.evaluate.probes.quality as P
    from quantkit.evaluate.probes import QUALITY, RunContext, Served, Side
    from quantkit.recipe import EvalSpec

    f = tmp_path / "t.txt"
    f.write_text("x")
    rng = random.Random(0)
    ids = [rng.randrange(1, 50) for _ in range(16 * 12)]

    def tok(text, add_special_tokens=False):
        return {"input_ids": list(ids)}

    def fake_logprobs(shift):
        def answer(client, base_url, model, token_ids, k):
            out = [None]
            for i, t in enumerate(token_ids[1:], 1):
                p = 0.2 + 0.6 * ((t * 7 + i) % 10) / 10  # varies by position: windows differ
                out.append({t: (math.log(p) - shift, 1), 99: (math.log((1 - p) / 2), 2)})
            return out
        return answer

    class Ep:
        base_url, model = "http://unused", "m"

    spec = EvalSpec(perplexity_files=[str(f)], perplexity_window=16, perplexity_max_tokens=None, logprobs_top_k=2)
    sides = {}
    ctx = RunContext(spec, tmp_path, tok, None, progress=lambda m: None)
    for role, shift in (("baseline", 0.0), ("candidate", 0.05)):
        monkeypatch.setattr(P, "prompt_logprobs", fake_logprobs(shift))
        side = Side(role, None, None)
        side.data["quality"] = QUALITY.run(ctx, side, Served(Ep(), None)).figures
        ctx.baseline = side if role == "baseline" else ctx.baseline
        sides[role] = side.data
    q = sides["candidate"]["quality"]
    assert q["windows"]["positions"] == [15] * 12 and len(q["divergence"]["windows"]["kl_sum"]) == 12
    t = metrics_table(sides["baseline"], sides["candidate"], None)
    assert t["quality.perplexity"]["ci95"]["ratio"] == pytest.approx([math.exp(0.05)] * 2)
    for name in ("quality.perplexity", "quality.kl_mean", "quality.top1_agreement"):
        lo, hi = t[name]["ci95"]["candidate"]
        assert lo <= t[name]["candidate"] <= hi, name
