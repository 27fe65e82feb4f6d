"""The model-free path (quantkit/quantize/streamed.py) against its independent expectation, the layer path: the
same recipe converted both ways gives the same shard bytes, tensors, config and manifest (timing fields and
the path aside); auto selection; kill -9 resume without redoing finished modules; two processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, make_tiny_model, tiny_recipe, write_recipe
from quantkit import api
from quantkit.plan import ConvertError
from quantkit.quantize.streamed import PATH_ENV
from quantkit.recipe import parse_recipe

# what may differ between two conversions of the same recipe: when and how long, and which path ran
TIMING = {"wall_time_s", "peak_rss_bytes", "phases_s", "peak_gpu_bytes", "path", "resumed_modules", "peak_at_start_mb",
          "peak_raised_mb"}  # measured, not made: they differ from run to run


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    """hidden 256, 4 layers: weights of 128-256 KB, so 1 MB shards cut the export into several files."""
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "wide-llama", "llama", layers=4, hidden=256)


def _convert(recipe, out: Path, path: str | None = None, **kw) -> Path:
    """api.convert on the path asked for (as `quantkit convert --path` asks: QUANTKIT_CONVERT_PATH)."""
    saved = os.environ.pop(PATH_ENV, None)
    try:
        if path is not None:
            os.environ[PATH_ENV] = path
        return api.convert(recipe, out, quiet=True, **kw)
    finally:
        os.environ.pop(PATH_ENV, None)
        if saved is not None:
            os.environ[PATH_ENV] = saved


def _both(model: Path, stages: list[dict], tmp: Path, **recipe_patch) -> tuple[Path, Path, dict, dict]:
    r = parse_recipe({**tiny_recipe(model, None, stages), **recipe_patch})
    weights: dict[str, dict] = {"layers": {}, "streamed": {}}
    for path in weights:
        _convert(r, tmp / path, path, on_weight=weights[path].__setitem__)
    return tmp / "layers", tmp / "streamed", weights["layers"], weights["streamed"]


def _manifest(folder: Path, differs: frozenset = frozenset()) -> dict:
    m = json.loads((folder / "manifest.json").read_text())
    m["conversion"] = {k: v for k, v in m["conversion"].items() if k not in TIMING | differs}
    if isinstance(m["conversion"].get("preflight"), dict):  # the pre-flight's own seconds (ms under load) vary too
        m["conversion"]["preflight"] = {k: v for k, v in m["conversion"]["preflight"].items() if k != "seconds"}
    m["layers"] = {k: {f: x for f, x in v.items() if f != "seconds"} for k, v in m["layers"].items()}
    m["files"] = {k: v for k, v in m["files"].items() if k != "convert.log"}
    for k in ("created", "size_bytes"):
        m.pop(k)
    return m


def _assert_identical(layers: Path, streamed: Path, differs: frozenset = frozenset()) -> None:
    shards = sorted(p.name for p in layers.glob("model*.safetensors*"))
    assert shards == sorted(p.name for p in streamed.glob("model*.safetensors*"))
    for name in shards:
        assert (layers / name).read_bytes() == (streamed / name).read_bytes(), name
    for name in (n for n in shards if n.endswith(".safetensors")):
        a, b = load_file(str(layers / name)), load_file(str(streamed / name))
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert json.loads((layers / "config.json").read_text()) == json.loads((streamed / "config.json").read_text())
    assert _manifest(layers, differs) == _manifest(streamed, differs)


@pytest.mark.parametrize("stages", [
    [{"method": "rtn", "scheme": "W8A8"}],
    [{"method": "rtn", "scheme": "W4A16", "group_size": 32}],
    [{"method": "rtn", "scheme": "W4A16_ASYM", "group_size": 32}],
    [{"method": "rtn", "scheme": "FP8_DYNAMIC"}],
    [{"method": "rtn", "scheme": "NVFP4A16"}],
    [{"method": "rtn", "scheme": "MXFP4A16", "observer": "mse"}],
    # two stages: mixed precision, per-module config groups
    [{"method": "rtn", "scheme": "W8A8", "targets": ["re:.*mlp.down_proj$"]}, {"method": "rtn", "scheme": "W4A16",
                                                                               "group_size": 32}],
], ids=["w8a8", "w4a16-g32", "w4a16-asym-g32", "fp8-dynamic", "nvfp4a16", "mxfp4a16-mse", "mixed"])
def test_the_streamed_export_is_byte_identical_to_the_layer_path(tiny_llama, tmp_path, stages):
    layers, streamed, w_layers, w_streamed = _both(tiny_llama, stages, tmp_path)
    _assert_identical(layers, streamed)
    assert w_layers.keys() == w_streamed.keys() and all(torch.equal(w_layers[k], w_streamed[k]) for k in w_layers)
    conv = {p.name: json.loads((p / "manifest.json").read_text())["conversion"] for p in (layers, streamed)}
    assert conv["layers"]["path"] == "layers" and conv["streamed"]["path"] == "streamed"
    ph = conv["streamed"]["phases_s"]
    assert ph["solve"] > 0 and not {"layer", "forward", "capture", "hessian"} & ph.keys()


def test_several_shards_are_cut_at_the_same_tensors(wide_llama, tmp_path):
    layers, streamed, _, _ = _both(wide_llama, [{"method": "rtn", "scheme": "W8A8"}], tmp_path,
                                   export={"max_shard_size_mb": 1})
    assert len(list(layers.glob("model-*.safetensors"))) > 2
    _assert_identical(layers, streamed)


@pytest.mark.parametrize("model_type", ["mistral", "qwen3_moe"])  # untied lm_head + q/k/v biases; experts
def test_other_architectures_stream_identically(tmp_path, model_type):
    model = make_tiny_model(tmp_path / "m", model_type)
    layers, streamed, _, _ = _both(model, [{"method": "rtn", "scheme": "W8A16"}], tmp_path)
    _assert_identical(layers, streamed)


def test_auto_streams_only_recipes_that_need_no_layers(tiny_llama, calib_text, tmp_path):
    def path_of(calib, stages, out):
        _convert(parse_recipe(tiny_recipe(tiny_llama, calib, stages)), tmp_path / out)
        return json.loads((tmp_path / out / "manifest.json").read_text())["conversion"]["path"]

    assert path_of(None, [{"method": "rtn", "scheme": "W8A8"}], "a") == "streamed"
    assert path_of(calib_text, [{"method": "rtn", "scheme": "W8A8"}], "b") == "layers"  # output-SQNR diagnostics
    assert "the recipe has a calibration section" in (tmp_path / "b" / "convert.log").read_text()
    gptq = parse_recipe(tiny_recipe(tiny_llama, calib_text, [{"method": "gptq", "scheme": "W4A16", "group_size": 32}]))
    with pytest.raises(ConvertError, match=r"cannot take the streamed \(model-free\) path: the recipe has a "
                                           r"calibration section.*--path auto or --path layers"):
        _convert(gptq, tmp_path / "c", "streamed")
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------------------ resume
KILLER = r"""
import os, signal, sys
from quantkit.quantize import workdir
from quantkit.cli import app
at = int(sys.argv[1])
orig = workdir.WorkDir.save_tensor
saved = []
def save_tensor(self, module, tensors, stats):
    orig(self, module, tensors, stats)
    saved.append(module)
    if len(saved) == at:
        os.kill(os.getpid(), signal.SIGKILL)
