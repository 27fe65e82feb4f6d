"""The convert path on tiny random models: export -> reload through transformers equals quantkit's own
quantized model, every architecture spec, inspect catches tampering, atomic output, kill -9 resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import REPO, make_tiny_model, tiny_recipe, write_recipe
from quantkit import api
from quantkit.cli import app
from quantkit.export.reader import fake_quant_model
from quantkit.plan import ConvertError
from quantkit.recipe import parse_recipe


def _convert(model_dir, calib, stages, out, **kw):
    r = parse_recipe(tiny_recipe(model_dir, calib, stages))
    cap: dict = {}
    api.convert(r, out, quiet=True, on_weight=cap.__setitem__, **kw)
    return r, cap


def _logits(model, seed=0):
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def _reload(out):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    _logits(m)  # compressed-tensors decompresses the weights on the first forward
    return m


# Weight-only exports reload bit-exactly (same codes, same bf16 scales). For W8A8, transformers'
# compressed-tensors path quantizes activations with its own rounding (absmax / 127.5) while quantkit
# follows the engine (absmax / 127), so logits agree within a few percent of their range, not exactly.
@pytest.mark.parametrize("stages, calibrated, rel_tol", [
    ([{"method": "rtn", "scheme": "W4A16", "group_size": 16}], False, 1e-5),
    ([{"method": "rtn", "scheme": "W4A16_ASYM", "group_size": 32}], False, 1e-5),
    ([{"method": "gptq", "scheme": "W4A16", "group_size": 16, "actorder": "group"}], True, 1e-5),
    ([{"method": "gptq", "scheme": "W4A16", "group_size": 16, "actorder": "static"}], True, 1e-5),
    ([{"method": "rtn", "scheme": "W8A8"}], False, 0.1),
    ([{"method": "gptq", "scheme": "W8A8"}], True, 0.1),
    ([{"method": "gptq", "scheme": "W8A8_AVX2"}], True, 0.1),  # codes -64..63 in the plain int8 format
    # learned rounding, frozen onto the same grids: from GPTQ (group act-order keeps its g_idx) and from RTN
    ([{"method": "autoround", "scheme": "W4A16", "group_size": 16, "actorder": "group", "steps": 12, "lr": 0.05}],
     True, 1e-5),
    ([{"method": "autoround", "scheme": "W4A16_ASYM", "group_size": 32, "init": "rtn", "steps": 12}], True, 1e-5),
    ([{"method": "autoround", "scheme": "W8A8", "steps": 8}], True, 0.1),
    # the signed full range: negative scales where a group's max is its larger end, stored and read back as any
    ([{"method": "rtn", "scheme": "W4A16", "group_size": 16, "full_range": "signed"}], False, 1e-5),
    ([{"method": "gptq", "scheme": "W4A16", "group_size": 16, "actorder": "group", "full_range": "signed"}], True, 1e-5),
    ([{"method": "autoround", "scheme": "W4A16", "group_size": 16, "init": "rtn", "steps": 12,
       "full_range": "signed"}], True, 1e-5),
])
def test_export_reloads_like_fake_quant(tiny_llama, calib_text, tmp_path, stages, calibrated, rel_tol):
    out = tmp_path / "out"
    r, cap = _convert(tiny_llama, calib_text if calibrated else None, stages, out)
    ref = fake_quant_model(tiny_llama, r, cap)
    got = _reload(out)
    for name, w in cap.items():  # bit-exact weights after the checkpoint round trip (bf16 storage)
        assert torch.equal(got.get_submodule(name).weight.to(torch.bfloat16), w.to(torch.bfloat16)), name
    a, b = _logits(ref), _logits(got)
    assert (a - b).abs().max() <= rel_tol * a.abs().max()
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["ignore"] == ["lm_head"]
    assert cfg["format"] == ("int-quantized" if "W8A8" in stages[0]["scheme"] else "pack-quantized")
    if stages[0].get("full_range") == "signed":  # the stored scales carry both signs
        from safetensors.torch import load_file
        scales = [t for f in sorted(out.glob("*.safetensors")) for k, t in load_file(str(f)).items()
                  if k.endswith("weight_scale")]
        assert scales and any((t < 0).any() for t in scales) and any((t > 0).any() for t in scales)
    if stages[0]["scheme"] == "W8A8_AVX2":  # the stored int8 codes use the narrowed range and nothing beyond
        from safetensors.torch import load_file
        codes = [t for f in sorted(out.glob("*.safetensors")) for t in load_file(str(f)).values() if t.dtype == torch.int8]
        assert codes and all(int(c.min()) >= -64 and int(c.max()) <= 63 for c in codes)
        assert max(int(c.abs().max()) for c in codes) >= 63
    # only group act-order changes the format (a g_idx per column); static permutes while quantizing
    # and stores plain groups, as does no act-order
    want_actorder = "group" if stages[0].get("actorder") == "group" else None
    assert cfg["config_groups"]["group_0"]["weights"]["actorder"] == want_actorder
    assert cfg["config_groups"]["group_0"]["weights"]["strategy"] == ("channel" if "W8A8" in stages[0]["scheme"] else "group")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_architecture_specs(tmp_path, calib_text, model_type, caplog):
    model_dir = make_tiny_model(tmp_path / model_type, model_type)
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="quantkit"):
        r, cap = _convert(model_dir, calib_text, [{"method": "gptq", "scheme": "W4A16", "group_size": 16}], out)
    # each spec's groups follow its forward: no weight dropped behind the chunks is read again
    assert not [m for m in caplog.messages if "after its group was passed" in m]
    assert len(cap) == 2 * 7  # every decoder Linear of both layers
    ref, got = fake_quant_model(model_dir, r, cap), _reload(out)
    a, b = _logits(ref), _logits(got)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    man = json.loads((out / "manifest.json").read_text())
    assert all("gptq_loss" in s and "output_sqnr_db" in s for s in man["layers"].values())


def test_manifest_and_inspect(tiny_llama, tmp_path):
    out = tmp_path / "out"
    _convert(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8"}], out)
    man = json.loads((out / "manifest.json").read_text())
    assert man["schema"] == "quantkit.manifest/1"
    assert set(man["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "convert.log"}
    assert len(man["recipe_sha256"]) == 64 and man["base_model"]["fingerprint"]
    assert man["conversion"]["peak_rss_bytes"] > 0 and man["conversion"]["wall_time_s"] > 0
    assert man["versions"]["compressed-tensors"] and man["versions"]["torch"]
    assert all(v["weight_sqnr_db"] > 25 for v in man["layers"].values())
    runner = CliRunner()
    ok = runner.invoke(app, ["inspect", str(out)])
    assert ok.exit_code == 0, ok.output
    assert "checksums: ok" in ok.output
    # flip one byte in the middle of the weights
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    bad = runner.invoke(app, ["inspect", str(out)])
    assert bad.exit_code == 1
    assert "model.safetensors: sha256 does not match the manifest" in bad.output


def test_crash_mid_export_leaves_no_final_folder(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    from quantkit.export import artifact

    real = artifact.write_config
    monkeypatch.setattr(artifact, "write_config", boom)
    with pytest.raises(OSError, match="simulated"):
        _convert(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8"}], out)
    assert not out.exists()
    assert api.partial_dir(out).is_dir()  # the resume point stays, under another name
    monkeypatch.setattr(artifact, "write_config", real)  # (not undo(): that would also drop conftest's env)
    _convert(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8"}], out)  # picks up and finishes
    assert (out / "manifest.json").is_file() and not api.partial_dir(out).exists()


def test_existing_output_is_not_clobbered(tiny_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        _convert(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8"}], out)
    assert (out / "keep.txt").read_text() == "mine"


def test_group_size_error_names_the_layer(tmp_path, calib_text):
    model_dir = make_tiny_model(tmp_path / "m", "llama", hidden=48)  # 48 % 32 != 0
    # a refusal naming the recipe stage and the module (exit 2 at the CLI), not an internal error
    with pytest.raises(ConvertError, match=r"stages\[0\]: model.layers.0.self_attn.q_proj: in_features 48 is not "
                                           r"divisible by group_size 32; use group_size 16"):
        _convert(model_dir, None, [{"method": "rtn", "scheme": "W4A16", "group_size": 32}], tmp_path / "o")


def test_lm_head_is_refused_when_targeted(tiny_llama, tmp_path):
    with pytest.raises(ConvertError, match="quantizing lm_head is not supported"):
        _convert(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8", "ignore": []}], tmp_path / "o")


def test_mixed_precision_stages(tiny_llama, calib_text, tmp_path):
    stages = [{"method": "gptq", "scheme": "W8A8", "targets": ["re:.*mlp\\.down_proj$"]},
              {"method": "gptq", "scheme": "W4A16", "group_size": 16}]
    out = tmp_path / "out"
    r, cap = _convert(tiny_llama, calib_text, stages, out)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mixed-precision" and set(cfg["config_groups"]) == {"group_0", "group_1"}
    assert cfg["config_groups"]["group_0"]["targets"] == ["re:^model\\.layers\\.(?:0|1)\\.mlp\\.down_proj$"]
    got = _reload(out)
    for name, w in cap.items():
        assert torch.equal(got.get_submodule(name).weight.to(torch.bfloat16), w.to(torch.bfloat16)), name


# ------------------------------------------------------------------------------------------ resume
KILLER = r"""
import os, signal, sys
from quantkit.quantize import workdir
from quantkit.cli import app
mode, at = sys.argv[1], int(sys.argv[2])
orig_save, orig_write = workdir.WorkDir.save_layer, workdir.atomic_write_json
def save_layer(self, index, results, *hidden):
    if mode == "during" and index == at:
        # kill -9 after the layer and next-input files are written, before state.json says so
        def write(path, data):
            if str(path).endswith("state.json"):
                os.kill(os.getpid(), signal.SIGKILL)
            return orig_write(path, data)
        workdir.atomic_write_json = write
    orig_save(self, index, results, *hidden)
    if mode == "after" and index == at:
        os.kill(os.getpid(), signal.SIGKILL)
