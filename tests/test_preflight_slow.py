"""The engine pre-flight against the real vLLM: a combination vLLM cannot load (int8 weights with zero
points: vLLM's W8A8 kernels take symmetric weights only, which the capability check does not know) is
refused with vLLM's own error before any calibration starts, and the second attempt is answered from the
cache without starting an engine."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_engine_refuses_asymmetric_w8a8_before_calibration(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="the engine pre-flight needs vLLM installed")
    import quantkit.data
    from quantkit.convert import convert
    from quantkit.preflight import PreflightError
    from quantkit.recipe import load_recipe

    demo = Path(os.environ.get("QUANTKIT_REAL_HOME", Path.home() / ".cache" / "quantkit")) / "models" / "smollm2-135m"
    if not (demo / "config.json").is_file():
        pytest.skip("demo model missing: run `quantkit models fetch smollm2-135m` first (scripts/test.sh does)")
    monkeypatch.setattr(quantkit.data, "build_calibration_set",
                        lambda *a, **k: pytest.fail("calibration started before the pre-flight refused"))
    recipe = tmp_path / "asym.yaml"
    recipe.write_text(f"""
name: asym-w8a8
model: {{path: {demo}, dtype: bfloat16}}
calibration: {{sources: [{{type: builtin, name: prose}}], num_samples: 8, seq_len: 128}}
stages:
  - {{method: gptq, scheme: W8A8, symmetric: false, targets: [Linear], ignore: [lm_head]}}
""")
    import quantkit.engine.vllm_server as vs

    starts = []
    real_enter = vs.VLLMServer.__enter__
    monkeypatch.setattr(vs.VLLMServer, "__enter__", lambda self: starts.append(1) or real_enter(self))
    r = load_recipe(recipe)
    t0 = time.perf_counter()
    with pytest.raises(PreflightError, match="No compressed-tensors compatible scheme was found") as exc:
        convert(r, tmp_path / "out", quiet=True, preflight="engine")
    first = time.perf_counter() - t0
    assert "Nothing was calibrated" in str(exc.value)
    assert not (tmp_path / "out").exists()
    t0 = time.perf_counter()
    with pytest.raises(PreflightError):
        convert(r, tmp_path / "out", quiet=True, preflight="engine")
    cached = time.perf_counter() - t0
    print(f"\npre-flight refusal: {first:.1f} s with the engine, {cached:.2f} s from the cache\n{exc.value}")
    assert len(starts) == 1, "the second refusal comes from the cache, without an engine"
