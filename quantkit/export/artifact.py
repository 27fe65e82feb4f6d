"""The export: one folder vLLM serves as it is, written from the pipeline's work folder.

`write_artifact` lays out, in a scratch folder the caller renames into place:
- the safetensors shards: the stored tensors the quantization left alone, then the compressed tensors of
  the pipeline's (or QAT's) typed results and the float tensors a transform rewrote, streamed one
  tensor at a time;
- config.json with the compressed-tensors `quantization_config` (one config group per stage);
- the tokenizer and generation files, convert.log and any extra files (the QAT loss curve);
- manifest.json, built by quantkit.export.manifest.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from quantkit.export.compressed_tensors import compress_by_rows, quantization_config, write_config
from quantkit.export.manifest import MANIFEST, RunFacts, build_manifest
from quantkit.export.shards import refs_from_checkpoint, write_shards
from quantkit.io import atomic_write_json, peak_rss_bytes
from quantkit.model.checkpoint import LazyCheckpoint
from quantkit.plan import Plan
from quantkit.quantize.kvcache import kv_cache_args

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")


def compress_results(plan: Plan, typed_files: list[Path], out_dir: Path, scale_dtype: torch.dtype) -> list[Path]:
    """Compress the typed layer files (quantkit/quantize/workdir.py) into compressed-tensors tensors, one
    layer file at a time, into `out_dir`: the only place results become the export's format."""
    from quantkit.quantize.workdir import decode_weight, split_layer

    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for layer, path in zip(plan.layers, typed_files):
        stored = LazyCheckpoint(path.parent, [path])
        typed, tensors = split_layer(stored.get_many(stored.keys()), layer)  # tensors starts as the rewritten floats
        for t in layer.targets:  # a block of one module's rows in fp32 at a time
            tensors.update(_compress_module(typed, t, scale_dtype))
        dest = out_dir / path.name
        tmp = out_dir / f".{path.name}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(dest)
        files.append(dest)
    return files


def _compress_module(typed: dict[str, torch.Tensor], t, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One module's compressed tensors from its typed fields, decoded and compressed a block of rows at a time."""
    from quantkit.quantize.workdir import decode_weight

    spec = t.scheme.weights
    whole = decode_weight(typed, t.name, spec, slice(0, 0))  # no rows: the per-column g_idx and the global scale

    def rows_of(rows: slice):
        q = decode_weight(typed, t.name, spec, rows)
        return q.weight, q.scale, q.zero_point

    return compress_by_rows(t.name, tuple(typed[f"{t.name}.codes"].shape), rows_of, whole.g_idx, t.ct_scheme,
                            scale_dtype, whole.global_scale)


def write_artifact(export_dir: Path, model_dir: Path, source: LazyCheckpoint, produced: LazyCheckpoint, plan: Plan,
                   stats: dict[str, dict], extra_files: list[Path], facts: RunFacts) -> dict:
    """Write the artifact into the empty `export_dir`; returns its manifest.

    `source` is the model's own checkpoint; `produced` the compressed tensors and rewritten float tensors
    (the work folder's layer files, or QAT's export file); `stats` the per-module diagnostics; `facts` what
    the manifest records of the run, to which the conversion's wall time since `facts.started` and its peak
    memory are added here, once everything but the manifest is written.
    """
    produced_refs = refs_from_checkpoint(produced)
    # the float weights the compressed tensors replace, and any stored tensor the pipeline rewrote
    # (norm weights and biases a transform stage folded its scales into)
    replaced = {m + ".weight" for m in stats} | {r.name for r in produced_refs}
    kept = refs_from_checkpoint(source, [k for k in source.keys() if k not in replaced])
    write_shards(export_dir, kept + produced_refs, facts.recipe.export.max_shard_size_mb * 1024 * 1024)
    kv_spec = plan.kv_cache.spec if plan.kv_cache is not None else None
    write_config(model_dir / "config.json", export_dir,
                 quantization_config(plan.config_groups(), plan.unquantized, kv_cache_args(kv_spec)),
                 source.config_overrides)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, export_dir / name)
    for f in extra_files:
        shutil.copy2(f, export_dir / f.name)
    for f in export_dir.iterdir():
        f.chmod(0o644)
    fmt = json.loads((export_dir / "config.json").read_text())["quantization_config"]["format"]
    conversion = {"wall_time_s": round(time.perf_counter() - facts.started, 2), "peak_rss_bytes": peak_rss_bytes(),
                  **facts.conversion}
    manifest = build_manifest(export_dir, plan, stats, fmt, replace(facts, conversion=conversion))
    atomic_write_json(export_dir / MANIFEST, manifest)
    return manifest
