"""Pre-flight: what the engine cannot load is refused before any calibration starts; the small model carries
the recipe's exact formats; results are cached. The real-engine refusal is in test_preflight_slow.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_recipe, write_recipe
from quantkit.convert import convert
from quantkit.engine import EngineError
from quantkit import preflight as pf
from quantkit.recipe import load_recipe


@pytest.fixture
def no_calibration(monkeypatch):
    """Fail the test if a conversion gets as far as building its calibration set."""
    import quantkit.data

    def refuse(*a, **k):
        raise AssertionError("calibration started")

    monkeypatch.setattr(quantkit.data, "build_calibration_set", refuse)


def _split_qkv(model: Path, calib: Path) -> dict:
    # q_proj at W8A8, k/v (and the rest) at W4A16: vLLM's fused qkv_proj would need two schemes
    return tiny_recipe(model, calib, [
        {"method": "rtn", "scheme": "W8A8", "targets": ["re:.*q_proj$"]},
        {"method": "gptq", "scheme": "W4A16", "group_size": 32, "targets": ["Linear"], "ignore": ["lm_head"]}])


@pytest.mark.parametrize("mode", ["capability", "engine"])
def test_split_fused_group_is_refused_before_calibration(tiny_llama, calib_text, tmp_path, no_calibration, mode,
                                                         monkeypatch):
    monkeypatch.setattr(pf, "engine_check", lambda *a, **k: pytest.fail("the format rules must refuse first"))
    r = load_recipe(write_recipe(tmp_path / "r.yaml", _split_qkv(tiny_llama, calib_text)))
    with pytest.raises(pf.PreflightError, match=r"fuses q/k/v .*model\.layers\.0 \(q_proj: stages\[0\] W8A8, "
                                                r"k_proj: stages\[1\] W4A16"):
        convert(r, tmp_path / "out", quiet=True, preflight=mode)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


def test_ignoring_part_of_a_fused_group_is_refused(tiny_llama, tmp_path, no_calibration):
    st = {"method": "rtn", "scheme": "W8A8", "targets": ["Linear"], "ignore": ["lm_head", "re:.*up_proj$"]}
    r = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama, None, [st])))
    with pytest.raises(pf.PreflightError, match=r"gate_proj: stages\[0\] W8A8, up_proj: not quantized"):
        convert(r, tmp_path / "out", quiet=True, preflight="capability")
    # off: the conversion goes on (and vLLM would refuse the artifact later)
    assert convert(r, tmp_path / "out", quiet=True, preflight="off").is_dir()


def _plan(recipe):
    from quantkit.model.arch import arch_for
    from quantkit.model.checkpoint import build_skeleton
    from quantkit.plan import make_plan

    m = build_skeleton(Path(recipe.model.path), "bfloat16")
    arch = arch_for(m.config)
    return make_plan(m, arch, recipe), arch


def test_small_model_carries_every_layer_layout_of_a_mixed_recipe(tiny_llama, tmp_path):
    from quantkit.recipe import parse_recipe

    data = tiny_recipe(tiny_llama, None, [
        {"method": "rtn", "scheme": "W8A8", "targets": ["re:^model\\.layers\\.1\\.mlp\\.down_proj$"]},
        {"method": "rtn", "scheme": "W4A16", "group_size": 32, "targets": ["Linear"], "ignore": ["lm_head"]}])
    r = load_recipe(write_recipe(tmp_path / "mixed.yaml", data))
    plan, arch = _plan(r)
    layouts = pf.layer_layouts(plan)
    assert len(layouts) == 2 and layouts[0]["mlp.down_proj"] == 1 and layouts[1]["mlp.down_proj"] == 0
    small = pf.build_small_model(Path(r.model.path), len(layouts), tmp_path / "small", "bfloat16")
    sr = parse_recipe(pf.small_recipe(r, small, layouts, arch.layers))
    splan, _ = _plan(sr)
    got = [{t.name[len(lp.prefix):]: (t.scheme.name, t.scheme.weights.group_size) for t in lp.targets}
           for lp in splan.layers]
    want = [{loc: (r.stages[s].scheme, r.stages[s].group_size) for loc, s in lay.items()} for lay in layouts]
    assert got == want
    assert all(t.quantizer.name == "rtn" for t in splan.targets.values())
    import json
    cfg = json.loads((small / "config.json").read_text())
    real = json.loads((Path(r.model.path) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == real["hidden_size"]
    assert (small / "tokenizer.json").is_file() or (small / "tokenizer_config.json").is_file()
    # made in the stored dtype, with the seeded N(0, 0.02) matrices the engine loads
    from safetensors.torch import load_file
    stored = {k: v for f in small.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    mats = [v for v in stored.values() if v.ndim == 2]
    assert mats and all(v.dtype == torch.bfloat16 for v in stored.values())
    std = torch.cat([v.float().reshape(-1) for v in mats]).std().item()
    assert 0.019 < std < 0.021, std


class _Server:
    """Stands in for VLLMServer: refuses to load (as vLLM exits with its error) and counts its starts."""

    starts = 0

    def __init__(self, model_dir, run_dir, name, **kw):
        self.log_path = Path(run_dir) / "logs" / "vllm-preflight.log"

    def __enter__(self):
        type(self).starts += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("ValueError: No compressed-tensors compatible scheme was found.\n")
        raise EngineError("vLLM exited with code 1 while loading x: ValueError: No compressed-tensors compatible "
                          "scheme was found.\n  full log: x")

    def __exit__(self, *a):
        return False


def test_engine_refusal_is_cached_and_said_with_the_engines_error(tiny_llama, tmp_path, no_calibration, monkeypatch):
    import quantkit.engine.vllm_server as vs

    monkeypatch.setattr(vs, "VLLMServer", _Server)
    import quantkit.engine.capability as cap

    monkeypatch.setattr(cap, "recipe_can_run", lambda *a, **k: (True, ""))
    st = {"method": "rtn", "scheme": "W8A8", "symmetric": False, "targets": ["Linear"], "ignore": ["lm_head"]}
    r = load_recipe(write_recipe(tmp_path / "asym.yaml", tiny_recipe(tiny_llama, None, [st])))
    for attempt in range(2):
        with pytest.raises(pf.PreflightError, match="No compressed-tensors compatible scheme") as exc:
            convert(r, tmp_path / "out", quiet=True, preflight="engine")
        assert "Nothing was calibrated" in str(exc.value)
    assert _Server.starts == 1, "the second refusal comes from the cache"
    logs = list((Path(__import__("os").environ["QUANTKIT_HOME"]) / "preflight").glob("*.log"))
    assert len(logs) == 1 and "compatible scheme" in logs[0].read_text()


def test_capability_mode_says_what_this_machine_cannot_serve_without_refusing(tiny_llama, tmp_path, monkeypatch):
    import quantkit.engine.capability as cap

    monkeypatch.setattr(cap, "engine_can_run", lambda *a, **k: (False, "no kernel here"))
    st = {"method": "rtn", "scheme": "W8A8", "targets": ["Linear"], "ignore": ["lm_head"]}
    r = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama, None, [st])))
    out = convert(r, tmp_path / "out", quiet=True, preflight="engine")  # engine step skipped: cannot run here
    import json
    got = json.loads((out / "manifest.json").read_text())["conversion"]["preflight"]
    assert got["mode"] == "engine" and got["capability"] == {"ok": False, "reason": "stages[0] (W8A8): no kernel here"}
    assert "engine" not in got


def test_mode_from_environment(monkeypatch):
    monkeypatch.setenv("QUANTKIT_PREFLIGHT", "off")
    assert pf.default_mode() == "off"
    monkeypatch.delenv("QUANTKIT_PREFLIGHT")
    assert pf.default_mode() == "engine"
    monkeypatch.setenv("QUANTKIT_PREFLIGHT", "sometimes")
    with pytest.raises(ValueError, match="QUANTKIT_PREFLIGHT"):
        pf.default_mode()
