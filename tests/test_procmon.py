"""The engine's memory figure (quantkit/engine/procmon.py): the kernel's high-water marks of the processes serving,
which keep a peak the samples missed and leave out a helper process that has exited."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantkit.engine.procmon import ProcessTreeMonitor, high_water_mark
from quantkit.evaluate.probes.memory import engine_bytes

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc (Linux only)")

MB256 = 256 << 20


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the test process exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_peak_between_samples_is_kept(tmp_path):
    """256 MB touched and freed before the first sample: the sampled RSS never sees it, the high-water mark does."""
    freed = tmp_path / "freed"
    code = (f"x = b'x' * {MB256}; del x; open({str(freed)!r}, 'w').close(); import sys; sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    monitor = ProcessTreeMonitor(interval_s=3600.0)  # no sample of its own: only the snapshot's
    try:
        _wait_for(freed, proc)
        monitor.start(proc.pid)
        snap = monitor.snapshot()
        assert snap["peak_rss_bytes"] < MB256  # what a sample sees: the block is gone
        assert snap["peak_hwm_bytes"] >= MB256  # what the process held at its peak
        assert engine_bytes({k: v for k, v in snap.items() if k.startswith("peak_")}) == snap["peak_hwm_bytes"]
    finally:
        monitor.stop()
        proc.communicate(b"", timeout=30)


def test_a_helper_process_that_exited_is_not_the_engine(tmp_path):
    """A child holding 256 MB counts while it lives (so the check below is not vacuous), and not once it has exited."""
    held, gone = tmp_path / "held", tmp_path / "gone"
    child = f"x = b'x' * {MB256}; open({str(held)!r}, 'w').close(); import sys; sys.stdin.read()"
    parent = ("import subprocess, sys\n"
              f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdin=subprocess.PIPE)\n"
              "sys.stdin.readline(); c.communicate(b''); "
              f"open({str(gone)!r}, 'w').close(); sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE)
    monitor = ProcessTreeMonitor(interval_s=3600.0)
    try:
        _wait_for(held, proc)
        monitor.start(proc.pid)
        monitor.sample()
        assert sum(monitor.hwm.values()) >= MB256
        assert len(monitor.hwm) == 2
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        _wait_for(gone, proc)
        snap = monitor.snapshot()
        assert snap["peak_hwm_bytes"] == high_water_mark(proc.pid)  # the parent alone: the helper has exited
        assert snap["peak_hwm_bytes"] < MB256
        assert snap["peak_rss_bytes"] >= MB256  # the sampled peak still holds the helper's share
    finally:
        monitor.stop()
        proc.communicate(b"", timeout=30)


def test_the_engine_figure_falls_back_in_order():
    """GPU memory where there is a GPU; else the high-water marks; the sampled PSS only where those are missing."""
    assert engine_bytes({"peak_gpu_bytes": 7e9, "peak_hwm_bytes": 3e9, "peak_pss_bytes": 2e9}) == 7e9
    assert engine_bytes({"peak_gpu_bytes": None, "peak_hwm_bytes": 3e9, "peak_pss_bytes": 2e9}) == 3e9
    assert engine_bytes({"peak_hwm_bytes": None, "peak_pss_bytes": 2e9}) == 2e9
    assert engine_bytes({}) is None