workdir.WorkDir.save_layer = save_layer
sys.argv = ["quantkit", *sys.argv[3:]]
app()
"""


def _run_convert(args, killer=None, env=None):
    cmd = [sys.executable, "-c", KILLER, *killer, *args] if killer else \
        [sys.executable, "-m", "quantkit.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)


# autoround carries the float model's activations beside the quantized ones: the resume point keeps both
@pytest.mark.parametrize("mode, stage", [
    ("after", {"method": "gptq", "scheme": "W4A16", "group_size": 16}),
    ("during", {"method": "gptq", "scheme": "W4A16", "group_size": 16}),
    ("after", {"method": "autoround", "scheme": "W4A16", "group_size": 16, "init": "rtn", "steps": 4}),
])
def test_kill_9_resume_is_byte_identical(tmp_path, calib_text, mode, stage):
    model_dir = make_tiny_model(tmp_path / "m", "llama", layers=4)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(model_dir, calib_text, [stage]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref, out = tmp_path / "ref", tmp_path / "out"
    done = _run_convert([ "convert", str(recipe), "-o", str(ref), "-q"], env=env)
    assert done.returncode == 0, done.stderr
    killed = _run_convert(["convert", str(recipe), "-o", str(out), "-q"], killer=[mode, "2"], env=env)
    assert killed.returncode == -9
    assert not out.exists()
    state = json.loads((api.partial_dir(out) / "work" / "state.json").read_text())
    assert state["next_layer"] == (3 if mode == "after" else 2)
    resumed = _run_convert(["convert", str(recipe), "-o", str(out)], env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after layer" in (out / "convert.log").read_text()
    for f in ("model.safetensors", "config.json"):
        assert (ref / f).read_bytes() == (out / f).read_bytes(), f
    man_ref = json.loads((ref / "manifest.json").read_text())
    man_out = json.loads((out / "manifest.json").read_text())
    untimed = (lambda layers: {k: {f: x for f, x in v.items() if not f.endswith("seconds")} for k, v in layers.items()})
    assert untimed(man_ref["layers"]) == untimed(man_out["layers"])  # every figure but the clocks


def test_changed_recipe_is_refused_then_restarted(tmp_path, calib_text, tiny_llama):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_recipe(
        tiny_llama, calib_text, [{"method": "gptq", "scheme": "W4A16", "group_size": 16}]))
    out = tmp_path / "out"
    killed = _run_convert(["convert", str(recipe), "-o", str(out), "-q"], killer=["after", "0"])
    assert killed.returncode == -9
    changed = _run_convert(["convert", str(recipe), "-o", str(out), "-q", "--set", "stages[0].group_size=32"])
    assert changed.returncode == 2
    assert "an unfinished conversion with a different recipe is here; run again with --restart" in changed.stderr
    restarted = _run_convert(["convert", str(recipe), "-o", str(out), "-q", "--set", "stages[0].group_size=32",
                              "--restart"])
    assert restarted.returncode == 0, restarted.stderr
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["weights"]["group_size"] == 32
    shutil.rmtree(out)


def _layer_tensors(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def test_chunked_forward_matches_one_chunk(tiny_llama, calib_text, tmp_path):
    """Chunks of 3+3+2 samples vs all 8 at once: the same Hessians up to summation order, so GPTQ picks
    (nearly) the same codes and the manifest's diagnostics agree."""
    stages = [{"method": "gptq", "scheme": "W4A16", "group_size": 16, "actorder": "static"}]
    outs = {}
    for bs in (3, 8):
        r = tiny_recipe(tiny_llama, calib_text, stages)
        r["calibration"]["batch_size"] = bs
        outs[bs] = tmp_path / f"bs{bs}"
        api.convert(parse_recipe(r), outs[bs], quiet=True)
    a, b = _layer_tensors(outs[3]), _layer_tensors(outs[8])
    assert a.keys() == b.keys()
    packed = [k for k in a if k.endswith("weight_packed")]
    same = sum(int(torch.equal(a[k], b[k])) for k in packed)
    assert same >= 0.8 * len(packed), f"only {same}/{len(packed)} modules got identical codes"
    for k in packed:  # where a code differs, it is a rare tie broken the other way
        assert (a[k] != b[k]).float().mean() < 0.01, k
    la = json.loads((outs[3] / "manifest.json").read_text())["layers"]
    lb = json.loads((outs[8] / "manifest.json").read_text())["layers"]
    for name in la:
        assert la[name]["output_sqnr_db"] == pytest.approx(lb[name]["output_sqnr_db"], abs=0.05)


