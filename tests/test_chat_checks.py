"""The chat checks' runner (quantkit/evaluate/probes/chat.py) on a loopback chat server, and their place
in the metrics table, the intervals, the gate names and report.md. Scoring itself: tests/test_checks.py."""

from __future__ import annotations

import http.server
import json
import re
import threading
from types import SimpleNamespace

import pytest

import quantkit.evaluate.probes.chat as CC
import quantkit.evaluate.check_rules as C

TOOLS = CC.load_items("tools")
SAFETY = CC.load_items("safety")


class _ChatServer:
    """Answers /v1/chat/completions with `answer(body) -> str` and records every body it got."""

    def __init__(self, answer):
        outer = self
        self.bodies: list[dict] = []
        self.lock = threading.Lock()

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.bodies.append(body)
                if self.path != "/v1/chat/completions":
                    code, data = 404, b"{}"
                else:
                    text = answer(body)
                    code, data = (500, b"boom") if text is None else (
                        200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode())
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.ep = SimpleNamespace(base_url=f"http://127.0.0.1:{self.server.server_address[1]}", model="m")
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _user_text(body):
    return next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")


def _by_user_text(items, key):
    return {key(it): it for it in items}


TOOL_BY_ASK = _by_user_text(TOOLS, lambda it: it["messages"][-1]["content"])
SAFETY_BY_PROMPT = _by_user_text(SAFETY, lambda it: it["prompt"])


def _good_model(body):
    """Calls the expected tool exactly (SmolLM2 format); refuses every harmful prompt, answers benign ones."""
    ask = _user_text(body)
    if ask in TOOL_BY_ASK:
        exp = TOOL_BY_ASK[ask]["expected"]
        return "The weather is fine." if exp is None else f"<tool_call>[{json.dumps(exp)}]"  # stopped at </tool_call>
    return "I'm sorry, but I can't help with that." if SAFETY_BY_PROMPT[ask]["kind"] == "harmful" else "Sure: here is how."


def _worse_model(body):
    """Like _good_model, but its first 10 tool items get a wrong argument, 3 harmful prompts are answered,
    and one request fails with HTTP 500."""
    ask = _user_text(body)
    if ask in TOOL_BY_ASK:
        it = TOOL_BY_ASK[ask]
        if it["id"] == TOOLS[20]["id"]:
            return None
        if it["id"] in {t["id"] for t in TOOLS[:10]} and it["expected"] is not None:
            exp = json.loads(json.dumps(it["expected"]))
            exp["arguments"]["_extra"] = 1
            return f"<tool_call>[{json.dumps(exp)}]</tool_call>"
        return _good_model(body)
    harmful = [s["id"] for s in SAFETY if s["kind"] == "harmful"][:3]
    if SAFETY_BY_PROMPT[ask]["id"] in harmful:
        return "Step one: gather the tools."
    return _good_model(body)


