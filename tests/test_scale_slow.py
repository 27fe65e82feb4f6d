"""A 2-layer slice of the Llama-3.1-8B shape (hidden 4096, intermediate 14336, GQA 32/8, vocab 128256),
written tensor by tensor by benchmarks/scale.py, converted to W4A16 g128 and reloaded in transformers to
exactly the weights quantkit computed. About a minute and 3 GB of disk on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _scale_module():
    spec = importlib.util.spec_from_file_location("qk_scale_bench", REPO / "benchmarks" / "scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_8b_shape_slice_converts_and_reloads_bit_exact(tmp_path):
    from transformers import AutoModelForCausalLM

    from quantkit import api
    from quantkit.recipe import parse_recipe

    model = _scale_module().write_checkpoint(tmp_path / "llama8b-2", "llama8b", 2)
    cfg = json.loads((model / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"], cfg["vocab_size"]) == \
        (4096, 14336, 8, 128256)
    cap: dict[str, torch.Tensor] = {}
    recipe = parse_recipe({"name": "llama8b-2", "model": {"path": str(model), "dtype": "bfloat16"},
                           "stages": [{"method": "rtn", "scheme": "W4A16", "group_size": 128}]})
    out = api.convert(recipe, tmp_path / "out", quiet=True,
                      on_weight=lambda n, w: cap.__setitem__(n, w.to(torch.bfloat16)))
    assert len(cap) == 14  # 7 Linears x 2 layers
    man = json.loads((out / "manifest.json").read_text())
    assert man["conversion"]["peak_rss_bytes"] < 8e9  # one 8B layer at a time, not the model
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        got(torch.tensor([[1, 2, 3]]))  # compressed-tensors decompresses the weights on the first forward
    for name, w in cap.items():
        assert torch.equal(got.get_submodule(name).weight, w), name
