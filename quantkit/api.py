"""The product's entry points as plain functions; the CLI is a thin adapter over these.

    convert(recipe, output)      quantkit.convert: recipe -> compressed-tensors checkpoint + manifest
    inspect(folder)              an artifact's summary, every file's sha256 checked
    capability([artifacts])      what this machine and engine can serve, and why
    evaluate(artifact, ...)      quantkit.evaluate.run_eval: baseline and candidate in the engine
    gate(report)                 quantkit.gates.run_gates: the recipe's thresholds on a report
    publish / promote / rollback / pull    quantkit.registry
    tune(study)                  quantkit.tune: a matrix of recipes and engine settings -> the cheapest passing cell
    sensitivity(recipe, budget)  quantkit.tune.sensitivity: per-module sensitivity -> a mixed-precision recipe
"""

from __future__ import annotations

from pathlib import Path

from quantkit.convert import convert, default_output  # noqa: F401  (the convert verb)
from quantkit.pipeline import partial_dir  # noqa: F401
from quantkit.evaluate import run_eval as evaluate  # noqa: F401
from quantkit.gates import run_gates as gate  # noqa: F401
from quantkit.registry import promote, publish, pull, rollback  # noqa: F401
from quantkit.tune import tune  # noqa: F401


def inspect(folder: str | Path) -> dict:
    """An artifact's summary from its manifest, with every file's sha256 checked (`problems` lists mismatches)."""
    from quantkit.export.manifest import read_manifest, verify

    folder = Path(folder).expanduser().resolve()
    man = read_manifest(folder)
    problems = verify(folder)
    sq = [v.get("output_sqnr_db", v.get("weight_sqnr_db")) for v in man.get("layers", {}).values()]
    return {
        "path": str(folder), "name": man["name"], "base_model": man["base_model"]["path"],
        "stages": man["quantization"]["stages"], "format": man["quantization"]["format"],
        "modules_quantized": man["quantization"]["modules_quantized"],
        "size_mb": round(man["size_bytes"] / 1e6, 2),
        "calibration": (man["calibration"] or {}).get("fingerprint"),
        "sqnr_db_min": min(sq) if sq else None, "sqnr_db_mean": round(sum(sq) / len(sq), 2) if sq else None,
        "wall_time_s": man["conversion"]["wall_time_s"], "peak_rss_mb": round(man["conversion"]["peak_rss_bytes"] / 1e6),
        "checksums": "ok" if not problems else "MISMATCH", "problems": problems,
    }


def capability(artifacts: list[str | Path] = ()) -> dict:
    """What this machine and engine can serve, and why: the hardware line, the engine's version and, per
    artifact folder, whether vLLM can serve it here (decided without starting an engine)."""
    from quantkit.engine.capability import artifact_can_run, artifact_kv_cache
    from quantkit.engine.vllm_server import resolve_dtype, vllm_version
    from quantkit.hardware import hardware

    hw = hardware()
    device = "cuda" if hw["gpu"] else "cpu"
    dtype, why = resolve_dtype("auto")
    out = {"hardware": hw, "engine": vllm_version(), "device": device,
           "eval_dtype": {"dtype": dtype, "reason": why}, "artifacts": {}}
    for a in artifacts:
        path = Path(a).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{a}: no config.json; pass an exported artifact or model folder")
        ok, reason = artifact_can_run(path, device)
        out["artifacts"][str(path)] = {"servable": ok, "reason": reason or "every config group has a kernel here"}
        kv = artifact_kv_cache(path, device)
        if kv is not None:  # the FP8 KV cache is served or not on its own; the weights decide servable
            out["artifacts"][str(path)]["kv_cache"] = {"fp8_cache": kv["servable"], "reason": kv["reason"]}
    return out


def sensitivity(recipe: str | Path, budget: str | list[str], output: str | Path | None = None,
                overrides: list[str] | None = None, options=None, **fields) -> dict:
    """Rank the recipe's fused module groups by sensitivity and write a mixed-precision recipe meeting `budget`
    (several budgets must all hold). `options`: a quantkit.tune.sensitivity.SensitivityOptions, or its fields by
    name (high, validate, latency_from, latency_metric, kl_tokens, device, progress). Default folder:
    runs/sensitivity/<recipe name>."""
    from quantkit.recipe import load_recipe
    from quantkit.tune import sensitivity as sens

    r = load_recipe(recipe, overrides or [])
    out = Path(output).expanduser().resolve() if output else (Path("runs") / "sensitivity" / r.name).resolve()
    return sens.run(r, budget, out, options, **fields)
