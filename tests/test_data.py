"""Calibration data: every source type, packing, determinism, fingerprints, and the errors users see."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from quantkit.data import DataError, build_calibration_set
from quantkit.recipe import CalibrationSpec


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _spec(sources, **kw):
    return CalibrationSpec.model_validate({"sources": sources, "num_samples": kw.get("n", 4),
                                          "seq_len": kw.get("seq", 16), "seed": kw.get("seed", 0)})


def test_text_packing_is_deterministic_and_fingerprinted(tok, calib_text):
    spec = _spec([{"type": "text", "path": str(calib_text / "*.txt")}])
    a, b = build_calibration_set(spec, tok), build_calibration_set(spec, tok)
    assert a.input_ids.shape == (4, 16)
    assert a.fingerprint == b.fingerprint and (a.input_ids == b.input_ids).all()
    c = build_calibration_set(_spec([{"type": "text", "path": str(calib_text / "*.txt")}], seed=1), tok)
    assert c.fingerprint != a.fingerprint
    assert a.summary()["sources"][0]["documents"] == 6


def test_jsonl_parquet_disk_and_chat(tok, tmp_path, calib_text):
    texts = [p.read_text() for p in sorted(calib_text.glob("*.txt"))]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(texts)) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "ds"))
    chat = tmp_path / "c.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": t[:200]},
                                                       {"role": "assistant", "content": t[200:400]}]})
                              for t in texts) + "\n")
    for src in ({"type": "jsonl", "path": str(jl), "field": "body"},
                {"type": "parquet", "path": str(tmp_path / "d.parquet")},
                {"type": "disk", "path": str(tmp_path / "ds")},
                {"type": "chat", "path": str(chat)}):
        cs = build_calibration_set(_spec([src]), tok)
        assert cs.input_ids.shape == (4, 16), src
    # chat records go through the tokenizer's chat template
    from quantkit.data import read_documents
    from quantkit.recipe import DataSource

    docs = read_documents(DataSource(type="chat", path=str(chat)), "s", tok)
    assert docs[0].startswith("<|user|>") and "<|assistant|>" in docs[0]


def test_weights_mix_sources(tok, tmp_path, calib_text):
    other = tmp_path / "other.txt"
    other.write_text("zebra " * 2000)
    spec = _spec([{"type": "text", "path": str(calib_text / "*.txt"), "weight": 3},
                  {"type": "text", "path": str(other), "weight": 1}], n=8)
    cs = build_calibration_set(spec, tok)
    zebra = tok("zebra", add_special_tokens=False)["input_ids"][0]
    rows_with_zebra = int(sum(bool((row == zebra).any()) for row in cs.input_ids))
    assert rows_with_zebra == 2  # 8 samples, weights 3:1


@pytest.mark.parametrize("make, expected", [
    (lambda d: {"type": "text", "path": str(d / "none*.txt")}, r"calibration.sources\[0\].path: '.*none\*.txt' matches no files"),
    (lambda d: ({"type": "text", "path": str(d / "empty.txt")}), "every matched file is empty"),
    (lambda d: {"type": "jsonl", "path": str(d / "j.jsonl"), "field": "txt"},
     r"j.jsonl:1: no field 'txt' \(found: text\); set calibration.sources\[0\].field"),
    (lambda d: {"type": "jsonl", "path": str(d / "bad.jsonl")}, r"bad.jsonl:2: not valid JSON"),
    (lambda d: {"type": "text", "path": str(d / "short.txt")},
     r"too little text: 0 windows of 16 tokens in all sources, 4 needed; add text, or lower"),
    (lambda d: {"type": "hub", "path": "org/definitely-not-here"}, r"hub dataset 'org/definitely-not-here' could "
                                                                   r"not be loaded .*type: disk"),
])
def test_data_errors(tok, tmp_path, make, expected):
    (tmp_path / "empty.txt").write_text("   \n")
    (tmp_path / "j.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "hello"}) + "\n{oops\n")
    (tmp_path / "short.txt").write_text("just a few words")
    with pytest.raises(DataError, match=expected):
        build_calibration_set(_spec([make(tmp_path)]), tok)
