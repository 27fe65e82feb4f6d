"""Run tracking (quantkit/tracking.py): runs open before work, end with the right status, log what the files say,
and link convert -> eval -> gate -> registry version by content hash. An embedded sqlite store per test."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import click
import pytest

from quantkit import tracking
from quantkit.cli.common import tracked

from _artifacts import GOOD_METRICS, make_artifact, make_report


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'track' / 'mlflow.db'}"
    monkeypatch.setenv("QUANTKIT_TRACKING_URI", uri)
    monkeypatch.delenv("QUANTKIT_NO_TRACK", raising=False)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _ctx(track=None):
    ctx = click.Context(click.Command("quantkit"))
    ctx.obj = {"track": track}
    return ctx


def test_a_closed_server_fails_fast_naming_the_uri_and_the_fix(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("QUANTKIT_TRACKING_URI", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(tracking.TrackingError) as err:
        tracking.open_run("convert", "tiny", "x")
    assert time.monotonic() - t0 < 30  # MLflow's default retries would take minutes
    msg = str(err.value)
    assert f"127.0.0.1:{port}" in msg and "--no-track" in msg and err.value.exit_code == 3


def test_an_unknown_uri_scheme_is_refused(monkeypatch):
    monkeypatch.setenv("QUANTKIT_TRACKING_URI", "ftp://nowhere")
    with pytest.raises(tracking.TrackingError, match="QUANTKIT_TRACKING_URI='ftp://nowhere'"):
        tracking.open_run("eval", "tiny", "x")


def test_no_track_opens_nothing(store, monkeypatch):
    with tracked(_ctx(track=False), "convert", "tiny", "off") as run:
        assert run is None
    monkeypatch.setenv("QUANTKIT_NO_TRACK", "1")
    with tracked(_ctx(), "convert", "tiny", "off") as run:
        assert run is None
    assert store.get_experiment_by_name("quantkit/tiny") is None


def test_without_mlflow_the_default_store_is_skipped_but_an_asked_for_store_fails(tmp_path, monkeypatch, capsys):
    """A GPU image or slim install has no MLflow: the default store is skipped with a notice (the work goes on),
    while a store the user named must not be skipped silently."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    monkeypatch.delenv("QUANTKIT_NO_TRACK", raising=False)
    monkeypatch.delenv("QUANTKIT_TRACKING_URI", raising=False)
    with tracked(_ctx(), "convert", "tiny", "x") as run:
        assert run is None
    assert "MLflow is not installed" in capsys.readouterr().err
    monkeypatch.setenv("QUANTKIT_TRACKING_URI", f"sqlite:///{tmp_path / 'm.db'}")
    assert tracking.unavailable() is None


def _only_run(store, model="tiny"):
    exp = store.get_experiment_by_name(f"quantkit/{model}")
    runs = store.search_runs([exp.experiment_id])
    assert len(runs) == 1
    return runs[0]


def test_an_internal_error_ends_the_run_failed_with_its_crash_log(store):
    with pytest.raises(ZeroDivisionError) as err:
        with tracked(_ctx(), "convert", "tiny", "boom"):
            1 / 0  # noqa: B018
    run = _only_run(store)
    assert run.info.status == "FAILED"
    assert "ZeroDivisionError" in run.data.tags["quantkit.error"]
    log = Path(run.data.tags["quantkit.crash_log"])
    assert log.is_file() and "ZeroDivisionError" in log.read_text()
    assert err.value.quantkit_crash_log == log  # the boundary names this file rather than writing another


def test_an_expected_error_ends_failed_with_its_line_and_no_crash_log(store):
    from quantkit.recipe import RecipeError

    with pytest.raises(RecipeError):
        with tracked(_ctx(), "convert", "tiny", "bad"):
            raise RecipeError("r.yaml: stages[0].scheme: 'W3' is not a scheme")
    run = _only_run(store)
    assert run.info.status == "FAILED" and "stages[0].scheme" in run.data.tags["quantkit.error"]
    assert "quantkit.crash_log" not in run.data.tags


def test_an_interrupt_ends_killed_and_a_failing_gate_ends_finished(store):
    with pytest.raises(KeyboardInterrupt):
        with tracked(_ctx(), "eval", "tiny", "stopped"):
            raise KeyboardInterrupt
    import typer

    with pytest.raises(typer.Exit):
        with tracked(_ctx(), "gate", "tiny", "failing gate"):
            raise typer.Exit(1)  # a verdict that fails is a gate run that did its work
    exp = store.get_experiment_by_name("quantkit/tiny")
    status = {r.info.run_name: r.info.status for r in store.search_runs([exp.experiment_id])}
    assert status == {"stopped": "KILLED", "failing gate": "FINISHED"}


