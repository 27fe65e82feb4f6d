"""A stand-in for vLLM with the real VLLMServer lifecycle: the "engine" is `python -m http.server` answering
/v1/models, so start, ready-wait, watchdog, records and stop run for real in a fast test."""

from __future__ import annotations

import sys

from quantkit.engine.vllm_server import VLLMServer


class FakeVLLM(VLLMServer):
    def command(self, port):
        site = self.run_dir / "site"
        (site / "v1").mkdir(parents=True, exist_ok=True)
        (site / "v1" / "models").write_text("{}")
        return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(site)]
