"""The convert verb: recipe -> compressed-tensors checkpoint + manifest.json, resumable.

    resolve -> calibrate -> plan -> quantize (layer by layer, resumable) -> [qat] -> export -> rename

Everything is built in `.<output>.partial/` beside the output (work/ is the resume point, export/ the
artifact being written); the output appears with one rename when it is complete.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from quantkit.io import model_fingerprint, replace_dir
from quantkit.recipe import Recipe

log = logging.getLogger("quantkit")


def default_output(recipe: Recipe) -> Path:
    return Path(recipe.export.output_dir or Path("runs") / recipe.name).expanduser().resolve()


def partial_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


def convert(recipe: Recipe, output: Path | None = None, restart: bool = False, overwrite: bool = False,
            quiet: bool = False, on_weight: Callable[[str, torch.Tensor], None] | None = None) -> Path:
    """Quantize the model a recipe names into `output` (default: export.output_dir or runs/<name>).

    `on_weight`, when given, is called with every quantized module's dequantized weight and every float
    tensor a transform or QAT rewrote, by parameter name (a public hook for tools that compare the export
    with the in-memory quantized model).
    """
    from transformers import AutoTokenizer

    from quantkit import qat as qat_stage
    from quantkit.data import build_calibration_set
    from quantkit.export.artifact import write_artifact
    from quantkit.model.arch import arch_for
    from quantkit.model.checkpoint import LazyCheckpoint, build_skeleton
    from quantkit.model.sources import resolve_model_dir
    from quantkit.plan import make_plan
    from quantkit.quantize.layers import Job, process_layers
    from quantkit.quantize.workdir import WorkDir

    t_start = time.perf_counter()
    recipe = recipe.with_absolute_paths()  # the API boundary: a no-op for recipes read by load_recipe
    output = Path(output).expanduser().resolve() if output else default_output(recipe)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it, or choose --output")
    partial = partial_dir(output)
    partial.mkdir(parents=True, exist_ok=True)
    with _log_to(partial / "convert.log"):
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
        plan = make_plan(model, arch, recipe)
        source = LazyCheckpoint(model_dir)
        work = WorkDir(partial / "work")
        start = work.start(fingerprint, restart)
        if start:
            log.info("resuming after layer %d", start - 1)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        job = Job(recipe, getattr(torch, recipe.model.dtype), on_weight)
        process_layers(model, arch, source, plan, job, work, start, calib.input_ids if calib else None, device, quiet)

        n_layers = len(plan.layers)
        produced, qat = work.layer_files(n_layers), None
        if recipe.stages[-1].method == "qat":  # fine-tune the PTQ result; its tensors replace the layer files
            qat = qat_stage.run(recipe, model_dir, tok, plan, produced, work.root / "qat", device, quiet, on_weight)
            produced = qat.files
        export_dir = partial / "export"
        shutil.rmtree(export_dir, ignore_errors=True)
        export_dir.mkdir()
        shutil.copy2(partial / "convert.log", export_dir / "convert.log")
        facts = {"recipe": recipe, "recipe_sha256": fingerprint["recipe"],
                 "base_model": {"path": recipe.model.path, "resolved_dir": str(model_dir),
                                "fingerprint": fingerprint["model"]},
                 "calibration": calib.summary() if calib else None, "qat": qat.summary if qat else None,
                 "conversion": {"device": str(device), "resumed_at_layer": start or None}}
        manifest = write_artifact(export_dir, model_dir, source, LazyCheckpoint(work.root, produced), plan,
                                  work.layer_stats(n_layers), recipe.export.max_shard_size_mb * 1024 * 1024,
                                  qat.extra_files if qat else [], facts, t_start)
        log.info("export written: %d files, %.1f MB, %.1fs", len(manifest["files"]), manifest["size_bytes"] / 1e6,
                 time.perf_counter() - t_start)
    replace_dir(export_dir, output)  # the only moment the final name appears: one rename of a complete folder
    shutil.rmtree(partial, ignore_errors=True)
    return output


@contextlib.contextmanager
def _log_to(path: Path):
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