def test_failure_inside_the_chunked_forward_stops_every_chunk(tiny_llama, calib_text, tmp_path, monkeypatch):
    import gc

    from quantkit.quantize import layers, walk

    calls = []

    def fail_on_second_group(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise ConvertError("simulated quantizer failure")
        return real(*a, **k)

    real = layers.quantize_group
    monkeypatch.setattr(layers, "quantize_group", fail_on_second_group)
    with pytest.raises(ConvertError, match="simulated quantizer failure"):
        _convert(tiny_llama, calib_text, [{"method": "gptq", "scheme": "W4A16", "group_size": 16}], tmp_path / "o")
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, walk._Chunk) and o], "a chunk is left suspended"
    assert torch.is_grad_enabled()  # the scheduler's grad mode is restored


class _CountingCheckpoint:
    """A LazyCheckpoint that records which tensors were read whole and which by rows."""

    def __new__(cls, folder):
        from quantkit.model.checkpoint import LazyCheckpoint

        class Counting(LazyCheckpoint):
            def __init__(self, f):
                super().__init__(f)
                self.whole: list[str] = []
                self.by_rows: dict[str, list[int]] = {}

            def get_many(self, keys):
                self.whole += keys
                return super().get_many(keys)

            def get_rows(self, key, rows):
                self.by_rows[key] = rows.tolist()
                return super().get_rows(key, rows)

        return Counting(folder)


