"""Tiny, self-made artifacts and eval reports for the gate and registry tests (no model, no engine).

An artifact here is what `quantkit convert` writes, minus real weights: a few small files and a
manifest.json whose file table comes from quantkit.export.manifest.file_table, so verify() treats it
exactly like a real one.
"""

from __future__ import annotations

import os
from pathlib import Path

from quantkit.export.manifest import MANIFEST, SCHEMA, file_table, read_manifest
from quantkit.evaluate.report import SCHEMA as REPORT_SCHEMA
from quantkit.evaluate.report import default_report_path
from quantkit.io import atomic_write_json, sha256_file

GOOD_METRICS = {
    "quality.perplexity": {"baseline": 10.0, "candidate": 10.2, "unit": "", "higher_is_better": False},
    "quality.kl_mean": {"baseline": None, "candidate": 0.01, "unit": "nats", "higher_is_better": False},
    "quality.top1_agreement": {"baseline": None, "candidate": 0.95, "unit": "", "higher_is_better": True},
    "tasks.mean_acc": {"baseline": 0.50, "candidate": 0.495, "unit": "", "higher_is_better": True},
    "tasks.qk_suite.acc": {"baseline": 0.50, "candidate": 0.495, "unit": "", "higher_is_better": True},
    "memory.weight_bytes": {"baseline": 270e6, "candidate": 165e6, "unit": "B", "higher_is_better": False},
    "speed.c1.tpot_ms_p50": {"baseline": 31.0, "candidate": 23.0, "unit": "ms", "higher_is_better": False},
    "speed.c1.ttft_ms_p50": {"baseline": 60.0, "candidate": 50.0, "unit": "ms", "higher_is_better": False},
    "speed.c1.output_tok_s": {"baseline": 38.0, "candidate": 45.0, "unit": "tok/s", "higher_is_better": True},
    # what every default gate family reads (quantkit/gates.py default_gates): a faster, smaller, cheaper candidate
    "speed.decode_tpot_ms_p50": {"baseline": 31.0, "candidate": 23.0, "unit": "ms", "higher_is_better": False},
    "speed.peak_output_tok_s": {"baseline": 120.0, "candidate": 150.0, "unit": "tok/s", "higher_is_better": True},
    "speed.failed_requests": {"baseline": 0.0, "candidate": 0.0, "unit": "requests", "higher_is_better": False},
    "memory.engine_bytes": {"baseline": 2.0e9, "candidate": 1.9e9, "unit": "bytes", "higher_is_better": False},
    "cost.machine_s_per_k_successful_tasks": {"baseline": 400.0, "candidate": 330.0, "unit": "s/1k",
                                              "higher_is_better": False},
    "tools.baseline_agreement": {"baseline": 1.0, "candidate": 0.9, "unit": "fraction", "higher_is_better": True},
    "safety.flip_rate": {"baseline": 0.0, "candidate": 0.025, "unit": "fraction", "higher_is_better": False},
    "generation.degenerate_excess": {"baseline": None, "candidate": 0.0, "unit": "fraction", "higher_is_better": False},
    "artifact.coverage": {"baseline": None, "candidate": 1.0, "unit": "fraction", "higher_is_better": True},
    "artifact.nonfinite_tensors": {"baseline": None, "candidate": 0.0, "unit": "count", "higher_is_better": False},
    "artifact.experts_unrecorded": {"baseline": None, "candidate": 0.0, "unit": "count", "higher_is_better": False},
}
# the paired ratio interval of the perplexity: it reaches 1, so no anomaly (quantkit/gates.py ANOMALY)
GOOD_METRICS["quality.perplexity"] = {**GOOD_METRICS["quality.perplexity"],
                                      "ci95": {"baseline": [9.5, 10.5], "candidate": [9.7, 10.7], "ratio": [1.005, 1.035]}}


def make_artifact(folder: Path, name: str = "tiny-w8a8", scheme: str = "W8A8", method: str = "rtn",
                  gates: list[dict] | None = None, publish: dict | None = None, seed: int = 0,
                  weight_bytes: int = 4096) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}\n')
    (folder / "tokenizer.json").write_text('{"version": "1.0", "seed": %d}\n' % seed)
    (folder / "model.safetensors").write_bytes(bytes([seed % 256]) + os.urandom(weight_bytes - 1))
    recipe = {"name": name, "description": f"tiny test artifact ({scheme})", "model": {"path": "org/tiny-base"},
              "stages": [{"method": method, "scheme": scheme}], "gates": gates or [],
              "publish": publish or {"registry": None, "name": None, "alias": "production"}}
    files = file_table(folder)
    manifest = {
        "schema": SCHEMA, "name": name, "created": "2026-01-01T00:00:00+00:00",
        "base_model": {"path": "org/tiny-base", "resolved_dir": "/nonexistent", "fingerprint": "ab" * 32},
        "recipe": recipe, "recipe_sha256": f"{seed:064x}",
        "calibration": {"fingerprint": "cd" * 32, "num_samples": 4, "seq_len": 16},
        "quantization": {"stages": [{"method": method, "scheme": scheme}], "format": "int-quantized",
                         "modules_quantized": 2, "modules_kept": ["lm_head"]},
        "layers": {"model.layers.0.mlp.up_proj": {"weight_sqnr_db": 40.0}},
        "conversion": {"wall_time_s": 0.1, "peak_rss_bytes": 1 << 20},
        "versions": {"python": "3.11", "quantkit": "0.1.0"},
        "files": files, "size_bytes": sum(f["size"] for f in files.values()),
    }
    atomic_write_json(folder / MANIFEST, manifest)
    return folder


def make_report(artifact: Path, metrics: dict | None = None, name: str | None = None,
                path: Path | None = None) -> Path:
    """Write an eval report (the quantkit.report/1 contract) for `artifact`; default <artifact>/eval/report.json."""
    path = path or default_report_path(artifact)
    report = {"schema": REPORT_SCHEMA, "complete": True, "incomplete": [],
              "artifact": {"path": str(artifact), "name": name or read_manifest(artifact)["name"],
                           "manifest_sha256": sha256_file(artifact / MANIFEST)},
              "metrics": GOOD_METRICS if metrics is None else metrics}
    atomic_write_json(path, report)
    return path
