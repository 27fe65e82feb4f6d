"""The GPU check (benchmarks/device_check.sh) without a GPU: the tokenizer its checkpoints carry, the time
budget that bounds its steps, and a shape checkpoint written with no demo model anywhere. The whole script in
a venv like the device image (`--simulate`) is the slow test at the end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantkit.model.tokenizer import BYTE_VOCAB_SIZE, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
TEXT = "Héllo, wörld 🙂\n\tdef f(x):\n        return {\"a\": [1, 2.5]}  # ✓ 日本語\x00\x7f"


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"qk_bench_{name}", REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------- tokenizer
def test_byte_tokenizer_ids_round_trip_and_load_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == BYTE_VOCAB_SIZE == 259
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT.encode("utf-8"))  # one token per byte: no merges
    assert min(ids) >= 3 and max(ids) < BYTE_VOCAB_SIZE  # bytes never map onto a special token
    assert tok.decode(ids) == TEXT
    from tokenizers.pre_tokenizers import ByteLevel

    assert set(tok.convert_ids_to_tokens(list(range(3, 259)))) == set(ByteLevel.alphabet())  # ids 3..258: the bytes
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>hi</s><|assistant|>"


def test_byte_tokenizer_ids_fall_below_every_shape_vocabulary():
    shapes = _bench("scale").SHAPES
    assert min(s["vocab_size"] for s in shapes.values()) > BYTE_VOCAB_SIZE - 1
    assert {"llama8b", "llama70b", "toy"} <= set(shapes)


def test_builder_is_deterministic_and_trains_merges_when_given_texts(tmp_path):
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    trained = build_tokenizer(None, [TEXT * 20], 300)
    assert len(trained) == 300
    assert len(trained(TEXT, add_special_tokens=False)["input_ids"]) < len(TEXT.encode("utf-8"))
    assert trained.decode(trained(TEXT, add_special_tokens=False)["input_ids"]) == TEXT
    with pytest.raises(ValueError, match="exactly 259"):
        build_tokenizer(None, None, 512)


def test_byte_tokenizer_gives_the_device_check_its_128_x_2048_calibration_tokens():
    from quantkit.data import build_calibration_set
    from quantkit.recipe import CalibrationSpec

    scale = _bench("scale")
    spec = CalibrationSpec(sources=[{"type": "builtin", "name": n} for n in scale.CORPORA], num_samples=128,
                           seq_len=2048)
    ids = build_calibration_set(spec, build_tokenizer()).input_ids
    assert tuple(ids.shape) == (128, 2048) and int(ids.max()) < BYTE_VOCAB_SIZE


# -------------------------------------------------------------------------------------- the checkpoint
def test_write_checkpoint_needs_no_demo_model(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    from quantkit.model.sources import demo_dir

    home = tmp_path / "empty-home"
    home.mkdir()
    monkeypatch.setenv("QUANTKIT_HOME", str(home))  # no models/ link: the demo model is not reachable
    assert not demo_dir("smollm2-135m").exists()
    out = _bench("scale").write_checkpoint(tmp_path / "toy-1", "toy", 1)
    cfg = AutoConfig.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (1, 256, 512)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert len(tok) <= cfg.vocab_size
    assert list(home.iterdir()) == []
    assert not (tmp_path / "toy-1.tmp").exists()


# -------------------------------------------------------------------------------------------- budget
def test_step_timeout_leaves_the_grace_and_skips_short_remainders():
    dc = _bench("device_check")
    assert dc.step_timeout(540, 10, 20) == 530
    assert dc.step_timeout(30.9, 10, 20) == 20
    assert dc.step_timeout(29.9, 10, 20) is None
    assert dc.step_timeout(-5, 10, 20) is None
    assert dc.step_timeout(10.5, 10, 0) is None  # never a zero-second timeout (coreutils: no limit)


def _sleep(seconds: float, rc: int = 0) -> tuple[str, ...]:
    return (sys.executable, "-c", f"import sys, time; time.sleep({seconds}); sys.exit({rc})")


def test_steps_finish_get_cut_at_the_deadline_and_are_skipped_after_it(tmp_path):
    dc = _bench("device_check")
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"runs": [{"wall_s": 1.5, "peak_gpu_mb": 10, "peak_rss_mb": 20}]}))
    steps = [dc.Step("quick", _sleep(0), result), dc.Step("slow", _sleep(60)), dc.Step("late", _sleep(0))]
    lines: list[dict] = []
    t0 = time.time()
    summary = dc.run_steps(steps, t0 + 5, grace_s=1, min_step_s=1, emit=lines.append)
    took = time.time() - t0
    assert 3 <= took < 8  # the slow step was stopped at its timeout, not left to run its 60 s
    assert [ln.get("step") for ln in lines] == ["quick", "slow", "late", None]
    assert lines[0]["status"] == "ok" and lines[0]["peak_gpu_mb"] == 10 and lines[0]["peak_rss_mb"] == 20
    assert lines[1]["status"] == "cut" and lines[1]["timeout_s"] <= 4
    assert lines[2]["status"] == "skipped"
    assert (summary["finished"], summary["cut"], summary["skipped"], summary["failed"]) == \
        (["quick"], ["slow"], ["late"], [])
    assert lines[-1] == summary and summary["summary"] is True
    assert dc.exit_status(summary, all_must_finish=False) == 0  # what ran succeeded; the rest is printed
    assert dc.exit_status(summary, all_must_finish=True) == 3


def test_a_failing_step_fails_the_check_and_the_next_still_runs():
    dc = _bench("device_check")
    lines: list[dict] = []
    summary = dc.run_steps([dc.Step("bad", _sleep(0, 7)), dc.Step("good", _sleep(0))], time.time() + 60,
                           grace_s=1, min_step_s=1, emit=lines.append)
    assert lines[0]["status"] == "failed" and lines[0]["exit_code"] == 7
    assert summary["finished"] == ["good"] and summary["failed"] == ["bad"]
    assert dc.exit_status(summary, all_must_finish=False) == 1
    nothing = {"finished": [], "cut": [], "skipped": ["a"], "failed": []}
    assert dc.exit_status(nothing, all_must_finish=False) == 3  # no step finished is not a success


def test_timeout_stops_the_steps_whole_process_tree(tmp_path):
    """scale.py starts `quantkit convert` as a child: a cut step must not leave it running."""
    dc = _bench("device_check")
    pidfile = tmp_path / "child.pid"
    parent = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    summary = dc.run_steps([dc.Step("tree", (sys.executable, "-c", parent))], time.time() + 4, grace_s=1,
                           min_step_s=1, emit=lambda rec: None)
    assert summary["cut"] == ["tree"]
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # killed, not yet reaped by its (dead) parent
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {child} outlived the cut")


# ------------------------------------------------------------------------------------ the whole script
SIM_VENV = REPO / ".device-sim-venv"


@pytest.mark.slow
@pytest.mark.skipif(not (SIM_VENV / ".complete").is_file() or not (REPO / ".device-wheels" / ".fetched").is_file(),
                    reason="needs the simulate venv and wheels: run `bash benchmarks/device_check.sh --simulate` "
                           "once (about a minute to build, needs the package index)")
def test_simulate_with_a_tiny_budget_skips_every_step_and_says_so():
    env = {**os.environ, "DEVICE_BUDGET_S": "1"}
    proc = subprocess.run(["bash", "benchmarks/device_check.sh", "--simulate"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.strip()]
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert [ln["status"] for ln in lines[:-1]] == ["skipped"] * 3
    assert lines[-1]["summary"] and lines[-1]["finished"] == [] and len(lines[-1]["skipped"]) == 3


def _shell_list(script: str, name: str) -> list[str]:
    import re
    m = re.search(rf'^{name}="([^"]*)"', script, re.M)
    assert m, f"{name}=... not found in benchmarks/device_check.sh"
    return [re.split(r"[=<>\[ ]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in m.group(1).split()]


def _requirement_closure(roots: list[str]) -> set[str]:
    """The distributions `pip install roots` brings in, read from this venv's metadata (extras left out)."""
    import importlib.metadata as md
    import re
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r]
    return seen


