"""Does report.json keep its schema? One deterministic eval, written and normalized for a diff.

    python benchmarks/report_schema_check.py OUT            # writes OUT/{fresh,cached}/report.{json,md} + .norm
    python benchmarks/report_schema_check.py --compare A B  # diffs two OUTs' normalized reports (exit 1 if they differ)

A tiny W8A8 artifact (tests/conftest.py's tiny model) is evaluated twice with the `smoke` suite plus one serving
variant: first with a fresh baseline (stored in the baseline cache), then reusing it. The engine is a stand-in
for vLLM: an in-process HTTP server that answers the OpenAI API deterministically (prompt log-probabilities,
streamed completions, chat replies, /metrics), and lm-eval is replaced by a deterministic `simple_evaluate`.
Everything else is quantkit's own code: the probes, the engine-free reference, the baseline cache, metrics,
intervals, plots, report.json and report.md. Wall-clock figures (timings, latencies, throughputs, cost, the
created stamp) are masked in the .norm files; everything else must match byte for byte.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import http.server
import json
import math
import re
import shutil
import sys
import threading
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/qk-report-schema-work")  # fixed, so the paths recorded in the report are the same every run


def _h(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


# ----------------------------------------------------------------------------- the stand-in server
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


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    failing: set = set()  # path prefixes answered with HTTP 500 (a test's broken engine)

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

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


# ----------------------------------------------------------------------------- the evals
def run(out: Path) -> None:
    import os

    import yaml

    sys.path.insert(0, str(REPO / "tests"))
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    os.environ["QUANTKIT_HOME"] = str(WORK / "home")
    from conftest import make_tiny_model, tiny_recipe

    from quantkit import api
    from quantkit import engine as engine_mod
    from quantkit.recipe import parse_recipe
    from quantkit.resources import shipped

    base = make_tiny_model(WORK / "base")
    art = api.convert(parse_recipe(tiny_recipe(base, None, [{"method": "rtn", "scheme": "W8A8"}])), WORK / "art",
                      quiet=True)
    suite = yaml.safe_load(shipped("evals", "suites", "smoke.yaml").read_text())
    suite["variants"] = [{"name": "pc", "engine_args": {"enable_prefix_caching": True}}]
    (WORK / "suite.yaml").write_text(yaml.safe_dump(suite))
    srv, url = serve()
    engine_mod.ENGINES["vllm"] = fake_vllm(url)
    sys.modules.update(fake_lm_eval())
    from quantkit.evaluate import run_eval

    try:
        for label, fresh in (("fresh", True), ("cached", False)):
            folder = run_eval(art, suite=WORK / "suite.yaml", output=WORK / f"eval-{label}", overwrite=True,
                              fresh_baseline=fresh, progress=lambda m: None)
            dest = out / label
            dest.mkdir(parents=True, exist_ok=True)
            for name in ("report.json", "report.md"):
                shutil.copy(folder / name, dest / name)
            (dest / "report.json.norm").write_text(json.dumps(normalize(json.loads((folder / "report.json").read_text())),
                                                             indent=1, sort_keys=True) + "\n")
            (dest / "report.md.norm").write_text(normalize_md((folder / "report.md").read_text()))
    finally:
        srv.shutdown()
    print(f"wrote {out}/fresh and {out}/cached")


# ----------------------------------------------------------------------------- normalizing wall-clock figures
TIMED_KEYS = {"created", "wall_s", "timings", "start_s", "while_loading_s", "reused", "seconds",
              "manifest_sha256"}  # the manifest records when it was written
TIMED_PREFIXES = ("speed.", "cost.")


def _mask(x):
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, (int, float)):
        return "<num>"
    if isinstance(x, str) and re.fullmatch(r"[0-9a-f]{64}", x):
        return "<sha256>"
    if isinstance(x, str):
        return re.sub(r"\d+(\.\d+)?", "#", x)
    if isinstance(x, dict):
        return {k: _mask(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_mask(v) for v in x]
    return x


def normalize(x, path: tuple = ()):
    """The report with wall-clock-dependent values masked (their keys and types stay)."""
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            timed = (k in TIMED_KEYS or k in ("speed", "cost", "where_the_wait_is", "engine_metrics")
                     or k.startswith(TIMED_PREFIXES) or (path[-1:] == ("reused",)))
            if k == "where_the_wait_is":  # sentences chosen by the measured latencies
                out[k] = sorted(v) if isinstance(v, dict) else _mask(v)
            else:
                out[k] = _mask(v) if timed else normalize(v, path + (k,))
        return out
    if isinstance(x, list):
        return [normalize(v, path) for v in x]
    return x


def normalize_md(text: str) -> str:
    out, timed = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            timed = line[3:].split(" ")[0] in ("Speed", "Cost", "Where", "Serving")
        if timed and line.startswith("- "):  # "where the wait is": sentences chosen by the measured latencies
            continue
        if timed or "wall time" in line or "reused" in line:
            line = re.sub(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "#", line)
        out.append(line)
    return "\n".join(out) + "\n"


def compare(a: Path, b: Path) -> int:
    same = True
    for label in ("fresh", "cached"):
        for name in ("report.json.norm", "report.md.norm"):
            x, y = (a / label / name).read_text().splitlines(), (b / label / name).read_text().splitlines()
            diff = list(difflib.unified_diff(x, y, f"{a}/{label}/{name}", f"{b}/{label}/{name}", lineterm="", n=1))
            print(f"{label}/{name}: {'identical' if not diff else f'{len(diff)} diff lines'}")
            if diff:
                same = False
                print("\n".join(diff[:200]))
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    run(args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