workdir.WorkDir.save_tensor = save_tensor
sys.argv = ["quantkit", *sys.argv[2:]]
app()
"""

COUNTER = r"""
import sys
from quantkit.quantize import streamed
from quantkit.cli import app
orig, done = streamed.quantize_one, []
def quantize_one(job, t):
    done.append(t.name)
    return orig(job, t)
streamed.quantize_one = quantize_one
sys.argv = ["quantkit", *sys.argv[1:]]
try:
    app()
finally:
    print("QUANTIZED", len(done), file=sys.stderr)
"""


def _quantkit(*args: str, script: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "quantkit", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_kill_9_resumes_without_redoing_finished_modules(tiny_llama, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama, None, [{"method": "rtn", "scheme": "W4A16",
                                                                                "group_size": 32}]))
    ref = _quantkit("convert", str(recipe), "-o", str(tmp_path / "ref"), "-q")
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _quantkit("5", "convert", str(recipe), "-o", str(tmp_path / "out"), "-q", script=KILLER)
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "out").exists()
    assert len(list((api.partial_dir(tmp_path / "out") / "work" / "tensors").glob("*.safetensors"))) == 5
    resumed = _quantkit("convert", str(recipe), "-o", str(tmp_path / "out"), "-q", script=COUNTER)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    total = len(json.loads((tmp_path / "ref" / "manifest.json").read_text())["layers"])  # 14: 2 layers x 7
    assert f"QUANTIZED {total - 5}" in resumed.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["conversion"]["resumed_modules"] == 5
    assert "resuming: 5 modules were already done" in (tmp_path / "out" / "convert.log").read_text()
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "ref" / f).read_bytes() == (tmp_path / "out" / f).read_bytes(), f
    assert _manifest(tmp_path / "ref")["layers"] == _manifest(tmp_path / "out")["layers"]


def test_switching_paths_over_an_unfinished_conversion_is_refused_then_restarted(tiny_llama, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8"}]))
    killed = _quantkit("3", "convert", str(recipe), "-o", str(tmp_path / "out"), "-q", script=KILLER)
    assert killed.returncode == -signal.SIGKILL
    switched = _quantkit("convert", str(recipe), "-o", str(tmp_path / "out"), "-q", "--path", "layers")
    assert switched.returncode == 2
    assert "an unfinished conversion with a different path is here; run again with --restart" in switched.stderr
    restarted = _quantkit("convert", str(recipe), "-o", str(tmp_path / "out"), "-q", "--path", "layers", "--restart")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["conversion"]["path"] == "layers"


def test_two_processes_stream_the_bytes_one_process_streams(wide_llama, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", {**tiny_recipe(wide_llama, None, [{"method": "rtn", "scheme": "W8A8"}]),
                                                "export": {"max_shard_size_mb": 1}})
    one = _quantkit("convert", str(recipe), "-o", "one", "-q", "--path", "layers", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _quantkit("convert", str(recipe), "-o", "two", "-q", "--nproc", "2", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    _assert_identical(tmp_path / "one", tmp_path / "two", frozenset({"processes"}))
    conv = json.loads((tmp_path / "two" / "manifest.json").read_text())["conversion"]
    assert conv["processes"] == 2 and conv["path"] == "streamed"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
