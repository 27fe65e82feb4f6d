"""Where a conversion's time goes (quantkit/quantize/timing.py, the manifest's conversion.phases_s) and the
roofline's FLOP model (benchmarks/roofline.py) against torch's own FLOP counter."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_recipe
from quantkit import api
from quantkit.quantize import timing
from quantkit.recipe import parse_recipe

REPO = Path(__file__).resolve().parents[1]


def test_nested_phases_sum_and_forward_is_the_rest_of_the_layer(monkeypatch):
    ticks = iter([0.0, 1.0, 3.0, 3.5, 4.0, 10.0])  # layer [0, 10], hessian [1, 3], save [3.5, 4]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    t = timing.PhaseTimes()
    with t.measure("layer"):
        with t.measure("hessian"):
            pass
        with t.measure("save"):
            pass
    assert t.summary() == {"layer": 10.0, "hessian": 2.0, "save": 0.5, "forward": 7.5}


def test_a_failing_block_is_still_charged(monkeypatch):
    ticks = iter([0.0, 2.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    t = timing.PhaseTimes()
    with pytest.raises(RuntimeError):
        with t.measure("solve"):
            raise RuntimeError("boom")
    assert t.summary() == {"solve": 2.0}


def test_a_gptq_conversion_records_its_phases(tiny_llama, calib_text, tmp_path):
    r = parse_recipe(tiny_recipe(tiny_llama, calib_text, [{"method": "gptq", "scheme": "W4A16", "group_size": 32}]))
    api.convert(r, tmp_path / "out", quiet=True)
    conv = json.loads((tmp_path / "out" / "manifest.json").read_text())["conversion"]
    ph = conv["phases_s"]
    assert {"load", "capture", "hessian", "solve", "diagnostics", "save", "layer", "forward"} <= set(ph)
    assert all(ph[k] > 0 for k in ("load", "hessian", "solve", "layer"))
    inside = sum(ph.get(k, 0.0) for k in timing.INSIDE_LAYER)
    assert ph["forward"] == pytest.approx(ph["layer"] - inside, abs=2e-3)
    assert ph["layer"] + ph["load"] + ph["capture"] <= conv["wall_time_s"]
    # the peak's growth, phase by phase, adds up to no more than the conversion's own peak: within the rounding of
    # each figure to 0.1 MB, and the kernel's batched RSS counters (per-thread, 64 pages each: VmHWM lags by up to
    # that, so two readings of the same peak can differ by a few hundred KB)
    raised = conv["peak_raised_mb"]
    slack = 0.05 * (1 + len(raised)) + 64 * 4096 * torch.get_num_threads() / 1e6
    assert 0 < conv["peak_at_start_mb"] + sum(raised.values()) <= conv["peak_rss_bytes"] / 1e6 + slack


def test_an_rtn_conversion_has_no_hessian_or_forward_phase(tiny_llama, tmp_path, monkeypatch):
    r = parse_recipe(tiny_recipe(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8"}]))
    monkeypatch.setenv("QUANTKIT_CONVERT_PATH", "layers")  # auto would stream it (tests/test_streamed.py)
    api.convert(r, tmp_path / "out", quiet=True)
    ph = json.loads((tmp_path / "out" / "manifest.json").read_text())["conversion"]["phases_s"]
    assert "hessian" not in ph and "capture" not in ph
    assert ph["solve"] > 0 and ph["forward"] < ph["layer"]


def _roofline():
    spec = importlib.util.spec_from_file_location("qk_bench_roofline", REPO / "benchmarks" / "roofline.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_forward_flop_model_matches_torchs_counter_on_a_real_decoder_layer():
    """torch's FlopCounterMode on transformers' own Llama layer (eager attention, which computes the whole
    S x S score matrix): the Linears' FLOPs must equal the model's; attention's the model counts at half."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    rl = _roofline()
    s = rl.scale.SHAPES["toy"]
    cfg = LlamaConfig(**{k: v for k, v in s.items() if k != "model_type"}, attn_implementation="eager")
    layer, rope = LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)
    batch, seq = 2, 64
    x = torch.randn(batch, seq, s["hidden_size"])
    pos = rope(x, torch.arange(seq)[None].expand(batch, -1))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        layer(x, position_embeddings=pos, attention_mask=None)
    by_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    linear = sum(v for k, v in by_op.items() if "mm" in k and "bmm" not in k)
    attention = sum(v for k, v in by_op.items() if "bmm" in k or "matmul" in k)
    modelled = rl.layer_flops("toy", "gptq", batch * seq, seq)["forward"]
    assert linear > 0 and attention > 0
    assert modelled == pytest.approx(linear + attention / 2, rel=1e-9)


def test_peak_growth_is_charged_to_the_innermost_open_phase():
    mb = 1_000_000
    peaks = iter([100 * mb, 100 * mb, 160 * mb, 160 * mb, 400 * mb, 450 * mb])  # VmHWM at each boundary in turn
    t = timing.PhaseTimes(peak=lambda: next(peaks))
    with t.measure("layer"):  # 100 when the first phase begins
        with t.measure("hessian"):  # 100 -> 160 inside: hessian +60
            pass
        with t.measure("solve"):  # 160 -> 400 inside: solve +240
            pass
    # 400 -> 450 between the solve's end and the layer's: the layer's own share, charged as forward
    assert t.memory() == {"peak_at_start_mb": 100.0, "peak_raised_mb": {"forward": 50.0, "hessian": 60.0, "solve": 240.0}}


def test_without_proc_there_is_no_memory_section():
    t = timing.PhaseTimes(peak=lambda: None)
    with t.measure("layer"):
        pass
    assert t.memory() == {} and "layer" in t.summary()