def test_every_package_the_conversion_numerics_import_reaches_the_device():
    """The GPU check's image plus the wheels it carries must hold every third-party package that the methods,
    the layer walk and the export import, lazily or not: a scipy/threadpoolctl import reached only inside the
    GPTQ factor once failed the simulated check after its import probe had passed."""
    import ast
    import importlib.metadata as md
    script = (REPO / "benchmarks" / "device_check.sh").read_text()
    image = _requirement_closure(_shell_list(script, "IMAGE")) - set(_shell_list(script, "NOT_IN_IMAGE"))
    there = image | set(_shell_list(script, "PURE")) | set(_shell_list(script, "BINARY"))
    there |= set(_shell_list(script, "OPTIONAL"))  # each proven optional below
    dists = {mod: {d.lower().replace("_", "-") for d in ds} for mod, ds in md.packages_distributions().items()}
    files = [*sorted((REPO / "quantkit" / "algorithms").glob("*.py")), *sorted((REPO / "quantkit" / "export").glob("*.py")),
             REPO / "quantkit" / "quantize" / "walk.py", REPO / "quantkit" / "quantize" / "layers.py",
             REPO / "quantkit" / "pipeline.py"]
    missing = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for top in {n.split(".")[0] for n in names}:
                if top in sys.stdlib_module_names or top == "quantkit":
                    continue
                if not dists.get(top, set()) & there:
                    missing.append(f"{f.relative_to(REPO)}: {top} ({sorted(dists.get(top, {'?'}))})")
    assert "scipy" in image and "numpy" in image, sorted(image)  # the closure was read, not empty
    assert not missing, missing


def test_gptq_runs_where_an_optional_package_is_missing():
    """The packages device_check.sh leaves out as OPTIONAL (numba) are imported behind a fallback: GPTQ in a
    process where importing each fails still finishes, through its torch loop, with GPTQ's advantage over
    round-to-nearest on correlated inputs (the device image and the simulated one have no numba)."""
    script = (REPO / "benchmarks" / "device_check.sh").read_text()
    optional = _shell_list(script, "OPTIONAL")
    assert optional == ["numba"], optional
    code = f"""
import sys
for name in {optional!r}:
    sys.modules[name] = None  # `import name` raises ImportError, as where it is not installed
import torch
from quantkit.algorithms import gptq, sweep_kernel
from quantkit.algorithms.rtn import rtn
from quantkit.schemes import WeightSpec
assert sweep_kernel.kernel() is None
g = torch.Generator().manual_seed(0)
W = torch.randn(96, 128, generator=g)
X = torch.randn(512, 128, generator=g) @ torch.randn(128, 128, generator=g)  # correlated inputs
H = 2 * X.t() @ X / X.shape[0]
spec = WeightSpec(4, "int", True, "group", 64)
r = gptq.gptq_solve(W, gptq.gptq_factor(H), spec, 64)
D = W - rtn(W, spec)[0]
print(r.noise / torch.trace(D @ H @ D.t()).item())
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.split()[-1]) < 0.9  # GPTQ's output error at most 90 % of round-to-nearest's
