"""Relative paths, typed by a user in a folder other than the repository root, work for every command.

Each command is driven through the CLI from a scratch working directory with relative paths only, and
every path it hands on (to the engine subprocess, into the manifest, the gate result, the registry) must
be absolute. The bug this guards against: `quantkit eval runs/x` started vLLM with cwd=<eval folder>
and `--model runs/x`, which vLLM then took for a hub id.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _artifacts import make_artifact, make_report
from conftest import make_tiny_model, write_recipe
from typer.testing import CliRunner

from quantkit.cli import app

runner = CliRunner()


def _run(*args: str):
    res = runner.invoke(app, list(args), catch_exceptions=False)
    return res


@pytest.fixture()
def workdir(tmp_path, monkeypatch, calib_text) -> Path:
    """tmp/work with models/tiny, texts/*.txt and recipes/tiny.yaml naming both relatively; cwd = tmp/work."""
    work = tmp_path / "work"
    make_tiny_model(work / "models" / "tiny")
    (work / "texts").mkdir(parents=True)
    for f in Path(calib_text).glob("*.txt"):
        (work / "texts" / f.name).write_text(f.read_text())
    (work / "recipes").mkdir()
    write_recipe(work / "recipes" / "tiny.yaml", {
        "name": "tiny-rel", "model": {"path": "models/tiny", "dtype": "bfloat16"},
        "calibration": {"sources": [{"type": "text", "path": "texts/*.txt"}], "num_samples": 4, "seq_len": 32,
                        "batch_size": 2},
        "stages": [{"method": "gptq", "scheme": "W4A16", "group_size": 32}],
        "gates": [{"metric": "quality.perplexity", "op": "<=", "threshold": 1.05, "relative": True}]})
    monkeypatch.chdir(work)
    assert Path.cwd() != Path(__file__).resolve().parents[1]
    return work


def _is_abs(p: str) -> bool:
    return Path(p).is_absolute()


def test_convert_and_inspect_with_relative_paths(workdir):
    res = _run("convert", "recipes/tiny.yaml", "--output", "out/tiny", "-q")
    assert res.exit_code == 0, res.output
    out = workdir / "out" / "tiny"
    assert res.output.strip().splitlines()[-1] == str(out)  # the printed path is absolute
    man = json.loads((out / "manifest.json").read_text())
    assert man["base_model"]["resolved_dir"] == str(workdir / "models" / "tiny")
    assert man["recipe"]["model"]["path"] == str(workdir / "models" / "tiny")
    assert man["recipe"]["calibration"]["sources"][0]["path"] == str(workdir / "texts" / "*.txt")
    assert all(_is_abs(s["path"]) for s in man["calibration"]["sources"])
    assert not list(workdir.glob("out/.tiny.partial"))

    res = _run("inspect", "out/tiny", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["path"] == str(out) and summary["checksums"] == "ok"


def test_recipe_paths_are_absolute_at_load_and_the_api(workdir, tmp_path):
    from quantkit import api
    from quantkit.recipe import load_recipe, parse_recipe

    r = load_recipe("recipes/tiny.yaml")
    assert r.model.path == str(workdir / "models" / "tiny")
    assert r.calibration.sources[0].path == str(workdir / "texts" / "*.txt")
    assert load_recipe(workdir / "recipes" / "tiny.yaml") == r  # the same recipe however it was named
    # a demo name or hub id that is not a local path is left as written
    raw = {"name": "x", "model": {"path": "org/not-here"}, "stages": [{"method": "rtn", "scheme": "W8A8"}],
           "export": {"output_dir": "elsewhere/x"}}
    r2 = parse_recipe(raw).with_absolute_paths()
    assert r2.model.path == "org/not-here" and r2.export.output_dir == str(workdir / "elsewhere" / "x")
    assert api.default_output(r2) == workdir / "elsewhere" / "x"


def test_eval_hands_the_engine_absolute_paths(workdir, monkeypatch):
    """The engine is replaced by a recorder that refuses to start: what it was given is what vLLM would get."""
    from quantkit import engine as engine_mod
    from quantkit.engine import EngineError
    from quantkit.engine.vllm_server import VLLMServer

    assert _run("convert", "recipes/tiny.yaml", "--output", "out/tiny", "-q").exit_code == 0
    seen = []

    class Recorder:
        def __init__(self, **kw):
            seen.append(kw)
            self.server = VLLMServer(**{k: kw[k] for k in ("model_dir", "run_dir", "served_name", "tokenizer_dir")})

        def __enter__(self):
            raise EngineError("recorded, not started")

        def __exit__(self, *exc):
            return None

    monkeypatch.setitem(engine_mod.ENGINES, "vllm", Recorder)
    res = _run("eval", "out/tiny", "--suite", "smoke", "--output", "reports/tiny")
    assert res.exit_code == 3 and "recorded, not started" in res.output  # an engine failure: exit 3
    (kw,) = seen  # the baseline, first
    assert kw["model_dir"] == workdir / "models" / "tiny" and kw["run_dir"] == workdir / "reports" / "tiny"
    # the command line and environment vLLM would be started with: nothing relative
    srv = Recorder(model_dir=Path("out/tiny"), run_dir=Path("reports/x"), served_name="c",
                   tokenizer_dir=Path("out/tiny")).server
    cmd = srv.command(8000)
    assert cmd[cmd.index("--model") + 1] == str(workdir / "out" / "tiny")
    assert srv.run_dir == workdir / "reports" / "x" and srv.log_path.is_absolute()
    env = srv.environment()
    assert _is_abs(env["VLLM_CACHE_ROOT"]) and _is_abs(env["TORCHINDUCTOR_CACHE_DIR"])


def test_gate_publish_pull_with_relative_paths(workdir):
    art = make_artifact(workdir / "art", name="tiny-rel-pub",
                        gates=[{"metric": "quality.perplexity", "op": "<=", "threshold": 1.05, "relative": True}])
    make_report(art)
    res = _run("gate", "art")
    assert res.exit_code == 0, res.output
    gate = json.loads((art / "eval" / "gate.json").read_text())
    assert gate["report"] == str(art / "eval" / "report.json")

    res = _run("publish", "art", "--name", "tiny-rel-pub")
    assert res.exit_code == 0, res.output
    res = _run("registry", "show", "tiny-rel-pub", "1", "--json")
    assert res.exit_code == 0, res.output
    assert _is_abs(json.loads(res.output)["source"].removeprefix("file://"))

    res = _run("registry", "pull", "tiny-rel-pub", "1", "pulled")
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1] == str(workdir / "pulled")
    assert (workdir / "pulled" / "manifest.json").is_file()
    assert os.listdir(workdir / "pulled")


def test_embedded_registry_home_may_be_relative(workdir, monkeypatch):
    from quantkit.io import quantkit_home

    monkeypatch.setenv("QUANTKIT_HOME", "home-rel")
    assert quantkit_home() == workdir / "home-rel"
