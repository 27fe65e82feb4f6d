"""A deterministic stand-in for a served model: an in-process OpenAI-compatible HTTP server (prompt
log-probabilities, streamed completions, chat replies, /metrics) whose answers depend only on the request and
the served name ("baseline" / "candidate" differ a little), a vLLM engine type that serves through it, and a
deterministic lm-eval. Used by tests/test_eval_probes.py and benchmarks/report_schema_check.py."""

from __future__ import annotations

import hashlib
import http.server
import json
import math
import re
import threading
import types


class JSONHandler(http.server.BaseHTTPRequestHandler):
    """A quiet handler with one way to answer (a body and its length)."""

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _h(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def _prompt_logprobs(ids: list[int], k: int, model: str) -> list:
    out: list = [None]
    for i in range(1, len(ids)):
        top = [(_h("top", ids[i - 1], j) % 384) for j in range(k)]
        top = list(dict.fromkeys(top))
        if model == "candidate" and _h("swap", i) % 7 == 0:  # the candidate disagrees now and then
            top = top[1:] + top[:1]
        pos = {str(t): {"logprob": math.log(0.5 / (r + 1) ** 1.5), "rank": r + 1} for r, t in enumerate(top)}
        if str(ids[i]) not in pos:
            pos[str(ids[i])] = {"logprob": -3.0 - (_h("a", ids[i], model) % 100) / 50, "rank": k + 1}
        out.append(pos)
    return out


def _chat_reply(body: dict) -> str:
    text = json.dumps(body["messages"], sort_keys=True)
    pick = _h(text, body["model"] if _h(text) % 2 == 0 else "same") % 4
    if "<tools>" in text or body.get("tools"):
        name = re.search(r'"name\\?": ?\\?"([A-Za-z_0-9]+)', json.dumps(body, sort_keys=True))
        if pick == 0 or name is None:
            return "I don't know which function fits."
        return f'<tool_call>[{{"name": "{name.group(1)}", "arguments": {{}}}}]</tool_call>'
    if pick == 0:
        return "I'm sorry, but I can't help with that."
    if pick == 1 and body["model"] == "candidate":
        return "the the the the " * 12
    return f"Here is a plain answer about item {(_h(text) % 1000)}, written in a few short words for you."


METRICS = """vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0
vllm:kv_cache_usage_perc{engine="0"} 0.25
vllm:num_requests_running{engine="0"} 1.0
vllm:num_requests_waiting{engine="0"} 0.0
vllm:num_preemptions_total{engine="0"} 0.0
vllm:prompt_tokens_total{engine="0"} 100.0
vllm:generation_tokens_total{engine="0"} 50.0
"""


class _Handler(JSONHandler):
    protocol_version = "HTTP/1.1"
    failing: set = set()  # path prefixes answered with HTTP 500 (a test's broken engine)

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            return self._send(200, json.dumps({"data": [{"id": "baseline"}, {"id": "candidate"}]}).encode())
        if self.path.startswith("/version"):
            return self._send(200, b'{"version": "fake"}')
        if self.path.startswith("/metrics"):
            return self._send(200, METRICS.encode(), "text/plain")
        return self._send(404, b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if any(self.path.startswith(p) for p in self.failing):
            return self._send(500, b'{"error": "broken on purpose"}')
        if self.path.startswith("/reset_prefix_cache"):
            return self._send(200, b"{}")
        if self.path.startswith("/v1/chat/completions"):
            msg = {"role": "assistant", "content": _chat_reply(body)}
            return self._send(200, json.dumps({"choices": [{"message": msg}]}).encode())
        if body.get("prompt_logprobs") is not None:
            pl = _prompt_logprobs(body["prompt"], body["prompt_logprobs"], body["model"])
            return self._send(200, json.dumps({"choices": [{"text": "x", "prompt_logprobs": pl}]}).encode())
        if body.get("stream"):
            n = int(body.get("max_tokens") or 1)
            chunks = [{"choices": [{"text": "a"}]} for _ in range(n)] + [{"choices": [], "usage": {"completion_tokens": n}}]
            data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return self._send(200, data.encode(), "text/event-stream")
        return self._send(200, json.dumps({"choices": [{"text": "x"}]}).encode())


def serve(failing: tuple[str, ...] = ()) -> tuple[http.server.ThreadingHTTPServer, str]:
    """The stand-in server on a free port, in a thread; `failing`: path prefixes it answers with HTTP 500."""
    handler = type("Handler", (_Handler,), {"failing": set(failing)})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


class _Monitor:
    def snapshot(self) -> dict:
        return {"peak_rss_bytes": 300 * 2**20, "peak_pss_bytes": 200 * 2**20}


def fake_vllm(url: str):
    """ENGINES["vllm"]: the stand-in server as a started engine (runs while_loading like VLLMServer does)."""
    from quantkit.engine import Endpoint

    class FakeServer:
        monitor = _Monitor()

        def __init__(self, **kw):
            self.kw = kw

        def __enter__(self):
            if self.kw.get("while_loading"):
                self.kw["while_loading"]()
            return Endpoint("vllm", url, self.kw["served_name"], self.kw.get("tokenizer_dir"), version="fake",
                            info={"dtype": "float32", "dtype_reason": "the stand-in engine", "kv_cache_tokens": 1600})

        def __exit__(self, *exc):
            return None

    return FakeServer


def fake_lm_eval() -> dict:
    """{"lm_eval": ..., "lm_eval.tasks": ...} for sys.modules: a deterministic simple_evaluate, per task `limit`
    samples scored from a hash of the served model's name."""
    mod, tasks_mod = types.ModuleType("lm_eval"), types.ModuleType("lm_eval.tasks")

    def simple_evaluate(model, model_args, tasks, limit, **kw):
        results, samples = {}, {}
        for t in tasks:
            metric = "acc" if "cloze" in t else "exact_match"
            ok = [1.0 if _h(t, model_args["model"], i) % 3 else 0.0 for i in range(limit)]
            key = f"{metric},none"
            results[t] = {key: sum(ok) / len(ok), f"{metric}_stderr,none": 0.1, "alias": t}
            samples[t] = [{"doc_id": i, "target": "1", "filtered_resps": ["1"], metric: v} for i, v in enumerate(ok)]
        return {"results": results, "samples": samples}

    mod.simple_evaluate = simple_evaluate
    tasks_mod.TaskManager = lambda include_path=None: None
    mod.tasks = tasks_mod
    return {"lm_eval": mod, "lm_eval.tasks": tasks_mod}
