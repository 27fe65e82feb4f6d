"""FP8 KV cache (recipe `kv_cache:`): the calibrated k/v scales against an independent computation of the
keys and values attention sees, the export as vLLM's loader reads it, resume, recipe errors, the capability
rule and the eval's engine settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model, tiny_recipe
from quantkit import api, hardware
from quantkit.recipe import RecipeError, parse_recipe

W4 = [{"method": "rtn", "scheme": "W4A16", "group_size": 16}]  # weight-only: the reference model is exact
W8A8 = [{"method": "rtn", "scheme": "W8A8"}]


def _recipe(model_dir, calib, stages, strategy="tensor", **kw):
    r = tiny_recipe(model_dir, calib, stages)
    r["kv_cache"] = {"scheme": "FP8", "strategy": strategy}
    r.update(kw)
    return r


def _convert(r: dict, out: Path) -> dict:
    cap: dict = {}
    api.convert(parse_recipe(r), out, quiet=True, on_weight=cap.__setitem__)
    return cap


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    t = {}
    for f in sorted(out.glob("*.safetensors")):
        t.update(load_file(str(f)))
    return t


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _reference_amax(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, per KV head: max |k| after RoPE and max |v|, computed here from each attention module's
    inputs (hidden states, cos/sin) with the module's own projections, in a plain sdpa forward of `model`."""
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def hook(mod, args, kwargs, i=i):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            b, s, _ = h.shape
            k = mod.k_proj(h).view(b, s, -1, mod.head_dim).transpose(1, 2)  # [b, kv_heads, s, d]
            v = mod.v_proj(h).view(b, s, -1, mod.head_dim).transpose(1, 2)
            k = k * cos.unsqueeze(1) + _rotate_half(k) * sin.unsqueeze(1)
            ka, va = k.abs().amax(dim=(0, 2, 3)), v.abs().amax(dim=(0, 2, 3))
            old = found.get(i)
            found[i] = (ka, va) if old is None else (torch.maximum(old[0], ka), torch.maximum(old[1], va))

        hooks.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            for ids in input_ids.split(4):
                model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [found[i] for i in range(len(found))]


def _calibration_ids(recipe) -> torch.Tensor:
    from quantkit.data import build_calibration_set
    from quantkit.model.sources import load_tokenizer

    return build_calibration_set(recipe.calibration, load_tokenizer(Path(recipe.model.path))).input_ids


def test_scales_are_amax_over_448_of_the_quantized_models_post_rope_keys_and_values(tiny_llama, calib_text, tmp_path):
    """Per head and per tensor, against k/v recomputed here from the quantized model (the float model's
    maxima differ, so the test tells which model the pass observed)."""
    from quantkit.export.reader import fake_quant_model

    outs, caps = {}, {}
    for strategy in ("head", "tensor"):
        r = _recipe(tiny_llama, calib_text, W4, strategy)
        outs[strategy] = tmp_path / strategy
        caps[strategy] = _convert(r, outs[strategy])
    recipe = parse_recipe(_recipe(tiny_llama, calib_text, W4))
    ids = _calibration_ids(recipe)
    quant = _reference_amax(fake_quant_model(tiny_llama, recipe, caps["head"]), ids)
    from transformers import AutoModelForCausalLM

    floats = _reference_amax(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval(), ids)
    head, tensor = _tensors(outs["head"]), _tensors(outs["tensor"])
    kv_heads = 2  # tiny llama: 4 query heads, 2 KV heads
    float_gap = 0.0
    for i, ((qk, qv), (fk, fv)) in enumerate(zip(quant, floats)):
        k, v = head[f"model.layers.{i}.self_attn.k_scale"], head[f"model.layers.{i}.self_attn.v_scale"]
        assert k.shape == v.shape == (kv_heads, 1, 1) and k.dtype == torch.float32
        torch.testing.assert_close(k.flatten(), qk / 448.0, rtol=1e-4, atol=0)
        torch.testing.assert_close(v.flatten(), qv / 448.0, rtol=1e-4, atol=0)
        kt, vt = tensor[f"model.layers.{i}.self_attn.k_scale"], tensor[f"model.layers.{i}.self_attn.v_scale"]
        assert kt.shape == vt.shape == (1,)
        torch.testing.assert_close(kt, qk.max().reshape(1) / 448.0, rtol=1e-4, atol=0)
        torch.testing.assert_close(vt, qv.max().reshape(1) / 448.0, rtol=1e-4, atol=0)
        float_gap = max(float_gap, ((fk - qk).abs() / qk).max().item(), ((fv - qv).abs() / qv).max().item())
    assert float_gap > 1e-3, "the float and the quantized model give the same maxima: the test could not tell them apart"
    man = json.loads((outs["head"] / "manifest.json").read_text())
    kv = man["quantization"]["kv_cache"]
    assert kv["strategy"] == "head" and kv["summary"]["layers"] == 2
    assert kv["layers"]["model.layers.1.self_attn"]["k_scale"] == pytest.approx(
        head["model.layers.1.self_attn.k_scale"].flatten().tolist())
    assert not any("kv_cache" in s for s in man["layers"].values())  # moved out of the module stats


