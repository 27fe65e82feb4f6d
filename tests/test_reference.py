"""The engine-free reference column (quantkit/evaluate/reference.py): its definitions, its windows (the
engine's exactly), its numbers against a by-hand float64 computation, and its place in the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from quantkit.evaluate import reference as R
from quantkit.evaluate.quality import windows

DEMO = Path.home() / ".cache" / "quantkit" / "models" / "smollm2-135m"


def _side(engine_ppl, ref_ppl):
    return {"quality": {"perplexity": engine_ppl}, "reference": {"perplexity": ref_ppl}}


def test_engine_gap_definition():
    # the W4A16 figures: engine 29.670 -> 39.358, reference 29.629 -> 38.289
    b, c = _side(29.670, 29.629), _side(39.358, 38.289)
    assert R.engine_vs_reference(29.670, 29.629) == pytest.approx(29.670 / 29.629 - 1)
    assert R.engine_gap(b, c) == pytest.approx((39.358 / 29.670) / (38.289 / 29.629) - 1)
    assert R.engine_gap(b, c) == pytest.approx(0.0266, abs=5e-4)
    assert R.engine_gap(b, b) == 0.0
    assert R.engine_gap(b, {"quality": {"perplexity": 39.0}}) is None  # no reference for the candidate
    assert R.engine_gap(b, dict(c, reference={"skipped": "too big"})) is None
    assert R.engine_vs_reference(None, 3.0) is None and R.engine_vs_reference(3.0, 0.0) is None


def test_metrics_table_and_report_lines():
    from quantkit.evaluate.metrics import metrics_table
    from quantkit.evaluate.report import _reference_lines

    b, c = _side(29.670, 29.629), _side(39.358, 38.289)
    t = metrics_table(b, c, None)
    assert t["quality.reference_perplexity"]["candidate"] == 38.289
    assert t["quality.engine_vs_reference"]["baseline"] == pytest.approx(29.670 / 29.629 - 1)
    assert t["quality.engine_gap"]["baseline"] == 0.0 and t["quality.engine_gap"]["candidate"] == pytest.approx(0.0266, abs=5e-4)
    assert t["quality.engine_gap"]["higher_is_better"] is False
    c["reference"].update(tokens=100, engine="transformers x", dtype="float32")
    lines = _reference_lines({"details": {"baseline": b, "candidate": c}, "metrics": t})
    assert any("**Flag" in x and "2.6%" in x for x in lines)  # 0.02645
    small = _side(39.0, 38.289)
    t2 = metrics_table(b, small, None)
    assert not any("**Flag" in x for x in _reference_lines({"details": {"baseline": b, "candidate": small}, "metrics": t2}))
    skipped = {"quality": {"perplexity": 39.0}, "reference": {"skipped": "float32 weights (~300 GiB) exceed"}}
    t3 = metrics_table(b, skipped, None)
    assert "quality.engine_gap" not in t3
    assert any("not computed (float32 weights" in x for x in
               _reference_lines({"details": {"baseline": b, "candidate": skipped}, "metrics": t3}))


def test_param_count_from_config(tmp_path):
    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 16,
           "tie_word_embeddings": True, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert R._param_count(tmp_path) == 2 * (4 * 64 + 3 * 8 * 16) + 10 * 8
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_key_value_heads=1)))  # k, v: 8 x 2 each
    assert R._param_count(tmp_path) == 2 * (2 * 64 + 2 * 16 + 3 * 8 * 16) + 10 * 8
    (tmp_path / "config.json").write_text("{}")
    assert R._param_count(tmp_path) is None


needs_demo = pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(),
                                reason="the demo model is not fetched (quantkit models fetch smollm2-135m)")


@needs_demo
def test_param_count_matches_the_demo_model():
    from safetensors import safe_open

    with safe_open(str(DEMO / "model.safetensors"), "pt") as f:
        weights = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "norm" not in k)
    assert R._param_count(DEMO) == weights  # exact, norms aside


@needs_demo
def test_reference_perplexity_scores_the_engines_windows(tmp_path):
    from quantkit.model.sources import load_tokenizer
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(DEMO)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    out = R.reference_perplexity(DEMO, [text], tok, window=64, max_tokens=200)
    ids = tok(text.read_text(), add_special_tokens=False)["input_ids"]
    wins = windows(ids, 64, 200)
    assert out["windows"]["positions"] == [len(w) - 1 for w in wins] and out["tokens"] == 200 - len(wins)
    # independent float64 computation, one window at a time, no padding
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32, use_safetensors=True).eval()
    sums = []
    with torch.no_grad():
        for w in wins:
            logits = model(input_ids=torch.tensor([w])).logits[0].double()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(w[1:]).unsqueeze(-1))
            sums.append(float(lp.sum()))
    assert out["windows"]["logprob_sum"] == pytest.approx(sums, rel=1e-4)
    assert out["perplexity"] == pytest.approx(math.exp(-sum(sums) / out["tokens"]), rel=1e-4)
    assert out["per_file"]["t.txt"]["tokens"] == out["tokens"] and out["dtype"] == "float32"


def test_too_big_for_memory_is_skipped_not_loaded(tmp_path, monkeypatch):
    cfg = {"hidden_size": 8192, "num_hidden_layers": 80, "vocab_size": 128256, "intermediate_size": 28672}
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # a 70B config, no weights: loading would fail
    out = R.reference_perplexity(tmp_path, [], None, 512, 4096)
    assert "skipped" in out and "GiB" in out["skipped"]
