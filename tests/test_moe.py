"""Mixture-of-experts models (Qwen3-MoE, Mixtral): the unfused block routes exactly like transformers', every
expert is calibrated on the tokens routed to it (or takes the documented fallback), the router stays in
full precision, and the export reloads bit-exact in transformers."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import make_tiny_model, tiny_recipe
from quantkit import api
from quantkit.plan import ConvertError
from quantkit.recipe import parse_recipe

FAMILIES = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}  # where each family's checkpoints keep the block
LINEARS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_model(request, tmp_path_factory):
    return request.param, make_tiny_model(tmp_path_factory.mktemp("moe") / request.param, request.param)


def _reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _calibration_ids(recipe):
    from quantkit.data import build_calibration_set
    from quantkit.model.sources import load_tokenizer

    return build_calibration_set(recipe.calibration, load_tokenizer(recipe.model.path)).input_ids


def _fused(model, name: str) -> torch.Tensor:
    """The weight of one expert Linear inside transformers' fused experts (independent of quantkit's naming)."""
    parts = name.split(".")
    e, lin = int(parts[-2]), parts[-1]
    layer = model.model.layers[int(parts[2])]
    experts = layer.mlp.experts
    gate, up, down = LINEARS["mixtral"] if lin in LINEARS["mixtral"] else LINEARS["qwen3_moe"]
    inter = experts.down_proj.shape[-1]
    if lin == down:
        return experts.down_proj[e]
    return experts.gate_up_proj[e][:inter] if lin == gate else experts.gate_up_proj[e][inter:]


def test_unfused_block_routes_exactly_like_transformers(moe_model):
    from quantkit.model.checkpoint import LazyCheckpoint, build_skeleton, materialize
    from quantkit.model.moe import SparseMoE

    family, model_dir = moe_model
    ref = _reference(model_dir)
    ours = build_skeleton(model_dir, "float32")
    assert isinstance(ours.model.layers[0].get_submodule(FAMILIES[family]), SparseMoE)
    assert ours.model.layers[0].mlp is ours.model.layers[0].get_submodule(FAMILIES[family])
    ck = LazyCheckpoint(model_dir)
    materialize(ours.model, "model.", ck, torch.float32)
    if "lm_head.weight" in ck:
        materialize(ours.lm_head, "lm_head.", ck, torch.float32)
    ours.tie_weights()
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
        # equal to float32 rounding: the fused gate_up matmul and two separate ones reduce in the same order on
        # an AMX CPU (bit-equal there) but not on every CPU kind (AVX-512 without AMX: 1.3e-6 of 4.0, measured)
        torch.testing.assert_close(ours(ids).logits, want, rtol=1e-5, atol=1e-5)
        moe = ours.model.layers[0].get_submodule(FAMILIES[family])
        moe.experts[0], moe.experts[1] = moe.experts[1], moe.experts[0]  # a wrong routing is far outside that
        assert (ours(ids).logits - want).abs().max() > 1e-3


def _convert(family, model_dir, calib_text, tmp_path, stages=None, moe=None, name="out"):
    stages = stages or [{"method": "gptq", "scheme": "W4A16", "group_size": 32, "ignore": ["lm_head"]}]
    data = tiny_recipe(model_dir, calib_text, stages)
    if moe is not None:
        data["calibration"]["moe"] = moe
    r = parse_recipe(data)
    cap: dict = {}
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda rec: warned.append(rec.getMessage())
    logging.getLogger("quantkit").addHandler(handler)
    try:
        out = api.convert(r, tmp_path / name, quiet=True, on_weight=cap.__setitem__)
    finally:
        logging.getLogger("quantkit").removeHandler(handler)
    # the experts' groups follow the block's forward: no weight dropped behind the chunks is read again
    assert not [m for m in warned if "after its group was passed" in m]
    return r, out, cap, json.loads((out / "manifest.json").read_text())


def test_every_expert_is_calibrated_counted_and_reloads_exactly(moe_model, calib_text, tmp_path):
    from safetensors.torch import load_file

    from quantkit.evaluate.hf_perplexity import load_for_perplexity

    family, model_dir = moe_model
    r, out, cap, man = _convert(family, model_dir, calib_text, tmp_path, moe={"min_tokens": 1})
    block = FAMILIES[family]
    ref = _reference(model_dir)
    ids = _calibration_ids(r)
    sparse_layers = [0] if family == "qwen3_moe" else [0, 1]  # the tiny Qwen3-MoE keeps layer 1 dense
    top_k = ref.config.num_experts_per_tok
    n_exp = 8
    for li in sparse_layers:
        experts = {k: v for k, v in man["layers"].items() if k.startswith(f"model.layers.{li}.{block}.experts.")}
        assert len(experts) == 3 * n_exp  # every expert's three Linears quantized
        tokens = {v["expert"]: v["expert_tokens"] for v in experts.values()}
        assert sum(tokens.values()) == ids.numel() * top_k  # every routed token counted once per choice
        for v in experts.values():
            assert v["expert_calibration"] == ("routed" if v["expert_tokens"] >= 1 else "all_tokens")
        # the router: never quantized, listed as kept, stored exactly as the source had it
        router = f"model.layers.{li}.{block}.gate"
        assert router in man["quantization"]["modules_kept"] and router not in man["layers"]
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert all(f"model.layers.{li}.{block}.gate" in cfg["ignore"] for li in sparse_layers)
    sd = {}
    for f in out.glob("*.safetensors"):
        sd.update(load_file(str(f)))
    src = load_file(str(model_dir / "model.safetensors"))
    assert torch.equal(sd[f"model.layers.0.{block}.gate.weight"], src[f"model.layers.0.{block}.gate.weight"])
    if family == "qwen3_moe":  # the dense layer is quantized as a dense MLP
        assert "model.layers.1.mlp.down_proj" in man["layers"]
    # reload: transformers fuses the decompressed per-expert tensors into its 3-D parameters, bit-exact
    model, _ = load_for_perplexity(out)
    for name, want in cap.items():
        got = _fused(model, name) if ".experts." in name else model.get_submodule(name).weight
        assert torch.equal(got.float(), want.float()), name


def test_the_routed_tokens_make_each_experts_hessian(moe_model, calib_text, tmp_path):
    """An independent reference: the float model's layer-0 block input, routed by its own router; GPTQ on the
    Hessian of exactly one expert's routed tokens gives the weights the pipeline exported for that expert."""
    from quantkit.algorithms.gptq import gptq_factor, gptq_solve
    from quantkit.schemes import get_scheme

    family, model_dir = moe_model
    block = FAMILIES[family]
    gate_name, _, _ = LINEARS[family]
    stages = [{"method": "gptq", "scheme": "W4A16", "group_size": 32, "targets": [r"re:.*\.experts\..*"]}]
    r, out, cap, man = _convert(family, model_dir, calib_text, tmp_path, stages=stages, moe={"min_tokens": 1})
    ref = _reference(model_dir)
    seen = []
    hook = ref.model.layers[0].post_attention_layernorm.register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad():
        ref(_calibration_ids(r))
    hook.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1])
    router = ref.model.layers[0].mlp.gate
    probs = torch.softmax(x @ router.weight.t(), dim=-1)
    idx = torch.topk(probs, ref.config.num_experts_per_tok, dim=-1).indices
    counts = torch.bincount(idx.reshape(-1), minlength=8)
    got_counts = {v["expert"]: v["expert_tokens"] for k, v in man["layers"].items() if k.startswith("model.layers.0.")}
    assert [got_counts[e] for e in range(8)] == counts.tolist()
    e = int(counts.argmax())
    xe = x[(idx == e).any(-1)]
    spec = get_scheme("W4A16").with_overrides(group_size=32).weights
    name = f"model.layers.0.{block}.experts.{e}.{gate_name}"
    w = _fused(ref, name).float()

    def solve(H):
        return gptq_solve(w, gptq_factor(H, 0.01, "static"), spec, 128, "static", torch.bfloat16).weight

    routed = solve(2 * xe.t() @ xe / xe.shape[0])
    every = solve(2 * x.t() @ x / x.shape[0])
    same_routed = (routed == cap[name].float()).float().mean().item()
    same_every = (every == cap[name].float()).float().mean().item()
    assert same_routed > 0.98, same_routed  # the same up to float summation order in the two forwards
    assert same_every < same_routed - 0.05, (same_every, same_routed)  # and it is not the all-token answer