@pytest.mark.parametrize("model_type", ["llama", "gemma"])  # gemma scales its embeddings by sqrt(hidden)
def test_capture_reads_only_the_embedding_rows_of_the_calibration_tokens(tmp_path, model_type):
    """The first layer's input from the rows of the tokens in use (each read alone from the file) is
    exactly what the whole float model feeds its first layer; the table is never read whole and is left
    released, its padding index as it was."""
    from transformers import AutoModelForCausalLM

    from quantkit.model.arch import arch_for
    from quantkit.model.checkpoint import build_skeleton
    from quantkit.quantize.walk import capture_layer_inputs

    folder = make_tiny_model(tmp_path / model_type, model_type)
    full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 40, 41, 200, 7], [300, 5, 6, 9, 9, 41, 2]])
    with torch.no_grad():
        expected = full(ids, output_hidden_states=True, use_cache=False).hidden_states[0]
    skeleton = build_skeleton(folder, "float32")
    arch = arch_for(skeleton.config)
    ckpt = _CountingCheckpoint(folder)
    embed = skeleton.get_submodule(arch.embed)
    padding = embed.padding_idx
    first, _ = capture_layer_inputs(skeleton, arch, ckpt, ids, torch.float32, 1)
    assert torch.equal(first, expected)
    key = arch.embed + ".weight"
    assert key not in ckpt.whole and ckpt.by_rows[key] == [2, 5, 6, 7, 9, 40, 41, 200, 300]
    assert embed.weight.is_meta and embed.weight.shape == (len(full.model.embed_tokens.weight), 64)
    assert embed.padding_idx == padding


