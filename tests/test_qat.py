"""Quantization-aware training: straight-through / LSQ gradients by hand, QAT lowers the held-out loss
against the float teacher, a crashed run resumes to the same weights, the export reloads like training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model, tiny_recipe
from quantkit import api
from quantkit.quantize import finetune as qat_runner
from quantkit.algorithms.qat import QATFormat, QATLinear, fake_quant_activations_ste, latent_init
from quantkit.algorithms.rtn import fake_quantize_activations, rtn
from quantkit.recipe import RecipeError, parse_recipe
from quantkit.schemes import ActivationSpec, WeightSpec

W4 = WeightSpec(4, "int", True, "group", 4)
W4_ASYM = WeightSpec(4, "int", False, "group", 4)


@pytest.fixture(autouse=True)
def _one_thread():
    """Determinism, and speed: on a loaded 2-core machine one thread beats two spinning ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def peaky_llama(tmp_path_factory) -> Path:
    """The tiny Llama with larger (tied) embeddings, so its next-token distribution is far from uniform
    and 4-bit rounding moves it measurably (the default tiny model's logits are almost flat)."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path_factory.mktemp("peaky") / "m", "llama", seed=1)
    sd = load_file(str(folder / "model.safetensors"))
    sd["model.embed_tokens.weight"] = (sd["model.embed_tokens.weight"].float() * 25).to(torch.bfloat16)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _qat(**kw) -> dict:
    st = {"method": "qat", "scheme": "W4A16", "group_size": 16, "steps": 30, "lr": 3e-4, "warmup_steps": 3,
          "batch_size": 4, "seq_len": 32, "eval_every": 10, "checkpoint_every": 10, "eval_samples": 8}
    st.update(kw)
    return st


def _convert(model_dir, calib, stages, out, **kw):
    r = parse_recipe(tiny_recipe(model_dir, calib, stages))
    cap: dict = {}
    api.convert(r, out, quiet=True, on_weight=cap.__setitem__, **kw)
    return r, cap, json.loads((out / "manifest.json").read_text())


# ---------------------------------------------------------------------------------- gradients by hand
def _one_group(spec, learn, w, s=0.125, z=None):
    m = QATLinear(torch.tensor([w]), None, torch.tensor([[s]]), None if z is None else torch.tensor([[float(z)]]),
                  torch.zeros(4, dtype=torch.long), QATFormat(spec, None, learn, torch.bfloat16))
    wq = m.quantized_weight()
    wq.backward(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    return m, wq


def test_ste_weight_gradient_is_identity_inside_and_zero_outside():
    # s = 0.125 (exact in bf16); w/s = 2.4 (inside), -9.6 (below qmin -8), 7.6 (above qmax 7), 0.5 (ties to even)
    m, wq = _one_group(W4, False, [0.3, -1.2, 0.95, 0.0625])
    assert torch.equal(wq, torch.tensor([[0.25, -1.0, 0.875, 0.0]]))
    assert torch.equal(m.weight.grad, torch.tensor([[1.0, 0.0, 0.0, 4.0]]))


def test_lsq_scale_gradient():
    # dw_hat/ds: round(v) - v inside, qmin below, qmax above -> 1*(2-2.4) + 2*(-8) + 3*7 + 4*(0-0.5) = 2.6
    m, _ = _one_group(W4, True, [0.3, -1.2, 0.95, 0.0625])
    assert m.weight_scale.grad.item() == pytest.approx(2.6, abs=1e-5)
    assert torch.equal(m.weight.grad, torch.tensor([[1.0, 0.0, 0.0, 4.0]]))
    # asymmetric, z = 3: v = w/s + 3 = 5.4, -6.6, 10.6, 3.5 -> only 10.6 clamps (to 7);
    # ds = round(v) - v inside, qmax - z above: (5 - 5.4), (-7 + 6.6), 4, (4 - 3.5) -> -0.4 - 0.8 + 12 + 2
    m, wq = _one_group(W4_ASYM, True, [0.3, -1.2, 0.95, 0.0625], z=3)
    assert torch.allclose(wq, torch.tensor([[0.25, -1.25, 0.5, 0.125]]))
    assert torch.equal(m.weight.grad, torch.tensor([[1.0, 2.0, 0.0, 4.0]]))
    assert m.weight_scale.grad.item() == pytest.approx(12.8, abs=1e-4)


@pytest.mark.parametrize("spec", [W4, W4_ASYM], ids=["sym", "asym"])
def test_grouped_fake_quant_matches_the_indexed_one(spec):
    """The grouped view (contiguous groups) and the per-column indexed path (any g_idx) are the same
    function: the same forward bits and weight gradient, and the scale gradient up to summation order."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g) * 0.1
    spec = dataclasses.replace(spec, group_size=16)
    deq, qp = rtn(w, spec)
    runs = []
    for grouped in (True, False):
        m = QATLinear(latent_init(w, deq, qp.scale.float()[:, torch.arange(64) // 16]), None, qp.scale,
                      qp.zero_point, torch.arange(64) // 16, QATFormat(spec, None, True, torch.bfloat16))
        assert m._contiguous
        m._contiguous = grouped
        wq = m.quantized_weight()
        wq.backward(torch.randn(16, 64, generator=torch.Generator().manual_seed(4)))
        runs.append((wq.detach(), m.weight.grad, m.weight_scale.grad))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert torch.allclose(runs[0][2], runs[1][2], rtol=1e-5, atol=1e-6)


def test_activation_ste_is_identity():
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    spec = ActivationSpec(8, "int")
    y = fake_quant_activations_ste(x, spec)
    assert torch.equal(y, fake_quantize_activations(x.detach(), spec))
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_latent_start_keeps_the_ptq_codes():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    spec = WeightSpec(4, "int", True, "group", 16)
    deq, qp = rtn(w, spec)
    s_cols = qp.scale.repeat_interleave(16, dim=1)  # [8, 2] -> [8, 32]
    g = torch.arange(32) // 16
    gptq_like = deq + s_cols * torch.sign(w - deq)  # another grid point, one step away
    gptq_like = torch.round(gptq_like / s_cols).clamp(-8, 7) * s_cols
    for start in (deq, gptq_like):
        lat = latent_init(w, start, s_cols)
        m = QATLinear(lat, None, qp.scale, None, g, QATFormat(spec, None, False, torch.bfloat16))
        assert torch.equal(m.export()[0], start)
        assert ((lat - start).abs() <= 0.45 * s_cols + 1e-7).all()


# ------------------------------------------------------------------------------- top-k distillation
def _coarse_kl(t: torch.Tensor, s: torch.Tensor, k: int) -> float:
    """Independent reference, float64, one position at a time: KL between the teacher's k most likely
    tokens plus 'everything else' and the student's probabilities of the same k + 1 outcomes."""
    total, n = 0.0, 0
    for tv, sv in zip(t.reshape(-1, t.shape[-1]), s.reshape(-1, s.shape[-1])):
        pt, ps = tv.double().softmax(-1), sv.double().softmax(-1)
        top = sorted(range(len(pt)), key=lambda i: -float(pt[i]))[:k]
        bt = [float(pt[i]) for i in top] + [1 - sum(float(pt[i]) for i in top)]
        bs = [float(ps[i]) for i in top] + [1 - sum(float(ps[i]) for i in top)]
        total += sum(a * torch.log(torch.tensor(a / b, dtype=torch.float64)).item() for a, b in zip(bt, bs) if a > 0)
        n += 1
    return total / n


def test_topk_kd_is_the_kl_of_the_coarsened_distributions():
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 5, 40, generator=g) * 3, torch.randn(2, 5, 40, generator=g) * 3  # [b, L, vocab]
    for k in (1, 4, 16):
        got = float(qat_runner.kd_topk_loss(s, qat_runner.TopK.of(t, k)))
        assert got == pytest.approx(_coarse_kl(t, s, k), rel=1e-4, abs=1e-6), k
        assert got <= float(qat_runner.kd_loss(s, t)) + 1e-6  # coarsening never adds divergence
    # with one token left in the tail the coarsened distributions are the full ones: same loss, same gradient
    a, b = s.clone().requires_grad_(), s.clone().requires_grad_()
    top = qat_runner.TopK.of(t, 1000)  # k is capped at vocab - 1
    assert top.index.shape[-1] == 39
    la, lb = qat_runner.kd_topk_loss(a, top), qat_runner.kd_loss(b, t)
    la.backward(), lb.backward()
    assert float(la.detach()) == pytest.approx(float(lb.detach()), rel=1e-5)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_teacher_targets_are_computed_once_per_window():
    from types import SimpleNamespace

    table = torch.randn(50, 30, generator=torch.Generator().manual_seed(1)) * 4  # token -> logits

    class CountingTeacher:
        windows = 0

        def __call__(self, input_ids, use_cache):
            self.windows += input_ids.shape[0]
            return SimpleNamespace(logits=table[input_ids])  # [b, L, vocab]

    train = [torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(2)) for _ in range(2)]
    teacher = CountingTeacher()
    tt = qat_runner.TeacherTargets(teacher, train, 5, None)
    keys = [(0, 1), (1, 2), (0, 1)]
    first = tt.get(keys, torch.device("cpu"))
    assert teacher.windows == 2  # two distinct windows, each computed on its own
    again = tt.get(keys, torch.device("cpu"))
    assert teacher.windows == 2 and torch.equal(first.logp, again.logp)
    want = qat_runner.TopK.of(table[train[1][2]], 5)
    assert torch.equal(first.index[1], want.index) and torch.equal(first.logp[1], want.logp)
    assert torch.equal(first.tail[1], want.tail)
    tt.precompute(torch.device("cpu"), 4, quiet=True)
    assert teacher.windows == 6 and len(tt.cache) == 6  # the four not yet drawn, in one pass
    assert tt.summary()["windows_cached"] == 6 and 0 < tt.summary()["topk_mass_mean"] < 1


# ------------------------------------------------------------------------------------------ training
def test_qat_lowers_heldout_kl_and_export_reloads_like_training(peaky_llama, calib_text, tmp_path, monkeypatch):
    kept = {}
    orig = qat_runner.build_student

    def spy(*a, **k):
        kept["student"], modules, teacher = orig(*a, **k)  # trained in place by qat.run
        return kept["student"], modules, teacher

    monkeypatch.setattr(qat_runner, "build_student", spy)
    out = tmp_path / "out"
    r, cap, man = _convert(peaky_llama, calib_text, [_qat()], out)
    q = man["qat"]
    before, after = q["heldout_before"]["kl"], q["heldout_after"]["kl"]
    assert after < 0.7 * before, (before, after)  # QAT from RTN recovers most of the KL to the float model
    # a qat stage alone starts from round-to-nearest, and the plan says so (it used to record "qat")
    assert q["starts_from"] == ["rtn"] and len(q["train_loss"]) == 30 and q["wall_time_s"] > 0
    assert {(v["stage"], v["method"]) for v in man["layers"].values()} == {(0, "rtn")}
    assert (out / "qat_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "qat_loss.png" in man["files"]
    # the export reloads with the outputs the trained (fake-quant) model had in training
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = kept["student"](ids).logits
        b = got(ids).logits
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    for name, w in cap.items():
        assert torch.equal(got.get_submodule(name).weight.to(torch.bfloat16), w.to(torch.bfloat16)), name


def test_early_stop_keeps_the_best_evaluation_not_the_last(peaky_llama, calib_text, tmp_path):
    """A learning rate that wrecks the model: the held-out KL rises at the first evaluation, training stops
    (patience 1), and the export holds the best weights seen, here the PTQ start itself."""
    _, rtn_weights, _ = _convert(peaky_llama, calib_text, [{"method": "rtn", "scheme": "W4A16", "group_size": 16}],
                                 tmp_path / "rtn")
    out = tmp_path / "out"
    _, cap, man = _convert(peaky_llama, calib_text, [_qat(lr=0.5, warmup_steps=1, eval_every=2, checkpoint_every=5,
                                                          early_stop={"patience": 1, "min_delta": 0.001})], out)
    q = man["qat"]
    assert q["stopped_early"]["step"] == 2 and q["steps_trained"] == 2 and len(q["train_loss"]) == 2
    assert [e["step"] for e in q["eval"]] == [0, 2] and q["eval"][1]["kl"] > q["eval"][0]["kl"]
    assert q["kept_step"] == 0 and q["heldout_after"] == q["heldout_before"] and q["heldout_last"] == q["eval"][1]
    assert q["early_stop"] == {"patience": 1, "min_delta": 0.001}
    assert cap.keys() == rtn_weights.keys()
    for name, w in cap.items():
        assert torch.equal(w, rtn_weights[name]), name
    assert (out / "qat_loss.png").is_file()


def test_keep_best_tracks_the_lowest_loss_and_min_delta_only_sets_the_patience():
    """A run whose held-out KL keeps falling by less than min_delta: every new low is the kept weights (the
    export is never a worse evaluation than one already seen), while the patience counter runs on."""
    from quantkit.quantize.finetune import judge

    kls, best, waited, kept, stops = [0.30, 0.20, 0.1995, 0.1992, 0.25, 0.1990], 1e9, 0, [], []
    for step, kl in enumerate(kls):
        lower, waited = judge(best, waited, kl, min_delta=0.001)
        if lower:
            best, kept = kl, kept + [step]
        stops.append(waited)
    assert kept == [0, 1, 2, 3, 5]  # every new low, however small the fall
    assert stops == [0, 0, 1, 2, 3, 4]  # falls under min_delta do not reset the patience
    assert judge(0.2, 5, 0.1, 0.0) == (True, 0) and judge(0.2, 0, 0.2, 0.0) == (False, 1)


def test_w8a8_qat_after_gptq_reloads(peaky_llama, calib_text, tmp_path):
    # transformers quantizes activations with absmax / 127.5, quantkit (and vLLM) with absmax / 127
    out = tmp_path / "out"
    stages = [{"method": "gptq", "scheme": "W8A8"}, _qat(scheme="W8A8", group_size=None, steps=6, loss="ce")]
    r, cap, man = _convert(peaky_llama, calib_text, stages, out)
    assert man["qat"]["starts_from"] == ["gptq"] and man["qat"]["loss"] == "ce"
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "int-quantized" and cfg["config_groups"]["group_0"]["input_activations"]["dynamic"]
    from quantkit.export.reader import fake_quant_model
    from transformers import AutoModelForCausalLM

    ref = fake_quant_model(peaky_llama, r, cap)
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits, got(ids).logits
    assert (a - b).abs().max() <= 0.1 * a.abs().max()


def test_resume_after_crash_gives_the_same_weights(peaky_llama, calib_text, tmp_path, monkeypatch):
    stages = [{"method": "gptq", "scheme": "W4A16", "group_size": 16},
              _qat(steps=8, checkpoint_every=3, eval_every=4, scales="learned")]
    ref = tmp_path / "ref"
    _convert(peaky_llama, calib_text, stages, ref)

    real_lr = qat_runner.lr_at

    def crash(step, st):  # the learning rate of step index 5 is asked for after 5 steps are done
        if step == 5:
            raise KeyboardInterrupt("simulated crash after step 5")
        return real_lr(step, st)

    monkeypatch.setattr(qat_runner, "lr_at", crash)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _convert(peaky_llama, calib_text, stages, out)
    state = json.loads((api.partial_dir(out) / "work" / "qat" / "state.json").read_text())
    assert state["step"] == 3 and state["checkpoint"] == "ckpt-000003.safetensors"
    monkeypatch.setattr(qat_runner, "lr_at", real_lr)  # (not undo(): that would also drop conftest's env)
    _, _, man = _convert(peaky_llama, calib_text, stages, out)
    assert man["qat"]["resumed_at_step"] == 3
    assert (ref / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    ref_man = json.loads((ref / "manifest.json").read_text())
    assert man["qat"]["train_loss"] == ref_man["qat"]["train_loss"]


# -------------------------------------------------------------------------------------------- recipe
@pytest.mark.parametrize("stages, expected", [
    ([{"method": "qat", "scheme": "W4A16"}, {"method": "rtn", "scheme": "W4A16"}],
     "stages[0].method: 'qat' must be the last stage (it fine-tunes what the stages before it produced): "
     "move it after stages[1]"),
    ([{"method": "qat", "scheme": "FP8_DYNAMIC"}], "stages[0].scheme: 'FP8_DYNAMIC' is not an integer weight scheme, which qat needs (use one of W8A8"),
    ([{"method": "qat", "scheme": "W4A16", "steps": 5, "warmup_steps": 5}],
     "stages[0].warmup_steps: 5 must be below steps (5)"),
    ([{"method": "qat", "scheme": "W4A16", "loss": "mse"}], "stages[0].loss: 'mse' is not allowed ('kd' or 'ce')"),
    ([{"method": "qat", "scheme": "W4A16", "lerning_rate": 1}], "unknown key 'lerning_rate' (allowed: "),
])
def test_qat_recipe_errors(tmp_path, stages, expected):
    data = tiny_recipe(tmp_path, tmp_path, stages)
    with pytest.raises(RecipeError) as ei:
        parse_recipe(data, "x.yaml")
    assert expected in str(ei.value)


def test_qat_needs_training_text(tmp_path):
    with pytest.raises(RecipeError, match=r"stages\[0\] \(qat\) needs calibration data"):
        parse_recipe(tiny_recipe(tmp_path, None, [{"method": "qat", "scheme": "W4A16"}]), "x.yaml")


# ------------------------------------------------------------------------------------------- slow
@pytest.mark.slow
def test_smollm2_w8a8_qat_serves_in_vllm(tmp_path, monkeypatch):
    """A short W8A8 QAT run of the demo model exports a checkpoint vLLM (CPU) loads and generates with."""
    import os
    from importlib import util

    from conftest import REPO
    from quantkit.recipe import load_recipe

    demo = Path(os.environ.get("QUANTKIT_REAL_HOME", Path.home() / ".cache" / "quantkit")) / "models" / "smollm2-135m"
    if not (demo / "config.json").is_file():
        pytest.skip("demo model missing: run `quantkit models fetch smollm2-135m` first (scripts/test.sh does)")
    if util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'quantkit[cpu]')")
    monkeypatch.chdir(REPO)
    r = load_recipe(REPO / "recipes" / "smollm2-w4a16-gptq-qat.yaml", [
        f"model.path={demo}", "calibration.num_samples=2",
        "stages=[{method: qat, scheme: W8A8, steps: 3, warmup_steps: 1, batch_size: 1, seq_len: 128, "
        "eval_every: 3, eval_samples: 2, lr: 0.00005}]"])
    out = api.convert(r, tmp_path / "w8a8-qat", quiet=True)
    man = json.loads((out / "manifest.json").read_text())
    assert man["qat"]["steps"] == 3 and (out / "qat_loss.png").is_file()
    from _serving import AGREEMENT_FLOOR, float_continuations, serve_and_agree

    text, agreement = serve_and_agree(out, tmp_path / "run", float_continuations(demo))
    assert len(text.split()) >= 3, text
    assert agreement >= AGREEMENT_FLOOR["W8A8"], agreement


def test_teacher_is_the_float_model_computed_by_the_student_tree(peaky_llama, calib_text, tmp_path, monkeypatch):
    """One model in memory: the teacher is the student's own module tree in float mode. Checked after an AWQ
    stage (folded norms, clipped weights): its logits equal an independently loaded float model's, bit for
    bit; a teacher call leaves the student exactly as it was; and the student is not the float model."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(peaky_llama, dtype=torch.float32).eval()
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = {}
    real = qat_runner.build_student

    def spy(*a, **k):
        student, modules, teacher = real(*a, **k)
        with torch.no_grad():
            seen["s0"] = student(input_ids=ids).logits
            seen["t"] = teacher(input_ids=ids).logits
            seen["s1"] = student(input_ids=ids).logits
        seen["swapped"] = sorted(teacher.originals)
        return student, modules, teacher

    monkeypatch.setattr(qat_runner, "build_student", spy)
    _convert(peaky_llama, calib_text, [{"method": "awq", "grid": 4}, {"method": "rtn", "scheme": "W4A16", "group_size": 16},
                                       _qat(steps=1, warmup_steps=0, eval_every=1, checkpoint_every=1)], tmp_path / "o")
    with torch.no_grad():
        want = ref(input_ids=ids).logits
    assert any("layernorm" in k for k in seen["swapped"])  # the AWQ fold rewrote norms: the teacher swaps them back
    assert torch.equal(seen["t"], want)
    assert torch.equal(seen["s0"], seen["s1"])
    assert (seen["s0"] - want).abs().max() > 1e-3