def test_eval_and_gate_runs_log_the_files_and_link_by_hash(store, tmp_path):
    art = make_artifact(tmp_path / "art")
    with tracked(_ctx(), "convert", "tiny", "convert") as conv:
        tracking.log_convert(conv, art)
    report = make_report(art)
    with tracked(_ctx(), "eval", "tiny", "eval") as ev:
        tracking.log_eval(ev, report)
    from quantkit.gates import gate_path, run_gates

    record = run_gates(report).to_dict()  # writes gate.json beside the report
    gate_file = gate_path(report)
    assert json.loads(gate_file.read_text())["summary"] == record["summary"]
    with tracked(_ctx(), "gate", "tiny", "gate") as gr:
        tracking.log_gate(gr, record, gate_file)
    e = store.get_run(ev.run_id)
    # every metric of the report, both sides where measured, and the ratio interval's bounds
    assert e.data.metrics["quality.perplexity.candidate"] == GOOD_METRICS["quality.perplexity"]["candidate"]
    assert e.data.metrics["quality.perplexity.ci95_high.ratio"] == 1.035
    assert "quality.kl_mean.baseline" not in e.data.metrics  # not measured: not logged as a number
    assert e.data.tags["quantkit.convert_run"] == conv.run_id
    g = store.get_run(gr.run_id)
    assert g.data.tags["quantkit.eval_run"] == ev.run_id
    assert g.data.metrics["gate.passed"] == (1.0 if record["passed"] else 0.0)
    rows = [k for k in g.data.metrics if k.endswith(".passed") and k != "gate.passed"]
    assert len(rows) == len(record["gates"])
    tags = tracking.lineage_tags(tracking.sha256_file(art / "manifest.json"), tracking.sha256_file(report),
                                 tracking.sha256_file(gate_file))
    assert (tags["quantkit.convert_run"], tags["quantkit.eval_run"], tags["quantkit.gate_run"]) == \
        (conv.run_id, ev.run_id, gr.run_id)
    chain = dict(tracking.lineage(tags))
    assert conv.run_id in chain["convert run"] and "FINISHED" in chain["eval run"]


def test_a_failed_eval_run_is_not_lineage(store, tmp_path):
    art = make_artifact(tmp_path / "art")
    report = make_report(art)
    with pytest.raises(RuntimeError):
        with tracked(_ctx(), "eval", "tiny", "eval") as ev:
            tracking.log_eval(ev, report)
            raise RuntimeError("engine died")
    assert tracking.find_run("eval", "report_sha256", tracking.sha256_file(report)) is None


def test_layer_metrics_are_stepped_by_layer():
    layers = {"model.layers.0.mlp.down_proj": {"output_sqnr_db": 28.5, "gptq_loss": 3.5, "method": "gptq"},
              "model.layers.11.self_attn.q_proj": {"weight_sqnr_db": 17.0, "seconds": 0.2},
              "lm_head": {"weight_sqnr_db": 30.0}}
    assert tracking.layer_metrics(layers) == {
        0: {"output_sqnr_db.mlp.down_proj": 28.5, "gptq_loss.mlp.down_proj": 3.5},
        11: {"weight_sqnr_db.self_attn.q_proj": 17.0, "seconds.self_attn.q_proj": 0.2}}


def test_flatten_names_nested_recipe_fields():
    flat = tracking.flatten({"model": {"path": "m", "dtype": "bf16"}, "stages": [{"method": "gptq"}], "gates": []})
    assert flat == {"model.path": "m", "model.dtype": "bf16", "stages.0.method": "gptq", "gates": []}