def test_checkpoint_rows_match_the_whole_tensor(tiny_llama):
    from quantkit.model.checkpoint import LazyCheckpoint

    ckpt = LazyCheckpoint(tiny_llama)
    key = "model.embed_tokens.weight"
    whole = ckpt.get(key)
    for rows in ([0], [3, 4, 5, 9, 11, 12], list(range(whole.shape[0])), [whole.shape[0] - 1], []):
        r = torch.tensor(rows, dtype=torch.long)
        assert torch.equal(ckpt.get_rows(key, r), whole[r])


def test_gptq_factoring_the_hessian_in_place_changes_no_weight(tiny_llama, calib_text, tmp_path, monkeypatch):
    """With nothing reading a group's Hessian after its solve, GPTQ makes its factor in H's buffer and the
    output SQNR comes from the signal measured before and GPTQ's own noise; with the registry saying GPTQ
    reports no noise, H stays whole and the SQNR is the product with H. Every exported tensor is bit for bit
    the same, and each module's output SQNR agrees to 0.01 dB (also in bf16, where the signal's products are
    bf16 in both)."""
    import dataclasses

    from quantkit.algorithms import gptq, registry

    consumed = []
    real_factor = gptq.gptq_factor
    monkeypatch.setattr(gptq, "gptq_factor", lambda H, *a, **kw: (consumed.append(kw.get("consume")),
                                                                   real_factor(H, *a, **kw))[1])
    stages = [{"method": "gptq", "scheme": "W4A16", "group_size": 16, "actorder": "static"}]
    outs = {}
    for reports in (True, False):
        monkeypatch.setitem(registry.METHODS, "gptq",
                            dataclasses.replace(registry.METHODS["gptq"], reports_output_noise=reports))
        r = tiny_recipe(tiny_llama, calib_text, stages)
        outs[reports] = tmp_path / f"reports-{reports}"
        consumed.clear()
        api.convert(parse_recipe(r), outs[reports], quiet=True)
        assert consumed and all(c is reports for c in consumed)  # 4 groups x 2 layers: every Hessian, or none
    a, b = _layer_tensors(outs[True]), _layer_tensors(outs[False])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la = json.loads((outs[True] / "manifest.json").read_text())["layers"]
    lb = json.loads((outs[False] / "manifest.json").read_text())["layers"]
    assert la.keys() == lb.keys() and la
    for name in la:
        assert la[name]["output_sqnr_db"] == pytest.approx(lb[name]["output_sqnr_db"], abs=0.01), name


