"""The product's entry points as plain functions; the CLI is a thin adapter over these."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from quantkit.export.compressed_tensors import quantization_config, write_config
from quantkit.export.shards import refs_from_checkpoint, write_shards
from quantkit.export.manifest import MANIFEST, SCHEMA, file_table, package_versions
from quantkit.io import atomic_write_json, model_fingerprint, peak_rss_bytes, replace_dir
from quantkit.models import LazyCheckpoint, arch_for, build_skeleton, quantkit_home, resolve_model_dir
from quantkit.pipeline import WorkDir, plan_layers, process_layers
from quantkit.recipe import Recipe

log = logging.getLogger("quantkit")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")


def default_output(recipe: Recipe) -> Path:
    return Path(recipe.export.output_dir or Path("runs") / recipe.name)


def partial_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


@contextlib.contextmanager
def _log_to(path: Path, quiet: bool):
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        handler.close()


def convert(recipe: Recipe, output: Path | None = None, restart: bool = False, overwrite: bool = False,
            quiet: bool = False, capture: dict | None = None) -> Path:
    """Recipe -> compressed-tensors checkpoint + manifest.json in `output`. Resumes an unfinished run.

    `capture`, when given, receives every quantized module's dequantized weight, and every float tensor a
    transform stage rewrote under its parameter name (for tests and tools
    that compare the export against the in-memory quantized model).
    """
    from transformers import AutoTokenizer

    from quantkit.data import build_calibration_set

    t_start = time.perf_counter()
    recipe = recipe.with_absolute_paths()  # the API boundary: a no-op for recipes read by load_recipe
    output = Path(output or default_output(recipe)).expanduser().resolve()
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it, or choose --output")
    partial = partial_dir(output)
    partial.mkdir(parents=True, exist_ok=True)
    with _log_to(partial / "convert.log", quiet):
        log.info("convert %s -> %s", recipe.name, output)
        model_dir = resolve_model_dir(recipe.model, quiet=quiet)
        tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
        calib = build_calibration_set(recipe.calibration, tok) if recipe.calibration else None
        if calib:
            log.info("calibration: %d x %d tokens, fingerprint %s", *calib.input_ids.shape, calib.fingerprint[:16])
        fingerprint = {"recipe": recipe.hash(), "model": model_fingerprint(model_dir),
                       "calibration": calib.fingerprint if calib else None}

        model = build_skeleton(model_dir, recipe.model.dtype, recipe.model.trust_remote_code)
        arch = arch_for(model.config)
        plans, unquantized = plan_layers(model, arch, recipe)
        ckpt = LazyCheckpoint(model_dir)
        work = WorkDir(partial / "work")
        start = work.start(fingerprint, restart)
        if start:
            log.info("resuming after layer %d", start - 1)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        process_layers(model, arch, ckpt, plans, recipe, work, start,
                       calib.input_ids if calib else None, device, quiet, capture)

        n_layers = len(plans)
        stats = work.layer_stats(n_layers)
        qat = None
        if recipe.stages[-1].method == "qat":  # fine-tune the PTQ result; its tensors replace the layer files
            from quantkit import qat as qat_stage

            qat = qat_stage.run(recipe, model_dir, tok, plans, work.layer_files(n_layers), work.root / "qat",
                                quiet, capture)
        export_dir = partial / "export"
        shutil.rmtree(export_dir, ignore_errors=True)
        export_dir.mkdir()
        # the float weights the compressed tensors replace, and any stored tensor the pipeline rewrote
        # (norm weights and biases a transform stage folded its scales into)
        produced = refs_from_checkpoint(LazyCheckpoint(work.root, qat.files if qat else work.layer_files(n_layers)))
        replaced = {m + ".weight" for m in stats} | {r.name for r in produced}
        kept = refs_from_checkpoint(ckpt, [k for k in ckpt.keys() if k not in replaced])
        files = write_shards(export_dir, kept + produced, recipe.export.max_shard_size_mb * 1024 * 1024)
        schemes = {f"group_{i}": scheme for i, scheme in _config_groups(plans, stats).items()}
        write_config(model_dir / "config.json", export_dir, quantization_config(schemes, unquantized))
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, export_dir / name)
        shutil.copy2(partial / "convert.log", export_dir / "convert.log")
        for f in qat.extra_files if qat else []:  # the QAT loss curve
            shutil.copy2(f, export_dir / f.name)
        for f in export_dir.iterdir():
            f.chmod(0o644)
        wall = time.perf_counter() - t_start
        manifest = {
            "schema": SCHEMA,
            "name": recipe.name,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "base_model": {"path": recipe.model.path, "resolved_dir": str(model_dir.resolve()),
                           "fingerprint": fingerprint["model"]},
            "recipe": recipe.model_dump(mode="json"),
            "recipe_sha256": fingerprint["recipe"],
            "calibration": calib.summary() if calib else None,
            "quantization": {"stages": [{"method": s.method, "scheme": s.scheme} for s in recipe.stages],
                             "format": json.loads((export_dir / "config.json").read_text())["quantization_config"]["format"],
                             "modules_quantized": len(stats), "modules_kept": unquantized},
            "layers": stats,
            "conversion": {"wall_time_s": round(wall, 2), "peak_rss_bytes": peak_rss_bytes(), "device": str(device),
                           "resumed_at_layer": start or None},
            "versions": package_versions(),
            "files": file_table(export_dir),
        }
        manifest["size_bytes"] = sum(f["size"] for f in manifest["files"].values())
        if qat:
            manifest["qat"] = qat.summary
        atomic_write_json(export_dir / MANIFEST, manifest)
        log.info("export written: %d files, %.1f MB, %.1fs", len(files), manifest["size_bytes"] / 1e6, wall)
    # the only moment the final name appears: one rename of a complete folder
    replace_dir(export_dir, output)
    shutil.rmtree(partial, ignore_errors=True)
    return output


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
    from quantkit.engine.capability import artifact_can_run
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
    return out


def _config_groups(plans, stats) -> dict[int, object]:
    """One compressed-tensors config group per stage.

    A single stage that quantizes every decoder Linear targets `Linear` (lm_head and any other kept
    Linear are listed in `ignore`), the form every reader knows. With several stages each group
    lists its modules as anchored regexes with explicit layer indices, so no group over-matches.
    """
    groups: dict[int, object] = {}
    names: dict[int, list[str]] = {}
    for plan in plans:
        for members in plan.groups:
            for t in members:
                groups.setdefault(t.stage, t.ct_scheme)
                names.setdefault(t.stage, []).append(t.name)
    if len(groups) == 1:
        (si, scheme), = groups.items()
        return {si: scheme.model_copy(update={"targets": ["Linear"]})}
    return {si: scheme.model_copy(update={"targets": _exact_targets(names[si])}) for si, scheme in groups.items()}


def _exact_targets(names: list[str]) -> list[str]:
    """`model.layers.{0,1}.mlp.down_proj` -> `re:^model\\.layers\\.(?:0|1)\\.mlp\\.down_proj$`."""
    import re

    pattern = re.compile(r"^(.*)\.(\d+)\.(.+)$")
    grouped: dict[tuple[str, str], list[int]] = {}
    for n in names:
        m = pattern.match(n)
        grouped.setdefault((m.group(1), m.group(3)), []).append(int(m.group(2)))
    return [f"re:^{re.escape(base)}\\.(?:{'|'.join(str(i) for i in sorted(idx))})\\.{re.escape(suffix)}$"
            for (base, suffix), idx in sorted(grouped.items())]