def test_rare_experts_take_the_fallback(moe_model, calib_text, tmp_path):
    from quantkit.algorithms.rtn import rtn
    from quantkit.schemes import get_scheme

    family, model_dir = moe_model
    block = FAMILIES[family]
    # every expert under the threshold: all of them calibrate on every token
    _, _, cap_all, man = _convert(family, model_dir, calib_text, tmp_path, moe={"min_tokens": 10 ** 6}, name="all")
    calib = {v["expert_calibration"] for k, v in man["layers"].items() if ".experts." in k}
    assert calib == {"all_tokens"}
    _, _, cap_routed, _ = _convert(family, model_dir, calib_text, tmp_path, moe={"min_tokens": 1}, name="routed")
    name = f"model.layers.0.{block}.experts.0.{LINEARS[family][2]}"
    assert not torch.equal(cap_all[name], cap_routed[name])  # down_proj saw other inputs
    # rtn: round-to-nearest of the stored weight, nothing learnt from data
    _, _, cap_rtn, man = _convert(family, model_dir, calib_text, tmp_path, moe={"min_tokens": 10 ** 6, "fallback": "rtn"},
                                  name="rtn")
    ref = _reference(model_dir)
    spec = get_scheme("W4A16").with_overrides(group_size=32).weights
    for lin in LINEARS[family]:
        n = f"model.layers.0.{block}.experts.3.{lin}"
        assert man["layers"][n]["method"] == "rtn" and man["layers"][n]["expert_calibration"] == "rtn"
        assert torch.equal(cap_rtn[n].float(), rtn(_fused(ref, n).float(), spec, torch.bfloat16)[0].float()), n
    assert man["layers"]["model.layers.0.self_attn.q_proj"]["method"] == "gptq"  # the rest keeps its method


