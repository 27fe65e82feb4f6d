"""Inference engines behind one interface: something that serves the OpenAI-compatible HTTP API.

Every measurement in `quantkit eval` (perplexity, divergence, lm-eval tasks, speed) goes through that
API, so an engine is fully described by an `Endpoint` (base URL, served model name, tokenizer folder)
plus optional process facts (PIDs for memory, a log to parse). Two engine types, registered
explicitly in `ENGINES`:

- `vllm`: `quantkit.engine.vllm_server.VLLMServer` starts `python -m vllm.entrypoints.openai.api_server`
  on 127.0.0.1 and a free port, waits for readiness, keeps the log in the run folder and shuts it down
  on exit, error or Ctrl-C.
- `openai`: `ExternalServer` measures a server someone else started (SGLang, TGI, another vLLM) by URL.
  Nothing is started or stopped; memory and log-derived figures are unavailable and reported as null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class EngineError(RuntimeError):
    """The engine could not start or answer; the message says what to check."""


@dataclass
class Endpoint:
    """How to reach a served model. `base_url` ends without /v1 (e.g. http://127.0.0.1:8000)."""

    engine: str  # "vllm" | "openai"
    base_url: str
    model: str  # the served model name to put in requests
    tokenizer_dir: Path | None
    version: str | None = None
    log_path: Path | None = None
    pid: int | None = None  # root process of the engine (None for external servers)
    info: dict = field(default_factory=dict)  # engine-reported facts parsed at start (kv tokens, ...)


class ExternalServer:
    """The `openai` engine type: an already-running OpenAI-compatible server, measured by URL."""

    name = "openai"

    def __init__(self, url: str, model: str | None = None, tokenizer_dir: Path | None = None) -> None:
        url = url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url
        self.model = model
        self.tokenizer_dir = tokenizer_dir

    def __enter__(self) -> Endpoint:
        import httpx

        try:
            r = httpx.get(f"{self.base_url}/v1/models", timeout=10)
            r.raise_for_status()
            served = [m["id"] for m in r.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise EngineError(f"{self.base_url}/v1/models did not answer ({exc}); is the server running "
                              "and is the URL its base (http://host:port or http://host:port/v1)?") from None
        if self.model is None:
            if not served:
                raise EngineError(f"{self.base_url} serves no models")
            self.model = served[0]
        elif served and self.model not in served:
            raise EngineError(f"{self.base_url} serves {served}, not {self.model!r}")
        version = None
        try:
            v = httpx.get(f"{self.base_url}/version", timeout=5)
            if v.status_code == 200:
                version = v.json().get("version")
        except (httpx.HTTPError, ValueError):
            version = None
        return Endpoint("openai", self.base_url, self.model, self.tokenizer_dir, version=version)

    def __exit__(self, *exc) -> None:
        return None


def _vllm(**kw):
    from quantkit.engine.vllm_server import VLLMServer

    return VLLMServer(**kw)


ENGINES = {"vllm": _vllm, "openai": ExternalServer}
