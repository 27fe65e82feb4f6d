"""Pre-flight: will the engine load what this recipe is about to produce? Asked before any calibration, in three
steps each cheaper than the next is useful (format rules, capability, a small model served by vLLM); results
are cached per engine, machine and format. docs/design.md says how."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from quantkit.algorithms.registry import method_of
from quantkit.io import atomic_write_json, quantkit_home
from quantkit.targets import exact_targets
from quantkit.plan import ConvertError, Plan

log = logging.getLogger("quantkit")
MODES = ("engine", "capability", "off")
CACHE_VERSION = 1


class PreflightError(ConvertError):
    """The engine cannot load what the recipe would produce; said before any calibration."""


def default_mode() -> str:
    mode = os.environ.get("QUANTKIT_PREFLIGHT", "engine")
    if mode not in MODES:
        raise ValueError(f"QUANTKIT_PREFLIGHT={mode!r}: expected one of {', '.join(MODES)}")
    return mode


# ---------------------------------------------------------------------------------------- format rules
def fused_group_problems(plan: Plan, arch, recipe) -> list[str]:
    """Fused groups (q/k/v, gate/up) whose members would not share one scheme in the export."""
    problems = []
    for lp in plan.layers:
        owner = {t.name: t.stage for t in lp.targets}
        for group in lp.fused:
            names = [lp.prefix + local for local in group]
            stages = {owner.get(n) for n in names}
            if len(stages) > 1:
                if lp.moe is not None and group[0].startswith(lp.moe + ".experts."):
                    kinds = sorted({"not quantized" if owner.get(n) is None else
                                    f"stages[{owner[n].index}] {owner[n].config.scheme}" for n in names})
                    problems.append(f"{lp.prefix}{lp.moe} (its experts: {', '.join(kinds)})")
                    continue
                what = ", ".join(f"{n.rsplit('.', 1)[1]}: " + (f"stages[{owner[n].index}] {owner[n].config.scheme}"
                                                                 if n in owner else "not quantized") for n in names)
                problems.append(f"{lp.prefix.rstrip('.')} ({what})")
    return problems


def check_format_rules(plan: Plan, arch, recipe) -> None:
    bad = fused_group_problems(plan, arch, recipe)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise PreflightError(
            f"recipe {recipe.name!r}: vLLM fuses q/k/v into one Linear, gate/up into another and a sparse block's "
            "experts into one kernel, each with one scheme; these "
            f"fused groups would mix schemes: {'; '.join(bad[:3])}{more}. Give every member of a fused group the "
            "same stage (match or ignore them together in stages[*].targets / ignore)")


# ----------------------------------------------------------------------------------------- small model
def layer_layouts(plan: Plan) -> list[dict[str, int]]:
    """The distinct per-layer layouts (local module name -> owning stage), in first-seen order."""
    seen: list[dict[str, int]] = []
    for lp in plan.layers:
        lay = {t.name[len(lp.prefix):]: t.stage.index for t in lp.targets}
        if lay not in seen:
            seen.append(lay)
    return seen


def small_recipe(recipe, model_dir: Path, layouts: list[dict[str, int]], layers_path: str) -> dict:
    """The recipe's formats on the small model: one round-to-nearest stage per quantizer stage, its targets
    the exact modules of the small model's layers that carry it."""
    stages = []
    for si, st in enumerate(recipe.stages):
        if method_of(st).role == "rotation":  # it changes the format: untied embeddings
            stages.append(st.model_dump(mode="json"))
            continue
        if method_of(st).role != "quantizer":  # the small model checks formats: a fine-tune changes none
            continue
        names = [f"{layers_path}.{j}.{local}" for j, lay in enumerate(layouts) for local, s in lay.items() if s == si]
        if not names:
            continue
        stage = {"method": "rtn", "scheme": st.scheme, "targets": exact_targets(names), "ignore": ["lm_head"]}
        if st.group_size is not None:
            stage["group_size"] = st.group_size
        if st.symmetric is not None:
            stage["symmetric"] = st.symmetric
        stages.append(stage)
    return {"name": "preflight", "model": {"path": str(model_dir), "dtype": recipe.model.dtype,
                                           "compute_dtype": "float32"}, "stages": stages}


def build_small_model(model_dir: Path, layers: int, dest: Path, dtype: str, dense: list[int] | None = None) -> Path:
    """The real model's config with `layers` decoder layers and seeded random weights, and its tokenizer.
    `dense`: for a mixture-of-experts model with dense layers (Qwen3-MoE's mlp_only_layers), the small
    model's layers that are dense, so each layout lands on a layer of its kind."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    if dense is not None and hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = list(dense)
    torch.manual_seed(0)
    # made in the stored dtype: an fp32 model converted afterwards held both copies, and for a large
    # vocabulary (Llama-3.1-8B's two 128,256 x 4,096 tables) that raised the first conversion's peak from
    # 3.4 to 6.5 GB, before any layer was read
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:  # 3-D: transformers' fused experts
                p.normal_(0, 0.02)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    for f in model_dir.iterdir():  # the tokenizer and chat template, so the engine starts as it would
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                                         "merges.txt", "chat_template.jinja")):
            shutil.copy2(f, dest / f.name)
    return dest


def format_signature(recipe, layouts: list[dict[str, int]], config: dict) -> dict:
    """What decides whether the engine loads it: the schemes (as exported) per layer layout, and the
    architecture's shapes."""
    from quantkit.plan import stage_scheme

    schemes = {}
    for si, st in enumerate(recipe.stages):
        if method_of(st).role == "quantizer":
            s = stage_scheme(recipe, si)
            schemes[si] = {"scheme": s.name, "weights": vars(s.weights), "acts": s.activations is not None,
                           "format": s.format}
    arch_keys = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "num_experts",
                 "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
    return {"layouts": [sorted(lay.items()) for lay in layouts], "schemes": schemes,
            "architecture": {k: config.get(k) for k in arch_keys}}