def test_router_is_refused_by_name_and_experts_keep_one_scheme(moe_model, calib_text, tmp_path):
    from quantkit.preflight import PreflightError

    family, model_dir = moe_model
    block = FAMILIES[family]
    router = f"model.layers.0.{block}.gate"
    r = parse_recipe(tiny_recipe(model_dir, None, [{"method": "rtn", "scheme": "W8A16", "targets": ["Linear", router]}]))
    with pytest.raises(ConvertError, match=r"names the router .*full precision"):
        api.convert(r, tmp_path / "a", quiet=True)
    split = [{"method": "rtn", "scheme": "W8A16", "targets": [rf"re:.*\.experts\.[0-3]\..*"]},
             {"method": "rtn", "scheme": "W4A16", "group_size": 32}]
    r = parse_recipe(tiny_recipe(model_dir, None, split))
    with pytest.raises(PreflightError, match=rf"model\.layers\.0\.{block} \(its experts: stages\[0\] W8A16, "
                                              r"stages\[1\] W4A16\)"):
        api.convert(r, tmp_path / "b", quiet=True)
    assert not (tmp_path / "b").exists()


def test_qat_is_refused_plainly_on_moe(moe_model, calib_text, tmp_path):
    family, model_dir = moe_model
    data = tiny_recipe(model_dir, calib_text, [{"method": "qat", "scheme": "W4A16", "group_size": 32, "steps": 4, "warmup_steps": 1}])
    with pytest.raises(ConvertError, match=r"stages\[0\]: QAT does not run on mixture-of-experts"):
        api.convert(parse_recipe(data), tmp_path / "q", quiet=True)


def test_moe_settings_are_checked():
    from quantkit.recipe import RecipeError

    with pytest.raises((RecipeError, ValueError), match="fallback"):
        parse_recipe({"name": "x", "model": {"path": "m"}, "stages": [{"method": "rtn", "scheme": "W8A16"}],
                      "calibration": {"sources": [{"type": "text", "path": "*.txt"}], "moe": {"fallback": "skip"}}})


def test_preflight_small_model_keeps_sparse_and_dense_layers_apart(tmp_path):
    """Qwen3-MoE with a dense layer: the pre-flight's small model has one sparse and one dense layer, in the
    order of the plan's layouts, with every expert of the real config."""
    from quantkit import preflight as pf
    from quantkit.model.arch import arch_for
    from quantkit.model.checkpoint import build_skeleton
    from quantkit.plan import make_plan

    model_dir = make_tiny_model(tmp_path / "q", "qwen3_moe", overrides={"mlp_only_layers": [0]})
    r = parse_recipe(tiny_recipe(model_dir, None, [{"method": "rtn", "scheme": "W8A16"}]))

    def plan_of(folder, recipe):
        m = build_skeleton(folder, "bfloat16")
        return make_plan(m, arch_for(m.config), recipe)

    plan = plan_of(model_dir, r)
    assert plan.layers[0].moe is None and plan.layers[1].moe == "mlp"
    layouts = pf.layer_layouts(plan)
    dense = [j for j, lay in enumerate(layouts) if not any(".experts." in n for n in lay)]
    assert dense == [0]
    small = pf.build_small_model(model_dir, len(layouts), tmp_path / "small", "bfloat16", dense)
    splan = plan_of(small, parse_recipe(pf.small_recipe(r, small, layouts, "model.layers")))
    assert [{t.name[len(lp.prefix):] for t in lp.targets} for lp in splan.layers] == [set(lay) for lay in layouts]
    assert sum(".experts." in n for n in layouts[1]) == 3 * 8