def test_export_is_what_vllms_compressed_tensors_loader_reads(tiny_llama, calib_text, tmp_path):
    """config.json's kv_cache_scheme passes vLLM's own validator; every k/v scale name maps, through vLLM's
    cache-scale mapper, onto the attention layer's parameter; shapes are what its loaders take."""
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod,
    )

    out = tmp_path / "out"
    _convert(_recipe(tiny_llama, calib_text, W8A8, "head"), out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    kv = qc["kv_cache_scheme"]
    assert {k: kv[k] for k in ("num_bits", "type", "strategy", "dynamic", "symmetric")} == {
        "num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True}
    CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(kv)
    mapper = QuantizationConfig.get_cache_scale_mapper()
    scales = {k: v for k, v in _tensors(out).items() if k.endswith(("k_scale", "v_scale")) and "proj" not in k}
    assert sorted(scales) == [f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv"]
    for name, t in scales.items():
        assert mapper.map_name(name) == name.replace(".self_attn.", ".self_attn.attn."), name
        assert t.flatten().numel() == 2 and (t > 0).all()  # attn_head: the loader flattens to [num_kv_heads]
    # the weights' own scales are untouched by the mapper
    assert mapper.map_name("model.layers.0.self_attn.k_proj.weight_scale") == "model.layers.0.self_attn.k_proj.weight_scale"


def test_resume_keeps_the_scales(tiny_llama, calib_text, tmp_path, monkeypatch):
    """A conversion that dies after layer 0 and is resumed writes the same scales as one that did not."""
    from quantkit.quantize.workdir import WorkDir

    r = _recipe(tiny_llama, calib_text, W8A8)
    _convert(r, tmp_path / "ref")
    real = WorkDir.save_layer

    def dies_after_layer_0(self, index, *a, **k):
        real(self, index, *a, **k)
        if index == 0:
            raise KeyboardInterrupt("killed after layer 0")

    monkeypatch.setattr(WorkDir, "save_layer", dies_after_layer_0)
    with pytest.raises(KeyboardInterrupt):
        _convert(r, tmp_path / "out")
    monkeypatch.setattr(WorkDir, "save_layer", real)
    _convert(r, tmp_path / "out")
    assert "resuming after layer 0" in (tmp_path / "out" / "convert.log").read_text()
    a, b = _tensors(tmp_path / "ref"), _tensors(tmp_path / "out")
    names = [k for k in a if k.endswith(("self_attn.k_scale", "self_attn.v_scale"))]
    assert len(names) == 4
    for k in names:
        assert torch.equal(a[k], b[k]), k


def test_recipe_errors_name_file_field_and_fix():
    base = {"name": "x", "model": {"path": "m"}, "stages": W8A8}
    calib = {"sources": [{"type": "builtin", "name": "prose"}]}
    with pytest.raises(RecipeError) as e:  # round-to-nearest without data: nothing to calibrate the scales on
        parse_recipe({**base, "kv_cache": {"scheme": "FP8"}}, "r.yaml")
    assert str(e.value).startswith("r.yaml: kv_cache: ") and "add a `calibration:` section" in str(e.value)
    with pytest.raises(RecipeError, match=r"r.yaml: kv_cache.scheme: 'INT8' is not allowed \('FP8'\)"):
        parse_recipe({**base, "calibration": calib, "kv_cache": {"scheme": "INT8"}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"r.yaml: kv_cache.strategy: 'channel' is not allowed \('tensor' or 'head'\)"):
        parse_recipe({**base, "calibration": calib, "kv_cache": {"scheme": "FP8", "strategy": "channel"}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"r.yaml: kv_cache.bits: unknown key 'bits' \(allowed: scheme, strategy\)"):
        parse_recipe({**base, "calibration": calib, "kv_cache": {"scheme": "FP8", "bits": 8}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"r.yaml: kv_cache.scheme: required field is missing"):
        parse_recipe({**base, "calibration": calib, "kv_cache": {"strategy": "head"}}, "r.yaml")
    with pytest.raises(RecipeError, match="a qat stage changes k_proj / v_proj after it"):
        parse_recipe({**base, "calibration": calib, "kv_cache": {"scheme": "FP8"},
                      "stages": W4 + [{"method": "qat", "scheme": "W4A16", "group_size": 16, "steps": 4,
                                               "warmup_steps": 1}]}, "r.yaml")
    ok = parse_recipe({**base, "calibration": calib, "kv_cache": {"scheme": "FP8"}})
    assert ok.kv_cache.strategy == "tensor" and ok.model_dump()["kv_cache"] == {"scheme": "FP8", "strategy": "tensor"}
    # absent: no key in the dump, so every existing recipe keeps its hash (resumable work folders stay valid)
    assert "kv_cache" not in parse_recipe(base).model_dump()
    assert parse_recipe({**base, "calibration": calib}).hash() != ok.hash()


AVX2 = {"avx2", "fma"}
AVX512 = AVX2 | {"avx512f"}
AMX = AVX2 | {"avx512f", "amx_bf16", "amx_tile", "avx512_bf16"}
TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.fixture()
def cpu(monkeypatch):
    def set_flags(flags):
        monkeypatch.setattr(hardware, "cpu_flags", lambda: set(flags))
        monkeypatch.setattr(hardware, "cuda_device", lambda: None)
    return set_flags


def test_capability_follows_vllm_cpus_attention_backend(cpu):
    from quantkit.engine.capability import kv_cache_can_run

    cpu(AVX2)
    ok, why = kv_cache_can_run(TENSOR, 64)
    assert not ok and "AVX-512 or AMX" in why
    for flags in (AVX512, AMX):
        cpu(flags)
        assert kv_cache_can_run(TENSOR, 64)[0]
        ok, why = kv_cache_can_run(TENSOR, 48)  # vLLM's vec16 path (head size 16 mod 32) has no FP8
        assert not ok and "divisible by 32" in why and "48" in why
        ok, why = kv_cache_can_run({**TENSOR, "strategy": "attn_head"}, 64)
        assert ok and "largest head scale" in why
    assert not kv_cache_can_run({**TENSOR, "num_bits": 4}, 64)[0]
    assert not kv_cache_can_run({**TENSOR, "symmetric": False}, 64)[0]
    assert kv_cache_can_run(TENSOR, 48, device="cuda")[0]


def _artifact_config(folder: Path, head_dim: int, kv: dict | None, dtype: str = "bfloat16") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}}
    if kv:
        qc["kv_cache_scheme"] = kv
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4 * head_dim, "dtype": dtype,
                                                    "num_attention_heads": 4, "quantization_config": qc}))
    return folder


def test_eval_serves_the_fp8_cache_where_it_can_and_says_so_where_not(cpu, tmp_path):
    from quantkit.engine import EngineError
    from quantkit.evaluate.probes import Side as _Side
    from quantkit.evaluate.run import _kv_cache_settings

    said = []
    cpu(AMX)
    side = _Side("candidate", _artifact_config(tmp_path / "a", 64, TENSOR), None)
    assert _kv_cache_settings(side, {}, said.append) == {"kv_cache_dtype": "fp8"}
    assert side.data["kv_cache"]["fp8_cache_served"] is True
    cpu(AVX2)  # no FP8 cache: a bf16 engine gets an explicit bf16 cache (vLLM would pick fp8 for `auto`)
    side = _Side("candidate", tmp_path / "a", None)
    assert _kv_cache_settings(side, {}, said.append, "bfloat16") == {"kv_cache_dtype": "bfloat16"}
    assert side.data["kv_cache"]["fp8_cache_served"] is False
    assert "NOT served with the FP8 KV cache here" in said[-1] and "AVX-512 or AMX" in said[-1]
    side = _Side("candidate", tmp_path / "a", None)  # float32 engine, per-tensor: the scheme taken out
    args = _kv_cache_settings(side, {}, said.append, "float32")
    qc = json.loads(args["hf_overrides"])["quantization_config"]
    assert "kv_cache_scheme" not in qc and qc["quant_method"] == "compressed-tensors"
    head = _artifact_config(tmp_path / "h", 64, {**TENSOR, "strategy": "attn_head"})
    assert _kv_cache_settings(_Side("candidate", head, None), {}, said.append, "bfloat16") == {"kv_cache_dtype": "bfloat16"}
    with pytest.raises(EngineError):  # auto on this CPU (no native bf16) is a float32 engine
        _kv_cache_settings(_Side("candidate", head, None), {}, said.append, "auto")
    with pytest.raises(EngineError, match="no setting serves per-head"):  # float32 + per-head: vLLM refuses the shapes
        _kv_cache_settings(_Side("candidate", head, None), {}, said.append, "float32")
    cpu(AMX)  # a suite that sets the cache itself wins
    side = _Side("candidate", tmp_path / "a", None)
    assert _kv_cache_settings(side, {"kv_cache_dtype": "bfloat16"}, said.append) == {}
    assert side.data["kv_cache"]["fp8_cache_served"] is None
    side = _Side("baseline", _artifact_config(tmp_path / "b", 64, None), None)
    assert _kv_cache_settings(side, {}, said.append) == {} and "kv_cache" not in side.data


def test_report_says_what_the_kv_cache_was(tmp_path):
    from quantkit.evaluate.report import _kv_cache_lines

    r = {"kv_cache": {"candidate": {"scheme": TENSOR, "fp8_cache_served": False, "reason": "because X"}}}
    text = "\n".join(_kv_cache_lines(r))
    assert "**not** served with the FP8 cache here, so the figures of this report do not include it" in text and "because X" in text and "strategy tensor" in text
    assert _kv_cache_lines({"kv_cache": {}}) == []


def test_attention_observer_leaves_the_forward_unchanged(tmp_path):
    """The registered attention function delegates: logits with the observer installed equal plain sdpa's."""
    from transformers import AutoModelForCausalLM

    from quantkit.distributed import ChunkLayout
    from quantkit.quantize.kvcache import KV_ATTENTION, KVObserver

    m = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "q3", "qwen3"), dtype=torch.float32).eval()
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m(ids).logits
    layer = m.model.layers[0]
    obs = KVObserver("model.layers.0.", "self_attn", "head", ChunkLayout.of(2, 2, 16))
    obs.install(layer)
    try:
        assert m.config._attn_implementation == KV_ATTENTION
        with torch.no_grad():
            got = m(ids).logits
    finally:
        obs.remove()
    assert m.config._attn_implementation == "sdpa" and not hasattr(layer.self_attn, "_quantkit_kv")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    scales, stats = obs.finish()
    assert obs.calls == 1 and scales["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)
