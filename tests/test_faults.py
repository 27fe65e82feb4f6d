"""Fault injection: every command meets kill -9, a full disk, I/O errors, corrupt inputs, a second copy of
itself and a dead process's lock, and answers with one clear line and its documented exit code, loses
nothing, and leaves no engine behind.

Real faults where this machine allows them: SIGKILL of a real `quantkit convert` process at chosen
points (a wrapper script patches the point to kill its own process), a real tmpfs for the full disk
(mounting needs root; else the same ENOSPC is raised at the write boundary), real second processes for
the locks, a real watchdog and process group for the engine. The real-vLLM version of the engine case
is in tests/test_faults_slow.py.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import make_tiny_model, tiny_recipe, write_recipe

REPO = Path(__file__).resolve().parents[1]
GPTQ = [{"method": "gptq", "scheme": "W4A16", "group_size": 32}]


def _cli(*args: str):
    from typer.testing import CliRunner

    from quantkit.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def _one_line_error(res, code: int) -> str:
    """The command failed with `code` and said so in one line starting with `error:`, no traceback."""
    err = res.stderr if hasattr(res, "stderr") else res.output
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output, res.output
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture()
def model(tmp_path) -> Path:
    return make_tiny_model(tmp_path / "model")


@pytest.fixture()
def recipe_file(tmp_path, model, calib_text) -> Path:
    return write_recipe(tmp_path / "r.yaml", tiny_recipe(model, calib_text, GPTQ))


def _partials(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.endswith(".partial")]


# ---------------------------------------------------------------------------------- corrupt inputs
@pytest.mark.parametrize("damage, expected", [
    ("truncate", r"model.safetensors: not a complete safetensors file \(incomplete metadata, file not fully covered"),
    ("header", r"model.safetensors: not a complete safetensors file \(header too large"),
    ("config", r"config.json: not valid JSON \(line 1, column 2"),
    ("index", r"model.safetensors.index.json: 1 tensor\(s\) it maps are not in their file \(first: model.nope"),
    ("checksum", r"model.safetensors: sha256 differs from the one quantkit_source.json records"),
    ("tokenizer", r"the tokenizer files do not load"),
])
def test_corrupt_model_is_refused_before_any_work(tmp_path, model, recipe_file, damage, expected):
    import re

    from quantkit.io import sha256_file

    st = model / "model.safetensors"
    if damage == "truncate":
        with open(st, "r+b") as f:
            f.truncate(st.stat().st_size - 1000)
    elif damage == "header":
        with open(st, "r+b") as f:
            f.write((10 ** 12).to_bytes(8, "little"))  # a header longer than the file
    elif damage == "config":
        (model / "config.json").write_text("{not json")
    elif damage == "index":
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.nope": "model.safetensors"}}))
    elif damage == "checksum":
        (model / "quantkit_source.json").write_text(json.dumps({"files_sha256": {"model.safetensors": "0" * 64}}))
    elif damage == "tokenizer":
        (model / "tokenizer.json").write_text("{\"version\": 1, \"garbage\": ")
    res = _cli("convert", str(recipe_file), "-o", str(tmp_path / "out"), "-q")
    line = _one_line_error(res, 2)
    assert str(model) in line and re.search(expected, res.output), res.output
    assert not (tmp_path / "out").exists() and not _partials(tmp_path), "no work folder for a run that never started"
    if damage == "checksum":  # the message names the fix
        assert "re-download" in res.output and sha256_file(st) != "0" * 64


def test_invalid_utf8_calibration_is_warned_or_refused(tmp_path, model, caplog):
    calib = tmp_path / "calib"
    calib.mkdir()
    good = ("Plain calibration text about weights and scales. " * 40).encode()
    (calib / "a.txt").write_bytes(good[:300] + b"\xff\xfe bad \xc3" + good)
    r = tiny_recipe(model, calib, [{"method": "rtn", "scheme": "W8A8"}])
    r["calibration"]["num_samples"] = 2
    from quantkit import api
    from quantkit.data import DataError
    from quantkit.recipe import parse_recipe

    with caplog.at_level("WARNING", logger="quantkit"):
        api.convert(parse_recipe(r), tmp_path / "out", quiet=True)
    warned = [m for m in caplog.messages if "invalid UTF-8" in m]
    assert warned and "a.txt: invalid UTF-8 from byte 300 on; 3 character(s) replaced" in warned[0]
    r["calibration"]["sources"][0]["encoding"] = "strict"
    with pytest.raises(DataError, match=r"a.txt: invalid UTF-8 at byte 300 \(calibration.sources\[0\].encoding is strict\)"):
        api.convert(parse_recipe(r), tmp_path / "out2", quiet=True)


@pytest.mark.parametrize("patch, expected", [
    ({"stages": [{"method": "rtn", "scheme": "W8A8", "targets": []}]},
     "stages[0].targets: is empty, so the stage would quantize nothing"),
    ({"gates": [{"metric": "quality.perplexity", "op": "<=", "threshold": True}]},
     "gates[0].threshold: a boolean is not a number; write the threshold as a number"),
])
def test_recipe_refuses_empty_targets_and_boolean_thresholds(tmp_path, model, patch, expected):
    r = {**tiny_recipe(model, None, [{"method": "rtn", "scheme": "W8A8"}]), **patch}
    res = _cli("recipes", "validate", str(write_recipe(tmp_path / "r.yaml", r)))
    assert res.exit_code == 2 and expected in res.output, res.output


# ---------------------------------------------------------------------------------------- disk full
def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def test_full_disk_is_refused_up_front_with_the_space_needed(tmp_path, recipe_file):
    disk = tmp_path / "small"
    if not _mount_tmpfs(disk, "256k"):
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN); the ENOSPC-at-write test covers the rest")
    try:
        res = _cli("convert", str(recipe_file), "-o", str(disk / "out"), "-q")
        line = _one_line_error(res, 3)
        assert "free, and this conversion needs about" in line and str(disk) in line
        assert not list(disk.iterdir()), "nothing written to the full disk"
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_disk_full_mid_run_names_the_file_and_the_rerun_resumes(tmp_path, recipe_file, monkeypatch):
    """ENOSPC while the second layer's results are written: one line with the file, the space and that
    a rerun resumes; the rerun does, from layer 1, and gives the same bytes as an undisturbed run."""
    from quantkit.quantize import workdir

    ref = _cli("convert", str(recipe_file), "-o", str(tmp_path / "ref"), "-q")
    assert ref.exit_code == 0, ref.output
    real = workdir.save_typed

    def full(path, results):
        if path.name == "00001.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device", str(path.with_name(".00001.tmp")))
        return real(path, results)

    monkeypatch.setattr(workdir, "save_typed", full)
    res = _cli("convert", str(recipe_file), "-o", str(tmp_path / "out"), "-q")
    line = _one_line_error(res, 3)
    assert ".00001.tmp: no space left on device" in line and "free there; this run needs about" in line
    assert "Rerunning the same command resumes where it stopped" in line
    monkeypatch.setattr(workdir, "save_typed", real)  # (not undo(): that would also drop conftest's env)
    res = _cli("convert", str(recipe_file), "-o", str(tmp_path / "out"), "-q")
    assert res.exit_code == 0, res.output
    man = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert man["conversion"]["resumed_at_layer"] == 1
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()


def test_io_error_on_read_is_one_line(tmp_path, recipe_file, monkeypatch):
    from quantkit.model import checkpoint

    real = checkpoint.LazyCheckpoint.get_many

    def eio(self, keys):
        if any(".layers.1." in k for k in keys):
            raise OSError(errno.EIO, "Input/output error", str(self.folder / "model.safetensors"))
        return real(self, keys)

    monkeypatch.setattr(checkpoint.LazyCheckpoint, "get_many", eio)
    res = _cli("convert", str(recipe_file), "-o", str(tmp_path / "out"), "-q")
    line = _one_line_error(res, 3)
    assert "model.safetensors: I/O error while reading or writing it" in line and "resumes" in line


def test_unexpected_error_is_one_line_with_a_log(tmp_path, recipe_file, monkeypatch):
    from quantkit.quantize import layers

    def bug(*a, **k):
        raise ZeroDivisionError("simulated bug")

    monkeypatch.setattr(layers, "quantize_group", bug)
    res = _cli("convert", str(recipe_file), "-o", str(tmp_path / "out"), "-q")
    line = _one_line_error(res, 4)
    assert "internal error (ZeroDivisionError: simulated bug)" in line
    log = Path(line.split("the traceback is in ")[1].split(". Rerun")[0])
    assert "Traceback" in log.read_text() and "simulated bug" in log.read_text()
    with pytest.raises(ZeroDivisionError):  # --debug lets it through
        _cli("--debug", "convert", str(recipe_file), "-o", str(tmp_path / "out2"), "-q")


# ------------------------------------------------------------------------------------------ kill -9
KILLER = textwrap.dedent("""
    import os, signal, sys
    point = sys.argv.pop(1)

    def die_after(module, name, when=lambda *a: True):
        \"\"\"Replace module.name by a wrapper that runs it, then kills this process when `when(args)`.\"\"\"
        real = getattr(module, name)
        def wrapped(*a, **k):
            out = real(*a, **k)
            if when(*a):
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        setattr(module, name, wrapped)

    if point == "after-layer-0":
        from quantkit.quantize import workdir
        die_after(workdir.WorkDir, "save_layer", lambda self, index, *a: index == 0)
    elif point == "mid-layer-file":  # layer 1's temporary file is written, its rename has not happened
        from quantkit.quantize import workdir
        die_after(workdir, "save_file", lambda tensors, path, *a: str(path).endswith("/.00001.tmp"))
    elif point == "mid-compress":
        from quantkit.export import artifact
        die_after(artifact, "save_file")
    elif point == "mid-shards":
        from quantkit.export import shards
        die_after(shards, "write_file")
    elif point == "at-rename":
        from quantkit import pipeline
        pipeline.replace_dir = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)  # instead of the rename
    from quantkit.cli import app
    app()