# ---------------------------------------------------------------------------------------------- run
def preflight(recipe, model_dir: Path, plan: Plan, arch, mode: str, device: str = "cpu",
              progress: Callable[[str], None] | None = None) -> dict:
    """Refuse (PreflightError) what the engine cannot load; return what was checked, for the log/manifest."""
    from quantkit.engine.capability import recipe_can_run

    say = progress or log.info
    if mode not in MODES:
        raise ValueError(f"preflight {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        return {"mode": "off"}
    t0 = time.perf_counter()
    check_format_rules(plan, arch, recipe)
    ok, why = recipe_can_run(recipe, device)
    out = {"mode": mode, "format_rules": "ok", "capability": {"ok": ok, "reason": why or None}}
    if not ok:
        say(f"pre-flight: this machine's engine cannot serve the recipe ({why}); the export is not loaded here")
    if mode == "capability" or not ok:
        out["seconds"] = round(time.perf_counter() - t0, 3)
        return out
    out["engine"] = engine_check(recipe, Path(model_dir), plan, arch, device, say)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def engine_check(recipe, model_dir: Path, plan: Plan, arch, device: str, say) -> dict:
    from quantkit import hardware
    from quantkit.engine.vllm_server import vllm_version

    config = json.loads((model_dir / "config.json").read_text())
    layouts = layer_layouts(plan)
    key = {"version": CACHE_VERSION, "engine": f"vllm {vllm_version()}", "device": device,
           "machine": hardware.cpu_kind() if device == "cpu" else hardware.cuda_device(),
           "format": format_signature(recipe, layouts, config)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    record_path = quantkit_home() / "preflight" / f"{digest}.json"
    if record_path.is_file():
        rec = json.loads(record_path.read_text())
        if rec.get("key") == json.loads(json.dumps(key, default=str)):
            say(f"pre-flight: {'loaded' if rec['ok'] else 'REFUSED'} before ({record_path.name}, cached)")
            if not rec["ok"]:
                raise PreflightError(rec["error"])
            return {**rec["result"], "cached": True}
    say(f"pre-flight: a {len(layouts)}-layer model in the recipe's formats, loaded by vLLM (about a minute on a CPU)")
    t0 = time.perf_counter()
    ok, result, error = _load_small(recipe, model_dir, arch, layouts, record_path.with_suffix(".log"))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write_json(record_path, {"key": key, "ok": ok, "result": result, "error": error, "at": time.time()})
    if not ok:
        raise PreflightError(error)
    say(f"pre-flight: vLLM loaded it and generated a token in {result['seconds']:.0f} s")
    return result


def _load_small(recipe, model_dir: Path, arch, layouts, log_dest: Path) -> tuple[bool, dict, str | None]:
    """Build, export, serve, generate one token: (loaded, facts, error). The engine's log is kept at log_dest."""
    import httpx

    from quantkit.distributed import launched_world
    from quantkit.engine import EngineError
    from quantkit.engine.vllm_server import VLLMServer
    from quantkit.hardware import conversion_device
    from quantkit.pipeline import RunOptions, execute, prepare
    from quantkit.recipe import parse_recipe

    with tempfile.TemporaryDirectory(prefix="quantkit-preflight-") as tmp:
        tmp = Path(tmp)
        dense = [j for j, lay in enumerate(layouts) if not any(".experts." in n for n in lay)] if arch.moe else None
        small = build_small_model(model_dir, len(layouts), tmp / "float", recipe.model.dtype, dense)
        data = small_recipe(recipe, small, layouts, arch.layers)
        # the pipeline core, as the convert verb runs it, in this process alone and with no pre-flight of its own
        placed = conversion_device("auto", launched_world()[2])
        export = execute(prepare(parse_recipe(data, "pre-flight recipe"), placed, quiet=True),
                         RunOptions(tmp / "export", quiet=True, started=time.perf_counter(), preflight={"mode": "off"}))
        qc = json.loads((export / "config.json").read_text()).get("quantization_config") or {}
        result = {"layers": len(layouts), "config_groups": sorted((qc.get("config_groups") or {}).keys())}
        server = VLLMServer(export, tmp / "engine", "preflight", max_model_len=256, ready_timeout_s=600)
        try:
            with server as ep:
                r = httpx.post(f"{ep.base_url}/v1/completions", timeout=120,
                               json={"model": ep.model, "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0})
                if r.status_code != 200:
                    return False, result, (f"pre-flight: vLLM {ep.version} loaded a small model in the recipe's formats "
                                           f"but could not generate a token (HTTP {r.status_code}: {r.text[:300]}). "
                                           "Nothing was calibrated; pass --preflight off to convert anyway")
                result["engine_start_s"] = round(ep.info.get("start_s") or 0, 1)
        except EngineError as exc:
            msg = str(exc).split("\n  full log:")[0]
            return False, result, (f"pre-flight: vLLM cannot load what recipe {recipe.name!r} would produce: {msg} "
                                   f"(engine log: {log_dest}). Nothing was calibrated; fix the recipe's schemes, or "
                                   "pass --preflight off to convert anyway")
        finally:
            if server.log_path.is_file():
                log_dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(server.log_path, log_dest)
    return True, result, None


__all__ = ["MODES", "PreflightError", "default_mode", "preflight", "fused_group_problems", "layer_layouts",
           "small_recipe", "build_small_model"]
