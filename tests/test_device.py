"""Where a conversion computes: the --device choice, the calibration forward's dtype, and where the
calibration activations live on a GPU. Everything here that does not need CUDA is tested on the CPU; the
GPU run itself is benchmarks/device_check.sh, on a machine that has one.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_recipe
from quantkit import hardware
from quantkit.errors import QuantkitError
from quantkit.quantize.walk import activation_placement

AMX = {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
AVX2 = {"avx2", "fma"}


@pytest.mark.parametrize("flags, device, requested, expected", [
    (AMX, "cpu", "auto", ("bfloat16", "auto: this CPU computes bf16 natively (amx_bf16, avx512_bf16)")),
    ({"avx2", "avx512f", "avx512_bf16"}, "cpu", "auto", ("bfloat16", "auto: this CPU computes bf16 natively (avx512_bf16)")),
    (AVX2, "cpu", "auto", ("float32", "auto: this CPU has no native bf16 (amx_bf16 / avx512_bf16), so bf16 would be emulated")),
    (AVX2, "cuda", "auto", ("bfloat16", "auto: CUDA computes bf16 natively")),
    (AMX, "cpu", "float32", ("float32", "set in the recipe (model.compute_dtype)")),
    (AVX2, "cpu", "bfloat16", ("bfloat16", "set in the recipe (model.compute_dtype)")),
])
def test_compute_dtype_follows_native_bf16(monkeypatch, flags, device, requested, expected):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: set(flags))
    assert hardware.compute_dtype(requested, torch.device(device)) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")
def test_device_choice_on_a_machine_without_gpu():
    assert hardware.conversion_device("auto") == (torch.device("cpu"), "auto: no GPU visible to torch")
    assert hardware.conversion_device("cpu")[0] == torch.device("cpu")
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(QuantkitError, match=rf"--device {spec}: torch sees no GPU here .*use --device cpu or auto"):
            hardware.conversion_device(spec)
    with pytest.raises(QuantkitError, match=r"--device 'gpu0': use auto, cpu, cuda or cuda:N"):
        hardware.conversion_device("gpu0")


def test_activations_spill_to_host_only_when_they_do_not_fit():
    gpu, gib = torch.device("cuda", 0), 1 << 30
    assert activation_placement(torch.device("cpu"), 100 * gib, gib)[0] == "device"
    # 8B layer ~0.9 GB in bf16 -> 2.7 GB reserved; 141 GB H200: 4.3 GB of activations fit
    place, why = activation_placement(gpu, int(4.3 * gib), int(0.9 * gib), free_bytes=140 * gib)
    assert place == "device" and "fit in" in why
    # a 70B layer (1.7 GB bf16) with 2 x 256 x 2048 x 8192 x 2 B = 17 GB of activations on a 24 GB GPU
    place, why = activation_placement(gpu, 17 * gib, int(1.7 * gib), free_bytes=22 * gib)
    assert place == "host" and "pinned host memory" in why
    # the boundary: exactly what is left after 10% headroom and 3x the layer
    room = int(0.9 * 10 * gib) - 3 * gib
    assert activation_placement(gpu, room, gib, free_bytes=10 * gib)[0] == "device"
    assert activation_placement(gpu, room + 1, gib, free_bytes=10 * gib)[0] == "host"


def test_bf16_compute_converts_exactly_and_close_to_fp32(tiny_llama, calib_text, tmp_path):
    """A bf16 calibration forward: the manifest says so and why, the export reloads to exactly the weights
    quantkit computed, and the quantization is about as good as with the fp32 forward (per-module output
    SQNR within 1.5 dB on this tiny model)."""
    from transformers import AutoModelForCausalLM

    from quantkit import api
    from quantkit.recipe import parse_recipe

    stages = [{"method": "gptq", "scheme": "W4A16", "group_size": 32}]
    mans, caps = {}, {}
    for dt in ("float32", "bfloat16"):
        r = tiny_recipe(tiny_llama, calib_text, stages, name=f"t-{dt}")
        r["model"]["compute_dtype"] = dt
        cap: dict = {}
        out = api.convert(parse_recipe(r), tmp_path / dt, quiet=True, device="cpu",
                          on_weight=lambda n, w, cap=cap: cap.__setitem__(n, w))
        mans[dt], caps[dt] = json.loads((out / "manifest.json").read_text()), cap
    conv = mans["bfloat16"]["conversion"]
    assert conv["compute_dtype"] == "bfloat16" and conv["compute_dtype_reason"] == "set in the recipe (model.compute_dtype)"
    assert conv["device"] == "cpu" and mans["float32"]["conversion"]["compute_dtype"] == "float32"
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16", dtype=torch.float32).eval()
    with torch.no_grad():
        got(torch.arange(3, 20)[None])  # compressed-tensors decompresses the weights on the first forward
    for name, w in caps["bfloat16"].items():
        assert torch.equal(got.get_submodule(name).weight.to(torch.bfloat16), w.to(torch.bfloat16)), name
    assert caps["bfloat16"].keys() == caps["float32"].keys()
    assert any(not torch.equal(caps["bfloat16"][n], caps["float32"][n]) for n in caps["float32"])  # really bf16
    for name, s32 in mans["float32"]["layers"].items():
        s16 = mans["bfloat16"]["layers"][name]
        assert s16["output_sqnr_db"] > s32["output_sqnr_db"] - 1.5, (name, s16["output_sqnr_db"], s32["output_sqnr_db"])


def test_convert_cli_device_option(tiny_llama, tmp_path):
    from typer.testing import CliRunner

    from conftest import write_recipe
    from quantkit.cli import app

    rf = write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8"}]))
    res = CliRunner().invoke(app, ["convert", str(rf), "-o", str(tmp_path / "a"), "--device", "cpu", "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["conversion"]["device_reason"] == "asked for"
    if not torch.cuda.is_available():
        res = CliRunner().invoke(app, ["convert", str(rf), "-o", str(tmp_path / "b"), "--device", "cuda:0", "-q"])
        assert res.exit_code == 2 and "--device cuda:0: torch sees no GPU here" in res.output
        assert not (tmp_path / "b").exists() and not (tmp_path / ".b.partial").exists()


def test_engine_parallel_sizes_are_validated_passed_and_recorded(tmp_path):
    """tensor/pipeline/data parallel sizes reach vLLM's command line, are checked against the GPUs the
    machine has, and the report's engine entry records them. (Only the arguments and their validation can
    be tested here: this machine has no GPU.)"""
    from quantkit.engine.vllm_server import VLLMServer, check_gpus
    from quantkit.recipe import EvalSpec, parallelism

    spec = EvalSpec(engine_args={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert parallelism(spec.engine_args) == {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                             "data_parallel_size": 1, "gpus": 4}
    cmd = VLLMServer(tmp_path, tmp_path, "c", engine_args=spec.engine_args).command(8000)
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size: .* must be a whole number >= 1"):
            EvalSpec(engine_args={"tensor_parallel_size": bad})
    assert check_gpus(spec.engine_args, visible=4)["gpus"] == 4
    with pytest.raises(Exception, match=r"tensor x pipeline x data parallel = 4 GPUs, but this machine has 2"):
        check_gpus(spec.engine_args, visible=2)
    assert check_gpus(spec.engine_args, visible=0)["gpus"] == 4  # no GPU: vLLM's own CPU backend decides