def test_the_gate_command_logs_a_gate_run_linked_to_its_eval(store, tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli import app

    art = make_artifact(tmp_path / "art")
    report = make_report(art)
    with tracked(_ctx(), "eval", "tiny", "eval") as ev:
        tracking.log_eval(ev, report)
    res = CliRunner().invoke(app, ["gate", str(art)])
    assert res.exit_code in (0, 1), res.output
    exp = store.get_experiment_by_name("quantkit/unknown")  # make_report writes no baseline path
    (run,) = store.search_runs([exp.experiment_id])
    assert run.data.tags["quantkit.kind"] == "gate" and run.info.status == "FINISHED"
    assert run.data.tags["quantkit.eval_run"] == ev.run_id
    assert run.data.metrics["gate.passed"] == (1.0 if res.exit_code == 0 else 0.0)
    res = CliRunner().invoke(app, ["--no-track", "gate", str(art)])
    assert len(store.search_runs([exp.experiment_id])) == 1  # --no-track: no second run


def test_a_tracked_conversion_logs_recipe_layers_and_files(store, tmp_path, tiny_llama):
    from typer.testing import CliRunner

    from conftest import tiny_recipe, write_recipe
    from quantkit.cli import app

    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8"}]))
    res = CliRunner().invoke(app, ["convert", str(recipe), "-o", str(tmp_path / "out"), "-q"])
    assert res.exit_code == 0, res.output
    exp = store.get_experiment_by_name(f"quantkit/{tiny_llama.name}")
    (run,) = store.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["quantkit.kind"] == "convert"
    assert run.data.params["recipe.stages.0.method"] == "rtn" and run.data.params["recipe.stages.0.scheme"] == "W8A8"
    assert run.data.tags["quantkit.manifest_sha256"] == tracking.sha256_file(tmp_path / "out" / "manifest.json")
    # one point per decoder layer (the tiny model has 2) for a module's output SQNR
    hist = store.get_metric_history(run.info.run_id, "weight_sqnr_db.mlp.down_proj")
    assert sorted(m.step for m in hist) == [0, 1] and all(m.value > 20 for m in hist)
    files = {f.path for f in store.list_artifacts(run.info.run_id)}
    assert {"manifest.json", "convert.log", "recipe.yaml"} <= files
    # a refused conversion is a FAILED run naming the problem; nothing else runs
    bad = write_recipe(tmp_path / "bad.yaml", tiny_recipe(tmp_path / "no-model", None, [{"method": "rtn", "scheme": "W8A8"}]))
    res = CliRunner().invoke(app, ["convert", str(bad), "-o", str(tmp_path / "out2"), "-q"])
    assert res.exit_code == 2
    exp2 = store.get_experiment_by_name("quantkit/no-model")
    (failed,) = store.search_runs([exp2.experiment_id])
    assert failed.info.status == "FAILED" and "no-model" in failed.data.tags["quantkit.error"]


def test_a_study_is_a_parent_run_with_one_child_per_cell_that_ran(store):
    records = [
        {"id": "w8a8", "kind": "artifact", "status": "done", "choices": {"scheme": "W8A8"}, "engine_args": {},
         "gates": {"passed": True}, "figures": {"ppl_ratio": 1.03, "e2e_p99_ms_peak": 950.0, "cost_level": "c4"},
         "timings": {"convert_s": 30.5, "eval_s": 200.0}},
        {"id": "w4a16", "kind": "artifact", "status": "failed", "reason": "RuntimeError: engine died",
         "choices": {"scheme": "W4A16"}, "timings": {"total_s": 12.0}},
        {"id": "w8a8-bs64", "kind": "serving", "status": None},  # not run: no child
    ]
    with tracked(_ctx(), "tune", "tiny", "tune demo") as parent:
        tracking.log_study(parent, records, {"recommended": {"id": "w8a8", "reason": "cheapest passing"}})
    exp = store.get_experiment_by_name("quantkit/tiny")
    runs = {r.info.run_name: r for r in store.search_runs([exp.experiment_id])}
    assert set(runs) == {"tune demo", "w8a8", "w4a16"}
    assert runs["tune demo"].data.tags["quantkit.recommended"] == "w8a8"
    child = runs["w8a8"]
    assert child.data.tags["mlflow.parentRunId"] == parent.run_id and child.info.status == "FINISHED"
    assert child.data.metrics["figure.ppl_ratio"] == 1.03 and child.data.metrics["time.eval_s"] == 200.0
    assert "figure.cost_level" not in child.data.metrics  # a label, not a number
    assert runs["w4a16"].info.status == "FAILED" and "engine died" in runs["w4a16"].data.tags["quantkit.error"]


HOLDER = """
import os, sys, time
from quantkit.cli.common import tracked
import click
ctx = click.Context(click.Command("quantkit")); ctx.obj = {}
with tracked(ctx, "convert", "tiny", sys.argv[1]):
    print("open", flush=True)
    time.sleep(120)
"""


def _holder(store, name):
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", HOLDER, name], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "open"
    return p


def test_sigterm_ends_the_run_killed_and_kill_9_is_reaped_by_the_next_run(store):
    import signal

    term = _holder(store, "terminated")
    term.send_signal(signal.SIGTERM)
    assert term.wait(timeout=60) != 0
    nine = _holder(store, "kill -9")
    nine.kill()
    nine.wait(timeout=60)
    runs = {r.info.run_name: r for r in _all(store)}
    assert runs["terminated"].info.status == "KILLED" and "signal 15" in runs["terminated"].data.tags["quantkit.error"]
    assert runs["kill -9"].info.status == "RUNNING"  # nothing in a SIGKILLed process can end its run
    tracking.open_run("convert", "tiny", "next").end()  # the next run in the experiment reaps it
    runs = {r.info.run_name: r for r in _all(store)}
    assert runs["kill -9"].info.status == "KILLED"
    assert f"process {nine.pid}" in runs["kill -9"].data.tags["quantkit.error"]
    assert runs["next"].info.status == "FINISHED"


def _all(store, model="tiny"):
    return store.search_runs([store.get_experiment_by_name(f"quantkit/{model}").experiment_id])


def test_a_failed_eval_leaves_a_failed_run_with_the_reason(store, tmp_path, tiny_llama):
    from typer.testing import CliRunner

    from quantkit.cli import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = CliRunner().invoke(app, ["eval", "--candidate-url", f"http://127.0.0.1:{port}/v1", "--no-baseline",
                                   "--baseline", str(tiny_llama), "--suite", "smoke", "-o", str(tmp_path / "ev")])
    assert res.exit_code not in (0, 1), res.output
    (run,) = _all(store, tiny_llama.name)  # no server answers at that port
    assert run.info.status == "FAILED" and run.data.tags["quantkit.kind"] == "eval"
    assert str(port) in run.data.tags["quantkit.error"] or "127.0.0.1" in run.data.tags["quantkit.error"]