def test_output_signals_measured_from_few_inputs_agree_with_the_hessians(tiny_llama, calib_text, tmp_path,
                                                                         monkeypatch):
    """With no more calibration tokens than a group's inputs (64 here), each GPTQ member's output energy is
    measured from the inputs during the forward instead of from H after it: the manifest's output SQNRs agree
    with the Hessian path's within 0.01 dB, and the exports are the same bytes (only a diagnostic moved)."""
    from quantkit.quantize import layers

    stages = [{"method": "gptq", "scheme": "W4A16", "group_size": 16}]
    measured: list[bool] = []
    real = layers.GroupInputs.energies
    outs = {}
    for from_inputs in (True, False):
        def energies(self, x, on=from_inputs):
            e = real(self, x) if on else None
            measured.append(e is not None)
            return e

        monkeypatch.setattr(layers.GroupInputs, "energies", energies)
        r = tiny_recipe(tiny_llama, calib_text, stages)
        r["calibration"].update(num_samples=2, seq_len=32, batch_size=1)
        outs[from_inputs] = tmp_path / f"inputs-{from_inputs}"
        measured.clear()
        api.convert(parse_recipe(r), outs[from_inputs], quiet=True)
        assert measured and all(m is from_inputs for m in measured), measured  # every chunk of every group
    a, b = _layer_tensors(outs[True]), _layer_tensors(outs[False])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la = json.loads((outs[True] / "manifest.json").read_text())["layers"]
    lb = json.loads((outs[False] / "manifest.json").read_text())["layers"]
    assert la.keys() == lb.keys() and la
    for name in la:
        assert la[name]["output_sqnr_db"] == pytest.approx(lb[name]["output_sqnr_db"], abs=0.01), name


