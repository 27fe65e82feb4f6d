"""MLflow's UI as a person sees it, after a real convert + eval + gate + publish of the demo model through the CLI
with tracking on: headless Chromium (Debian's package) renders the pages and the test reads the rendered DOM.

Set QUANTKIT_UI_SCREENSHOTS=<folder> to also keep PNG screenshots of the pages (docs/img/ holds the committed ones).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _demo_dir() -> Path:
    real = Path(os.environ.get("QUANTKIT_REAL_HOME", Path.home() / ".cache" / "quantkit"))
    return real / "models" / "smollm2-135m"


def _cli(env: dict, *args: str, ok=(0,)) -> str:
    p = subprocess.run([sys.executable, "-m", "quantkit", *args], env=env, capture_output=True, text=True, cwd=REPO)
    assert p.returncode in ok, f"quantkit {' '.join(args)} -> {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def tracked_demo(tmp_path_factory, demo_baselines):
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); .ci/run installs it")
    if not (_demo_dir() / "config.json").is_file() or util.find_spec("vllm") is None:
        pytest.skip("needs the demo model (quantkit models fetch smollm2-135m) and vLLM")
    work = tmp_path_factory.mktemp("tracked")
    store = f"sqlite:///{work / 'store' / 'mlflow.db'}"
    home = work / "home"  # its own home (baseline cache, logs), the demo model and vLLM's cache linked in
    home.mkdir()
    (home / "models").symlink_to(_demo_dir().parent)
    (home / "baselines").symlink_to(demo_baselines)  # the smoke baseline test_eval_e2e.py computed, where it ran
    env = {**os.environ, "QUANTKIT_TRACKING_URI": store, "QUANTKIT_NO_TRACK": "0", "QUANTKIT_HOME": str(home)}
    import yaml

    # this tests the pages, not W8A8 on a loaded 2-core CI machine with the smoke suite's 8 items per task: every
    # noisy default gets a lax gate of its own (a recipe's gate replaces the default on its metric; the integrity
    # gates and failed requests == 0 stay), and the smoke suite's two perplexity windows give no interval for the
    # anomaly gate, so publish's decision does not depend on the machine's mood
    recipe = yaml.safe_load((REPO / "recipes" / "smollm2-w8a8-rtn.yaml").read_text())
    recipe["model"]["path"] = str(_demo_dir())
    recipe["accept_anomalies"] = True
    recipe["gates"] = [{"metric": m, "op": op, "threshold": t, "relative": rel} for m, op, t, rel in (
        ("speed.decode_tpot_ms_p50", "<=", 4.0, True), ("speed.peak_output_tok_s", ">=", 0.25, True),
        ("cost.machine_s_per_k_successful_tasks", "<=", 4.0, True), ("memory.engine_bytes", "<=", 2.0, True),
        ("memory.weight_bytes", "<=", 0.9, True), ("quality.perplexity", "<=", 1.2, True),
        ("quality.top1_agreement", ">=", 0.6, False), ("tasks.mean_acc", ">=", 0.5, True),
        ("tasks.*.*", ">=", 0.25, True), ("tools.baseline_agreement", ">=", 0.25, False),
        ("safety.flip_rate", "<=", 0.5, False), ("generation.degenerate_excess", "<=", 0.5, False))]
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    arts = {}
    for name, extra in (("w8a8", []), ("w8a8-keep-down", ["--set", "stages.0.ignore=[lm_head, 're:.*down_proj']"])):
        arts[name] = work / name
        _cli(env, "convert", str(work / "recipe.yaml"), "-o", str(arts[name]), "-q", "--set", f"name=smollm2-{name}",
             *extra)
        _cli(env, "eval", str(arts[name]), "--suite", "smoke")
        _cli(env, "gate", str(arts[name]), ok=(0, 1))
    _cli(env, "publish", str(arts["w8a8"]), "--registry", store, "--name", "smollm2-ui-test")
    from mlflow import MlflowClient

    return {"env": env, "store": store, "client": MlflowClient(tracking_uri=store), "arts": arts}


@pytest.fixture(scope="module")
def ui(tracked_demo):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "ui", "--port", str(port)], env=tracked_demo["env"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("quantkit ui did not answer within 240 s")
        yield base
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def _render(url: str, shot: str | None = None) -> str:
    """The DOM after the page's scripts ran (Chromium's virtual time lets the UI's API calls finish)."""
    profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"qk-chromium-{os.getpid()}"
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=25000"]
    dom = subprocess.run([*cmd, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    folder = os.environ.get("QUANTKIT_UI_SCREENSHOTS")
    if shot and folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        subprocess.run([*cmd, "--window-size=1500,1100", f"--screenshot={Path(folder).resolve() / shot}", url],
                       capture_output=True, timeout=180)
    return dom


def _runs(tracked_demo, kind: str):
    c = tracked_demo["client"]
    exp = c.get_experiment_by_name("quantkit/smollm2-135m")
    return exp.experiment_id, c.search_runs([exp.experiment_id], filter_string=f"tags.`quantkit.kind` = '{kind}'",
                                            order_by=["attributes.start_time ASC"])


def test_the_eval_run_shows_its_metrics_and_artifacts(tracked_demo, ui):
    exp, runs = _runs(tracked_demo, "eval")
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    run = runs[0]
    dom = _render(f"{ui}/#/experiments/{exp}/runs/{run.info.run_id}", "eval-run.png")
    assert run.info.run_name in dom and "quality.perplexity.candidate" in dom and "perplexity ratio" in dom
    dom = _render(f"{ui}/#/experiments/{exp}/runs/{run.info.run_id}/artifacts", "eval-artifacts.png")
    assert "report.md" in dom and "report.json" in dom and "plots" in dom


def test_the_registered_version_shows_its_source_run_and_lineage(tracked_demo, ui):
    c = tracked_demo["client"]
    (mv,) = c.search_model_versions("name = 'smollm2-ui-test'")
    _, evals = _runs(tracked_demo, "eval")
    assert mv.tags["quantkit.eval_run"] == evals[0].info.run_id
    dom = _render(f"{ui}/#/models/smollm2-ui-test/versions/{mv.version}", "model-version.png")
    assert mv.run_id in dom and evals[0].info.run_id in dom  # the source run, and the eval run in the tags
    out = _cli(tracked_demo["env"], "registry", "show", "smollm2-ui-test", str(mv.version), "--registry",
               tracked_demo["store"])
    assert f"eval run       {evals[0].info.run_id}" in out and "FINISHED" in out


def test_two_candidates_can_be_compared(tracked_demo, ui):
    exp, runs = _runs(tracked_demo, "eval")
    ids = [r.info.run_id for r in runs]
    url = f"{ui}/#/compare-runs?runs={json.dumps(ids)}&experiments={json.dumps([exp])}"
    dom = _render(url.replace(" ", ""), "compare-evals.png")
    assert "Comparing 2 Runs" in dom and all(r.info.run_name in dom for r in runs)
    assert "artifact.coverage.candidate" in dom  # the metrics were loaded (the plot's first metric)