""")


@pytest.mark.parametrize("point", ["after-layer-0", "mid-layer-file", "mid-compress", "mid-shards", "at-rename"])
def test_kill_9_at_any_point_then_rerun_gives_the_same_bytes(tmp_path, recipe_file, point):
    ref = _cli("convert", str(recipe_file), "-o", str(tmp_path / "ref"), "-q")
    assert ref.exit_code == 0, ref.output
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(killer), point, "convert", str(recipe_file), "-o", str(out), "-q"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-2000:])
    assert not out.exists(), "the output appears only when complete"
    res = _cli("convert", str(recipe_file), "-o", str(out), "-q")  # the same command, again
    assert res.exit_code == 0, res.output
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()
    man = json.loads((out / "manifest.json").read_text())
    assert man["conversion"]["resumed_at_layer"] == {"after-layer-0": 1, "mid-layer-file": 1}.get(point, 2)
    assert not _partials(tmp_path) and not list(tmp_path.glob(".*.lock"))


# -------------------------------------------------------------------------------------------- locks
HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from quantkit.locks import exclusive
    with exclusive(Path(sys.argv[1]), "test"):
        print("held", flush=True)
        time.sleep(120)
""")


def _hold_lock(tmp_path: Path, lock: Path) -> subprocess.Popen:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    p = subprocess.Popen([sys.executable, str(script), str(lock)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_convert_of_the_same_output_is_refused_naming_the_holder(tmp_path, recipe_file, caplog):
    from quantkit.locks import lock_beside

    out = tmp_path / "out"
    holder = _hold_lock(tmp_path, lock_beside(out))
    try:
        res = _cli("convert", str(recipe_file), "-o", str(out), "-q")
        line = _one_line_error(res, 2)
        assert f"a conversion into {out} is in progress in PID {holder.pid}" in line
        assert not _partials(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    # the holder died by SIGKILL: its lock file is stale, and the next run takes it over
    assert json.loads(lock_beside(out).read_text())["pid"] == holder.pid
    with caplog.at_level("WARNING", logger="quantkit"):
        res = _cli("convert", str(recipe_file), "-o", str(out), "-q")
    assert res.exit_code == 0, res.output
    assert any(f"took over the lock on a conversion into {out} from PID {holder.pid}" in m for m in caplog.messages)
    assert not lock_beside(out).exists()


def test_eval_and_publish_hold_their_locks(tmp_path, model):
    from quantkit import api, registry
    from quantkit.errors import LockHeld
    from quantkit.evaluate import run_eval
    from quantkit.locks import exclusive, lock_beside

    from quantkit.recipe import parse_recipe

    art = api.convert(parse_recipe(tiny_recipe(model, None, [{"method": "rtn", "scheme": "W8A8"}])), tmp_path / "art",
                      quiet=True)
    out = tmp_path / "report"
    with exclusive(lock_beside(out), "held by the test"):
        with pytest.raises(LockHeld, match=rf"an eval into {out} is in progress in PID {os.getpid()}"):
            run_eval(None, model, "smoke", out, candidate_url="http://127.0.0.1:9")
    with exclusive(registry.publish_lock(None, "tiny"), "held by the test"):
        with pytest.raises(LockHeld, match=rf"a publish of 'tiny' is in progress in PID {os.getpid()}"):
            registry.publish(art, name="tiny")


# --------------------------------------------------------------------------------------- no orphans
ENGINE_OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from _fake_engine import FakeVLLM  # the real lifecycle, with a stand-in server that answers /v1/models

    srv = FakeVLLM(Path(sys.argv[1]), Path(sys.argv[2]), "candidate", ready_timeout_s=60)
    ep = srv.__enter__()
    print(ep.pid, ep.base_url.rsplit(":", 1)[1], flush=True)
    time.sleep(300)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_engine_dies_with_quantkit_under_kill_9_and_its_record_is_cleaned(tmp_path, model):
    from quantkit.engine.vllm_server import stop_stale_engines

    script = tmp_path / "owner.py"
    script.write_text(ENGINE_OWNER)
    run_dir = tmp_path / "run"
    owner = subprocess.Popen([sys.executable, str(script), str(model), str(run_dir)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"})
    pid, port = map(int, owner.stdout.readline().split())
    record = json.loads((run_dir / "engines" / "candidate.json").read_text())
    assert record["pid"] == pid and record["owner_pid"] == owner.pid and _alive(pid) and not _port_free(port)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the engine outlived quantkit"
    while _alive(record["watchdog_pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(record["watchdog_pid"]) and _port_free(port)
    assert (run_dir / "engines" / "candidate.json").is_file()  # quantkit died: the record stays ...
    assert stop_stale_engines(run_dir) == []  # ... and the next run in the folder removes it
    assert not (run_dir / "engines" / "candidate.json").exists()


def test_a_stale_engine_recorded_in_the_run_folder_is_stopped(tmp_path, model):
    """An engine left running (its quantkit and watchdog both gone) is found by its record and stopped;
    a process that merely reused the PID (another command line) is left alone."""
    from quantkit.engine.vllm_server import stop_stale_engines

    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "vllm", str(model)],
                            start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    engines = tmp_path / "engines"
    engines.mkdir()
    for name, p in (("candidate", fake), ("baseline", other)):
        (engines / f"{name}.json").write_text(json.dumps({"pid": p.pid, "pgid": p.pid, "port": 1, "model": str(model),
                                                          "owner_pid": dead.pid}))
    try:
        assert stop_stale_engines(tmp_path, grace_s=5) == [fake.pid]
        assert fake.wait(timeout=10) is not None and other.poll() is None
        assert not list(engines.iterdir())
    finally:
        for p in (fake, other):
            p.kill()
            p.wait()


def test_work_while_the_engine_loads_runs_before_ready_and_a_failure_in_it_stops_the_engine(tmp_path, model):
    """The eval computes the reference perplexity while the engine boots (VLLMServer's while_loading): it runs
    with the engine process up but before the ready wait, and an exception in it leaves no engine behind."""
    from _fake_engine import FakeVLLM

    seen = {}

    def work():
        seen["engine_running"] = srv.proc is not None and srv.proc.poll() is None
        seen["ready_yet"] = srv.start_s is not None

    srv = FakeVLLM(model, tmp_path / "ok", "candidate", ready_timeout_s=60, while_loading=work)
    with srv as ep:
        assert ep.info["while_loading_s"] >= 0
    assert seen == {"engine_running": True, "ready_yet": False}

    def boom():
        raise RuntimeError("reference failed")

    bad = FakeVLLM(model, tmp_path / "bad", "candidate", ready_timeout_s=60, while_loading=boom)
    with pytest.raises(RuntimeError, match="reference failed"):
        bad.__enter__()
    assert bad.proc.poll() is not None and not (tmp_path / "bad" / "engines" / "candidate.json").exists()