def test_weights_the_chunks_have_passed_are_dropped_and_the_export_is_unchanged(tiny_llama, calib_text, tmp_path,
                                                                                 monkeypatch, caplog):
    """While a group is solved, the modules of the groups before it hold no weight (every chunk is past them:
    for an 8B layer, 304 MB less at down_proj's solve), and the export is bit for bit the one made with every
    weight kept; no dropped weight is read again (the guard's warning never fires). Chunks of 3+3+2 samples,
    so the drop happens with several chunks paused."""
    from quantkit.quantize import layers

    seen: list[tuple[str, set[str]]] = []
    real_group = layers.quantize_group

    def spy(layer_root, prefix, members, *a, **kw):
        meta = {n for n, m in layer_root.named_modules() if isinstance(m, torch.nn.Linear) and m.weight.is_meta}
        seen.append((members[0].name[len(prefix):], meta))
        return real_group(layer_root, prefix, members, *a, **kw)

    monkeypatch.setattr(layers, "quantize_group", spy)
    stages = [{"method": "gptq", "scheme": "W4A16", "group_size": 16, "actorder": "static"}]
    outs = {}
    for drop in (True, False):
        if not drop:
            monkeypatch.setattr(layers._PassedWeights, "drop", lambda self, plan, results: None)
        r = tiny_recipe(tiny_llama, calib_text, stages)
        r["calibration"]["batch_size"] = 3
        outs[drop] = tmp_path / f"drop-{drop}"
        seen.clear()
        with caplog.at_level("WARNING", logger="quantkit"):
            api.convert(parse_recipe(r), outs[drop], quiet=True)
        if drop:  # Llama's groups in forward order: q/k/v, o, gate/up, down, in each of the 2 layers
            attn = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
            expected = [set(), attn, attn | {"self_attn.o_proj"}, attn | {"self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"}]
            assert [m for _, m in seen] == expected * 2, seen
        else:
            assert all(not m for _, m in seen)
    assert not [m for m in caplog.messages if "after its group was passed" in m]
    a, b = _layer_tensors(outs[True]), _layer_tensors(outs[False])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_large_groups_typed_results_wait_on_disk_and_the_export_is_unchanged(tiny_llama, calib_text, tmp_path,
                                                                             monkeypatch):
    """A large group's typed results wait in the work folder's spill files until their layer is saved (for an
    8B layer, q/k/v/o and gate/up's 151 MB of codes at down_proj's solve): with every group counted large, the
    export is bit for bit the one made with everything in memory, the spill files existed while layers were
    solved, and none is left behind."""
    from quantkit.quantize import layers, workdir

    spilled: list[Path] = []
    real = workdir.SpilledTyped.__init__

    def spy(self, path, tensors):
        real(self, path, tensors)
        assert path.is_file()
        spilled.append(path)

    monkeypatch.setattr(workdir.SpilledTyped, "__init__", spy)
    stages = [{"method": "gptq", "scheme": "W4A16", "group_size": 16, "actorder": "static"}]
    outs = {}
    for large in (1, 1 << 60):
        monkeypatch.setattr(layers, "TRIM_AFTER", large)
        outs[large] = tmp_path / f"large-{large}"
        api.convert(parse_recipe(tiny_recipe(tiny_llama, calib_text, stages)), outs[large], quiet=True)
    assert len(spilled) == 14  # 7 Linears in each of the 2 layers, every one spilled once, none in the second run
    assert not any(p.exists() for p in spilled)
    a, b = _layer_tensors(outs[1]), _layer_tensors(outs[1 << 60])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("spill", [False, True])
def test_a_dropped_weight_read_again_is_put_back_bit_for_bit(caplog, tmp_path, spill):
    """A forward that reaches a dropped module (a plan whose group order differs from the forward's) gets the
    weight back from the typed result (in memory, or waiting in a spill file), equal to the dequantized weight
    it held, and the log says so."""
    from quantkit.algorithms import rtn
    from quantkit.algorithms.contract import ModuleResult, Observations
    from quantkit.quantize.layers import _PassedWeights
    from quantkit.quantize.workdir import compact
    from quantkit.schemes import SCHEMES

    torch.manual_seed(0)
    root = torch.nn.Sequential()
    root.add_module("proj", torch.nn.Linear(256, 32, bias=True).to(torch.bfloat16))  # two groups of 128
    spec = SCHEMES["W4A16"].weights
    stage = rtn.RTNStage(method="rtn", scheme="W4A16")
    q = rtn.quantize([root.proj.weight.detach()], Observations(), spec, stage, torch.bfloat16)[0]
    deq = q.weight.to(torch.bfloat16)
    root.proj.weight.data = deq.clone()
    res = ModuleResult("model.layers.0.proj", {}, q, spec)
    compact(res, tmp_path / "spill" if spill else None)
    assert (tmp_path / "spill" / "model.layers.0.proj.safetensors").is_file() == spill
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, deq, root.proj.bias)
    passed = _PassedWeights()
    passed.install(root)
    passed.drop(_Prefix("model.layers.0."), [res])  # drop reads only the plan's prefix
    assert root.proj.weight.is_meta
    with caplog.at_level("WARNING", logger="quantkit"):
        got = root(x)
    assert torch.equal(got, want) and torch.equal(root.proj.weight, deq)
    assert any("after its group was passed" in m for m in caplog.messages)
    passed.remove()
    del passed, res  # a spill file goes with its result
    assert not (tmp_path / "spill" / "model.layers.0.proj.safetensors").exists()


class _Prefix:
    def __init__(self, prefix: str):
        self.prefix = prefix
