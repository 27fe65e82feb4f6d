"""An installed wheel works from any folder: `pip install .` (not editable) into a fresh venv, then every
shipped resource is used by name from an empty directory, including a conversion calibrated on the
builtin corpus.

The fresh venv gets quantkit from the wheel only; its dependencies (torch, transformers, ...) are
borrowed from the test's own environment through a .pth line, so the test installs nothing from a
registry and takes about a minute. The venv's own site-packages comes first on sys.path, so the
`quantkit` it imports is the installed copy, never this checkout (checked below).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import make_tiny_model, write_recipe

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with quantkit installed from this checkout as a regular (non-editable) package."""
    root = tmp_path_factory.mktemp("wheel")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    # the dependencies (and pip/setuptools for the build) come from this environment, after the venv's own
    deps = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    (purelib / "zz_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    # build from a copy of the source tree, so the build leaves nothing (build/, *.egg-info) in the checkout
    src = root / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info",
                                                             "__pycache__", ".pytest_cache"))
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    res = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet", str(src)],
                         cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (purelib / "quantkit" / "_data" / "recipes").is_dir(), "the wheel carries no shipped data"
    return venv


def _run(venv: Path, cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    res = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert res.returncode == 0, f"{args}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


def test_installed_package_is_the_wheel_not_the_checkout(installed, tmp_path):
    res = _run(installed, tmp_path, str(installed / "bin" / "python"), "-c",
               "import quantkit, quantkit.resources as r; print(quantkit.__file__); print(r.data_root())")
    pkg, root = res.stdout.split()
    assert Path(pkg).is_relative_to(installed) and not Path(pkg).is_relative_to(REPO)
    assert Path(root) == Path(pkg).parent / "_data"
    # a wheel ships the data, not the generators beside it
    assert not (Path(root) / "calibration" / "tools").exists() and not (Path(root) / "evals" / "tools").exists()


def test_recipes_by_name_from_an_empty_folder(installed, tmp_path):
    res = _run(installed, tmp_path, "quantkit", "recipes", "list")
    shipped = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    listed = [line.split()[0] for line in res.stdout.splitlines() if not line.startswith("(")]
    assert listed == shipped
    res = _run(installed, tmp_path, "quantkit", "recipes", "validate", *shipped)
    assert res.stdout.count(": ok (") == len(shipped)
    res = _run(installed, tmp_path, "quantkit", "recipes", "corpora")
    assert {"prose", "code", "chat", "json", "numbers"} <= {line.split()[0] for line in res.stdout.splitlines()}
    bad = _run(installed, tmp_path, "quantkit", "recipes", "validate", "no-such-recipe", check=False)
    assert bad.returncode == 2 and "quantkit recipes list" in bad.stderr


def test_suites_tasks_and_heldout_text_by_name(installed, tmp_path):
    code = """
import json
from pathlib import Path
from quantkit.evaluate.suite import list_suites, load_suite, resolve_file
from quantkit.evaluate.tasks import render_tasks
out = {"suites": list_suites()}
for name in ("smoke", "default", "serving"):
    spec = load_suite(name)
    out[name] = [str(resolve_file(f)) for f in spec.perplexity_files]
rendered = render_tasks(Path("rendered"))
out["tasks"] = sorted(p.name for p in rendered.glob("*.yaml"))
out["task_data"] = [line.split("test:", 1)[1].strip() for p in rendered.glob("*.yaml")
                    for line in p.read_text().splitlines() if line.strip().startswith("test:")]
print(json.dumps(out))
"""
    res = _run(installed, tmp_path, str(installed / "bin" / "python"), "-c", code)
    out = json.loads(res.stdout)
    assert out["suites"] == ["default", "full", "kv", "latency", "serving", "smoke"]
    for name in ("smoke", "default", "serving"):
        assert out[name] and all(Path(p).is_file() and Path(p).is_relative_to(installed) for p in out[name])
    assert {"qk_suite.yaml", "qk_cloze.yaml", "qk_arith.yaml"} <= set(out["tasks"])
    assert out["task_data"] and all(Path(p).is_file() and Path(p).is_relative_to(installed) for p in out["task_data"])


def test_convert_on_the_builtin_corpus_from_an_empty_folder(installed, tmp_path):
    """A recipe that names the shipped corpus converts from a folder holding nothing but the recipe and model."""
    make_tiny_model(tmp_path / "tiny")
    write_recipe(tmp_path / "r.yaml", {
        "name": "tiny-builtin", "model": {"path": "tiny"},
        "calibration": {"sources": [{"type": "builtin", "name": "prose", "weight": 2},
                                    {"type": "builtin", "name": "code"}],
                        "num_samples": 6, "seq_len": 32, "batch_size": 3},
        "stages": [{"method": "gptq", "scheme": "W4A16", "group_size": 32}]})
    env_home = tmp_path / "home"
    res = _run(installed, tmp_path, "env", f"QUANTKIT_HOME={env_home}", "quantkit", "convert", "r.yaml", "-q")
    out = Path(res.stdout.strip().splitlines()[-1])
    assert out == tmp_path / "runs" / "tiny-builtin"
    man = json.loads((out / "manifest.json").read_text())
    srcs = man["calibration"]["sources"]
    assert [s.get("name") for s in srcs] == ["prose", "code"]
    assert all(Path(s["path"]).is_relative_to(installed) and s["documents"] > 0 for s in srcs)
    assert man["calibration"]["num_samples"] == 6