class _Tok:
    """A stand-in tokenizer: a chat template, and one token per 3 characters."""

    def __init__(self, template):
        self.chat_template = template

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(range((len(text) + 2) // 3))}


def test_data_files_meet_the_issue_sizes():
    assert len(TOOLS) >= 100 and len(SAFETY) >= 100
    cats = {t["category"] for t in TOOLS}
    assert {"single", "choice", "nested", "numeric", "enum"} <= cats and any(t["expected"] is None for t in TOOLS)
    kinds = [s["kind"] for s in SAFETY]
    assert kinds.count("harmful") >= 40 and kinds.count("benign") >= 40
    # a prefix (check_limit) keeps both halves and several tool categories
    assert {s["kind"] for s in SAFETY[:8]} == {"harmful", "benign"}
    assert len({t["category"] for t in TOOLS[:8]}) >= 4


def test_tools_go_into_the_system_message_unless_the_template_renders_them():
    item = TOOLS[2]
    plain = CC.tool_request(item, native_tools=False)
    assert "tools" not in plain and plain["messages"][0]["role"] == "system"
    sysmsg = plain["messages"][0]["content"]
    inner = re.search(r"<tools>(.*)</tools>", sysmsg, re.S).group(1)
    assert json.loads(inner) == [t["function"] for t in item["tools"]]  # the schemas, exactly
    assert plain["messages"][1:] == item["messages"] and "<tool_call>" in sysmsg
    # an existing system message is kept, after the tool list
    with_sys = dict(item, messages=[{"role": "system", "content": "Be brief."}, *item["messages"]])
    msgs = CC.tool_request(with_sys, native_tools=False)["messages"]
    assert len(msgs) == len(with_sys["messages"]) and msgs[0]["content"].endswith("\n\nBe brief.")
    assert with_sys["messages"][0]["content"] == "Be brief."  # the item is not modified
    native = CC.tool_request(item, native_tools=True)
    assert native == {"messages": item["messages"], "tools": item["tools"], "tool_choice": "none"}
    assert CC.template_renders_tools(_Tok("{% if tools %}{{ tools | tojson }}{% endif %}"))
    assert not CC.template_renders_tools(_Tok("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"))
    assert not CC.template_renders_tools(_Tok(None))
    assert CC.template_renders_tools(_Tok({"default": "x", "tool_use": "{{ tools }}"})) is False
    assert CC.template_renders_tools(_Tok({"tool_use": "{{ tools }}"}))


def test_every_expected_call_fits_its_budget_in_the_demo_tokenizer():
    from pathlib import Path

    demo = Path.home() / ".cache" / "quantkit" / "models" / "smollm2-135m"
    if not (demo / "tokenizer_config.json").is_file():
        pytest.skip("the demo model is not fetched (quantkit models fetch smollm2-135m)")
    from quantkit.model.sources import load_tokenizer

    tok = load_tokenizer(demo)
    called = [t for t in TOOLS if t["expected"] is not None]
    for t in called:  # the expected reply, pretty-printed, still fits: a correct answer is never cut
        pretty = f"<tool_call>\n{json.dumps([t['expected']], indent=1)}\n</tool_call>"
        assert len(tok(pretty, add_special_tokens=False)["input_ids"]) <= CC.tool_max_tokens(t, tok), t["id"]
    mean = sum(CC.tool_max_tokens(t, tok) for t in TOOLS) / len(TOOLS)
    assert mean < 100, mean  # well under the one budget of 160 that every request had before


def test_demo_template_does_not_render_tools():
    from pathlib import Path

    demo = Path.home() / ".cache" / "quantkit" / "models" / "smollm2-135m"
    if not (demo / "tokenizer_config.json").is_file():
        pytest.skip("the demo model is not fetched (quantkit models fetch smollm2-135m)")
    from quantkit.model.sources import load_tokenizer

    assert CC.template_renders_tools(load_tokenizer(demo)) is False


def test_run_checks_scores_and_compares_on_a_chat_server():
    good, worse = _ChatServer(_good_model), _ChatServer(_worse_model)
    try:
        tok = _Tok(None)
        base = CC.run_checks(good.ep, ["tools", "safety"], None, 4, tok, progress=lambda m: None)
        cand = CC.run_checks(worse.ep, ["tools", "safety"], None, 4, tok, progress=lambda m: None)
    finally:
        good.close()
        worse.close()
    assert len(good.bodies) == len(TOOLS) + len(SAFETY)
    tool_bodies = [b for b in good.bodies if "stop" in b]
    assert len(tool_bodies) == len(TOOLS)
    assert all(b["temperature"] == 0.0 and b["stop"] == ["</tool_call>"] for b in tool_bodies)
    budgets = {b["messages"][-1]["content"]: b["max_tokens"] for b in tool_bodies}
    for t in TOOLS:  # per item: room for the expected call (1.25 x its tokens + 24), a short reply where none is
        want = CC.NO_CALL_MAX_TOKENS if t["expected"] is None else \
            int(1.25 * ((len(CC.expected_reply(t["expected"])) + 2) // 3)) + 24
        assert budgets[t["messages"][-1]["content"]] == want, t["id"]
    assert base["tools"]["records"][0]["max_tokens"] == CC.tool_max_tokens(TOOLS[0], tok)
    assert all(b["max_tokens"] == CC.SAFETY_MAX_TOKENS for b in good.bodies if "stop" not in b)
    CC.compare_checks(base, base)
    CC.compare_checks(base, cand)
    n_t, n_s = len(TOOLS), len(SAFETY)
    # the baseline model is perfect by construction; against itself it agrees everywhere
    assert base["tools"]["valid_rate"]["value"] == 1.0 and base["tools"]["exact_accuracy"]["value"] == 1.0
    assert base["tools"]["baseline_agreement"]["value"] == 1.0 and base["tools"]["errors"] == 0
    assert base["safety"]["refusal_rate_harmful"]["value"] == 1.0
    assert base["safety"]["refusal_rate_benign"]["value"] == 0.0 and base["safety"]["flip_rate"]["value"] == 0.0
    # the candidate: wrong arguments on the called items among the first 10, one failed request
    wrong = [t["id"] for t in TOOLS[:10] if t["expected"] is not None]
    failed = TOOLS[20]["id"]
    ct = cand["tools"]
    assert ct["errors"] == 1 and next(r for r in ct["records"] if r["id"] == failed)["error"].startswith("HTTP 500")
    bad = len(wrong) + 1
    assert ct["baseline_agreement"]["successes"] == n_t - bad and ct["baseline_agreement"]["items"] == n_t
    assert set(ct["disagreements"]) == set(wrong) | {failed}
    assert ct["valid_rate"]["successes"] == ct["name_accuracy"]["successes"] == n_t - 1  # the failed request
    assert ct["exact_accuracy"]["successes"] == n_t - bad
    assert ct["baseline_agreement"]["ci95"] == list(C.wilson(n_t - bad, n_t))
    cs = cand["safety"]
    answered = [s["id"] for s in SAFETY if s["kind"] == "harmful"][:3]
    harmful = sum(s["kind"] == "harmful" for s in SAFETY)
    assert cs["refusal_rate_harmful"]["successes"] == harmful - 3
    assert cs["flip_rate"]["successes"] == 3 and cs["flip_rate"]["items"] == n_s
    assert cs["flips"] == answered and cs["flips_answered_harmful"] == answered
    # the worst flips are quoted with the prompt and both replies
    quotes = CC.quoted_differences(base, cand)
    assert [q["id"] for q in quotes["safety"]] == answered
    assert quotes["safety"][0]["baseline_refused"] and not quotes["safety"][0]["candidate_refused"]
    assert quotes["safety"][0]["candidate"] == "Step one: gather the tools."
    assert [q["id"] for q in quotes["tools"]] == [t["id"] for t in TOOLS if t["id"] in set(wrong) | {failed}][:5]


def test_limit_takes_a_prefix_and_a_dead_server_is_an_error():
    srv = _ChatServer(lambda body: None)  # every request fails
    try:
        out = CC.run_checks(srv.ep, ["safety"], 6, 2, _Tok(None), progress=lambda m: None)
    finally:
        srv.close()
    assert len(srv.bodies) == 6 and "every request failed" in out["safety"]["error"]
    assert CC.compare_checks(None, out) is None and "flip_rate" not in out["safety"]


def _sides():
    good, worse = _ChatServer(_good_model), _ChatServer(_worse_model)
    try:
        base = CC.run_checks(good.ep, ["tools", "safety"], None, 4, _Tok(None), progress=lambda m: None)
        cand = CC.run_checks(worse.ep, ["tools", "safety"], None, 4, _Tok(None), progress=lambda m: None)
    finally:
        good.close()
        worse.close()
    CC.compare_checks(base, base)
    CC.compare_checks(base, cand)
    return {"checks": base}, {"checks": cand}


def test_checks_in_metrics_gates_and_report(tmp_path):
    from quantkit.evaluate.metrics import metrics_table
    from quantkit.evaluate.catalogue import METRIC_PATTERNS
    from quantkit.evaluate.report import render_markdown, build_report
    from quantkit.evaluate.suite import load_suite
    from quantkit.gates import evaluate_gate
    from quantkit.recipe import GateSpec

    base, cand = _sides()
    table = metrics_table(base, cand, None)
    names = ("tools.valid_rate", "tools.baseline_agreement", "tools.name_accuracy", "tools.exact_accuracy",
             "safety.flip_rate", "safety.refusal_rate_harmful", "safety.refusal_rate_benign")
    for name in names:
        assert name in table and any(re.fullmatch(p, name) for p in METRIC_PATTERNS), name
        assert table[name]["ci95"]["candidate"] == cand["checks"][name.split(".")[0]][name.split(".")[1]]["ci95"]
    assert table["safety.flip_rate"] == {**table["safety.flip_rate"], "baseline": 0.0, "higher_is_better": False}
    assert table["safety.flip_rate"]["candidate"] == pytest.approx(3 / len(SAFETY))
    assert table["safety.refusal_rate_benign"]["higher_is_better"] is False
    assert table["tools.baseline_agreement"]["higher_is_better"] is True
    # a gate on the point passes; the same gate with confidence 0.95 fails on the interval, saying so
    point = GateSpec(metric="safety.flip_rate", op="<=", threshold=0.05)
    sure = GateSpec(metric="safety.flip_rate", op="<=", threshold=0.05, confidence=0.95)
    res = [evaluate_gate(g, table) for g in (point, sure)]
    assert [r.passed for r in res] == [True, False] and "inconclusive" in res[1].reason

    context = {"artifact": {"path": "/a", "name": "art", "quantization": None}, "baseline": {"path": "/b", "url": None},
               "suite": load_suite("default").model_dump(mode="json"),
               "hardware": {"cpu": "test cpu", "cpu_count": 2, "memory_bytes": 2**30}, "wall_s": 1.0,
               "workload_items": []}
    r = build_report(context, base, cand, [])
    assert "records" not in r["details"]["candidate"]["checks"]["tools"]  # the records stay in raw/
    assert r["checks"]["safety"]["candidate"] == {"items": len(SAFETY), "errors": 0, "max_tokens": CC.SAFETY_MAX_TOKENS}
    md = render_markdown(r)
    assert "## Tool calls" in md and "## Safety" in md and "tools in the system message" in md
    flip = CC.quoted_differences(base["checks"], cand["checks"])["safety"][0]
    assert f"`{flip['id']}` (harmful)" in md and "candidate answers: 'Step one: gather the tools.'" in md
    assert re.search(r"\| safety\.flip_rate ↓ \| 0\.000 \[0\.000, 0\.0\d\d\] \| 0\.025 \[", md)
