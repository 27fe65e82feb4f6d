"""Registry tests against a REAL `mlflow server` on 127.0.0.1 (one per test session), plus the embedded default.

The server gets a sqlite store and an artifact destination in a temp folder, serves the artifacts
(--serve-artifacts), and is stopped by its process group at the end. Each test uses its own model name.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from _artifacts import GOOD_METRICS, make_artifact, make_report
from typer.testing import CliRunner

from quantkit import registry
from quantkit.cli import app
from quantkit.export.manifest import verify
from quantkit.gates import run_gates
from quantkit.recipe import GateSpec
from quantkit.registry import RegistryError

PPL_GATE = [GateSpec(metric="quality.perplexity", op="<=", threshold=1.05, relative=True)]


@pytest.fixture(autouse=True)
def _quiet_mlflow():
    loggers = [logging.getLogger(n) for n in ("mlflow", "alembic")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    yield
    for lg, lvl in zip(loggers, old):
        lg.setLevel(lvl)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    log_path = root / "server.log"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--serve-artifacts",
           "--artifacts-destination", str(root / "artifacts")]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy after 240 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield SimpleNamespace(uri=url, artifacts=root / "artifacts")
    finally:
        # the server runs uvicorn in a child process: stop the whole group we started, by its id
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue


def gated_artifact(folder: Path, seed: int = 0, metrics: dict | None = None, **kw) -> Path:
    art = make_artifact(folder, seed=seed, **kw)
    run_gates(make_report(art, metrics))  # the artifact's own gates: recipe + scheme defaults + integrity
    return art


def test_publish_two_versions_promote_rollback_pull(mlflow_server, tmp_path):
    uri, name = mlflow_server.uri, "tiny-flow"
    a1 = gated_artifact(tmp_path / "a1", seed=1)
    a2 = gated_artifact(tmp_path / "a2", seed=2)
    v1 = registry.publish(a1, registry_uri=uri, name=name)
    v2 = registry.publish(a2, registry_uri=uri, name=name)
    assert (v1.version, v2.version) == ("1", "2")
    t = v2.tags
    assert t["quantkit.base_model"] == "org/tiny-base" and t["quantkit.method"] == "rtn"
    assert t["quantkit.scheme"] == "W8A8" and t["quantkit.recipe_sha256"] == f"{2:064x}"
    assert t["quantkit.calibration_fingerprint"] == "cd" * 32 and t["quantkit.gate"] == "PASS 18/18"  # W8A8: 17 default rows + completeness
    assert float(t["metric.quality.perplexity"]) == pytest.approx(10.2) and "metric.speed.c1.tpot_ms_p50" in t

    assert registry.promote(name, "1", registry_uri=uri).version == "1"
    assert registry.promote(name, "2", registry_uri=uri).aliases == ["production"]
    assert registry.rollback(name, registry_uri=uri).version == "1"
    assert registry.show(name, "production", uri).version == "1"
    with pytest.raises(RegistryError, match="nothing to roll back to"):
        registry.rollback(name, registry_uri=uri)

    dest = registry.pull(name, "production", tmp_path / "pulled", uri)
    assert verify(dest) == []
    assert (dest / "model.safetensors").read_bytes() == (a1 / "model.safetensors").read_bytes()
    card = (dest / "README.md").read_text()
    assert "vllm.entrypoints.openai.api_server --model" in card and "| quality.perplexity |" in card
    assert (dest / "quantkit" / "report.json").is_file() and (dest / "quantkit" / "gate.json").is_file()
    with pytest.raises(FileExistsError):
        registry.pull(name, "1", dest, uri)

    runner = CliRunner()
    res = runner.invoke(app, ["registry", "list", name, "--registry", uri])
    assert res.exit_code == 0 and len(res.output.strip().splitlines()) == 2 and "production" in res.output
    res = runner.invoke(app, ["registry", "show", name, "2", "--registry", uri])
    assert res.exit_code == 0 and "quantkit.gate: PASS 18/18" in res.output
    res = runner.invoke(app, ["promote", name, "2", "--registry", uri])
    assert res.exit_code == 0 and "-> version 2" in res.output
    res = runner.invoke(app, ["rollback", name, "--registry", uri])
    assert res.exit_code == 0 and "-> version 1" in res.output


def test_tampered_file_is_refused_on_publish_and_on_pull(mlflow_server, tmp_path):
    uri, name = mlflow_server.uri, "tiny-tamper"
    art = gated_artifact(tmp_path / "a", seed=3)
    good = (art / "config.json").read_bytes()
    (art / "config.json").write_bytes(good.replace(b"8", b"9"))
    with pytest.raises(RegistryError, match="config.json: sha256 does not match"):
        registry.publish(art, registry_uri=uri, name=name)
    assert registry.list_versions(name, uri) == []
    (art / "config.json").write_bytes(good)
    info = registry.publish(art, registry_uri=uri, name=name)

    run_id = info.source.split("/")[-2]  # mlflow-artifacts:/<experiment>/<run>/artifacts
    stored = next(mlflow_server.artifacts.rglob(f"{run_id}/artifacts/model.safetensors"))
    data = bytearray(stored.read_bytes())
    data[100] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match="model.safetensors: sha256 does not match"):
        registry.pull(name, info.version, tmp_path / "out", uri)
    assert not (tmp_path / "out").exists()
    res = CliRunner().invoke(app, ["registry", "pull", name, info.version, str(tmp_path / "out2"), "--registry", uri])
    assert res.exit_code == 2 and "failed verification" in res.output and not (tmp_path / "out2").exists()


def test_missing_or_failing_gate_blocks_publish(mlflow_server, tmp_path):
    uri, name = mlflow_server.uri, "tiny-gated"
    art = make_artifact(tmp_path / "a", seed=4)
    with pytest.raises(RegistryError, match="no eval report"):
        registry.publish(art, registry_uri=uri, name=name)
    rep = make_report(art, {**GOOD_METRICS, "quality.perplexity": {"baseline": 10.0, "candidate": 12.0}})
    with pytest.raises(RegistryError, match="no gate result"):
        registry.publish(art, registry_uri=uri, name=name)
    assert not run_gates(rep, gates=PPL_GATE).passed
    res = CliRunner().invoke(app, ["publish", str(art), "--registry", uri, "--name", name])
    assert res.exit_code == 2 and "gates failed" in res.output and "violates <= 1.05" in res.output, res.output
    assert registry.list_versions(name, uri) == []


def _failing_client(uri: str, fail_on: str, exc: BaseException):
    from mlflow import MlflowClient

    class Failing(MlflowClient):
        def log_artifact(self, run_id, local_path, artifact_path=None):
            if fail_on == "upload" and Path(local_path).name == "model.safetensors":
                raise exc
            return super().log_artifact(run_id, local_path, artifact_path)

        def create_model_version(self, *args, **kwargs):
            mv = super().create_model_version(*args, **kwargs)
            if fail_on == "version_response":  # the server made it, but the reply was lost
                raise exc
            return mv

        def set_terminated(self, run_id, status=None, end_time=None):
            if fail_on == "after_version":
                raise exc
            return super().set_terminated(run_id, status, end_time)

    return Failing(tracking_uri=uri, registry_uri=uri)


def test_interrupted_publish_leaves_nothing_registered(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from quantkit.registry.mlflow_backend import EXPERIMENT, MlflowRegistry

    uri, name = mlflow_server.uri, "tiny-interrupted"
    plain = MlflowClient(tracking_uri=uri, registry_uri=uri)
    art = gated_artifact(tmp_path / "a", seed=5)

    # 1. the upload breaks halfway through a brand-new model: no version, no registered model, run deleted
    reg = MlflowRegistry(uri, client=_failing_client(uri, "upload", ConnectionError("network dropped")))
    with pytest.raises(ConnectionError):
        registry.publish(art, name=name, client=reg)
    assert registry.list_versions(name, uri) == [] and plain.search_registered_models(f"name='{name}'") == []
    exp = plain.get_experiment_by_name(EXPERIMENT)
    live = plain.search_runs([exp.experiment_id], f"tags.`quantkit.registered_model` = '{name}'")
    assert live == []  # the run is deleted, not left half-uploaded

    # 2. an existing model, interrupted (Ctrl-C) after its version was created: that version is removed again
    v1 = registry.publish(art, registry_uri=uri, name=name)
    reg = MlflowRegistry(uri, client=_failing_client(uri, "after_version", KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        registry.publish(gated_artifact(tmp_path / "b", seed=6), name=name, client=reg)
    assert [v.version for v in registry.list_versions(name, uri)] == [v1.version]
    deleted = plain.search_runs([exp.experiment_id], f"tags.`quantkit.registered_model` = '{name}'",
                                run_view_type=3)  # ViewType.ALL
    assert sum(r.info.lifecycle_stage == "deleted" for r in deleted) == 2

    # 3. the version was created but its reply never arrived: found by run id and removed
    reg = MlflowRegistry(uri, client=_failing_client(uri, "version_response", TimeoutError("read timed out")))
    with pytest.raises(TimeoutError):
        registry.publish(gated_artifact(tmp_path / "c", seed=8), name=name, client=reg)
    assert [v.version for v in registry.list_versions(name, uri)] == [v1.version]
    deleted = plain.search_runs([exp.experiment_id], f"tags.`quantkit.registered_model` = '{name}'",
                                run_view_type=3)
    assert sum(r.info.lifecycle_stage == "deleted" for r in deleted) == 3
    for r in deleted:
        if r.info.lifecycle_stage == "deleted":
            assert not list(mlflow_server.artifacts.rglob(f"{r.info.run_id}/artifacts/model.safetensors"))


def test_embedded_registry_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))
    art = gated_artifact(tmp_path / "a", seed=7, publish={"registry": None, "name": "tiny-embedded",
                                                          "alias": "production"})
    runner = CliRunner()
    res = runner.invoke(app, ["publish", str(art)])
    assert res.exit_code == 0, res.output
    assert "published tiny-embedded version 1" in res.output
    assert (tmp_path / "home" / "registry" / "mlflow.db").is_file()
    assert list((tmp_path / "home" / "registry" / "artifacts").rglob("model.safetensors"))
    res = runner.invoke(app, ["registry", "list"])
    assert res.exit_code == 0 and "tiny-embedded" in res.output and "latest=1" in res.output
    assert registry.promote("tiny-embedded", "1").aliases == ["production"]
    dest = registry.pull("tiny-embedded", "production", tmp_path / "pulled")
    assert verify(dest) == [] and (dest / "README.md").is_file()


def test_rollback_follows_the_alias_history_not_the_version_numbers():
    from quantkit.registry.base import resolve_previous

    assert resolve_previous(["1", "3"], "3", ["1", "2", "3"]) == ("1", ["1"])  # promote 1, promote 3 -> 1
    assert resolve_previous([], "3", ["1", "2", "3"]) == ("2", ["2"])  # no history: the version below
    assert resolve_previous(["1", "2", "3"], "3", ["1", "3"]) == ("1", ["1"])  # a deleted version is skipped
    with pytest.raises(RegistryError, match="nothing to roll back to"):
        resolve_previous(["1"], "1", ["1", "2"])


def test_report_of_another_artifact_is_refused(tmp_path):
    from quantkit.registry.base import prepare_bundle

    art = make_artifact(tmp_path / "a", name="tiny-a")
    run_gates(make_report(art, name="tiny-b"))
    with pytest.raises(RegistryError, match="report of 'tiny-b', not of 'tiny-a'"):
        prepare_bundle(art, "tiny-a", tmp_path)


def test_card_of_a_recipe_with_a_transform_stage():
    """A SmoothQuant/AWQ stage has no scheme (null in the manifest): the card's tags skip it."""
    from quantkit.export.card import _front_matter

    man = {"quantization": {"stages": [{"method": "smoothquant", "scheme": None}, {"method": "rtn", "scheme": "W8A8"}]},
           "base_model": {"path": "org/tiny-base"}}
    front = _front_matter(man)
    assert "- w8a8" in front and "base_model: org/tiny-base" in front and "none" not in front.lower()
