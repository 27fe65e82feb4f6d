"""The convert verb: recipe -> compressed-tensors checkpoint + manifest.json, resumable.

    resolve -> calibrate -> plan -> quantize (layer by layer, resumable) -> [qat] -> compress -> export -> rename

Everything is built in `.<output>.partial/` beside the output (work/ is the resume point, export/ the
artifact being written); the output appears with one rename when it is complete.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from quantkit.distributed import ChunkLayout, Ranks, join, launched_world, leave, share
from quantkit.errors import ENVIRONMENT_ERRNOS, EnvironmentFault, environment_fault, human_bytes
from quantkit.export.shards import stored_bytes
from quantkit.hardware import compute_dtype, conversion_device
from quantkit.io import model_fingerprint, replace_dir
from quantkit.locks import exclusive, lock_beside
from quantkit.recipe import Recipe

log = logging.getLogger("quantkit")


def default_output(recipe: Recipe) -> Path:
    return Path(recipe.export.output_dir or Path("runs") / recipe.name).expanduser().resolve()


def partial_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


def convert(recipe: Recipe, output: Path | None = None, restart: bool = False, overwrite: bool = False,
            quiet: bool = False, on_weight: Callable[[str, torch.Tensor], None] | None = None,
            device: str = "auto", preflight: str | None = None) -> Path:
    """Quantize the model a recipe names into `output` (default: export.output_dir or runs/<name>).

    `device`: auto (the first GPU, else the CPU), cpu, cuda or cuda:N: where each layer, its Hessians and
    (when they fit) the calibration activations live; everything else stays on the CPU or on disk.

    Under torchrun (or `quantkit convert --nproc N`) every rank calls this: the calibration chunks are split
    across ranks, rank 0 alone locks, writes the work folder and exports (quantkit/distributed.py).

    `preflight`: engine (load a small model in the recipe's formats in vLLM first), capability (only the
    format rules and the capability check) or off; None: QUANTKIT_PREFLIGHT, else engine
    (quantkit/preflight.py). It runs before any calibration.

    `on_weight`, when given, is called with every quantized module's dequantized weight and every float
    tensor a transform or QAT rewrote, by parameter name (a public hook for tools that compare the export
    with the in-memory quantized model).
    """
    t_start = time.perf_counter()
    recipe = recipe.with_absolute_paths()  # the API boundary: a no-op for recipes read by load_recipe
    output = Path(output).expanduser().resolve() if output else default_output(recipe)
    output.parent.mkdir(parents=True, exist_ok=True)
    rank, world, local_rank = launched_world()
    placed = conversion_device(device, local_rank)  # each rank its own GPU under torchrun
    ranks = join(placed[0])
    if not ranks.root:  # rank 0 holds the lock for the whole group
        if output.exists() and not overwrite:
            raise FileExistsError(f"{output} already exists; pass --overwrite to replace it, or choose --output")
        return _convert_locked(recipe, output, restart, True, on_weight, t_start, placed, ranks, preflight)
    with exclusive(lock_beside(output), f"a conversion into {output}"):
        if output.exists() and not overwrite:
            raise FileExistsError(f"{output} already exists; pass --overwrite to replace it, or choose --output")
        return _convert_locked(recipe, output, restart, quiet, on_weight, t_start, placed, ranks, preflight)


def _convert_locked(recipe: Recipe, output: Path, restart: bool, quiet: bool, on_weight, t_start: float,
                    placed: tuple, ranks: Ranks, preflight: str | None = None) -> Path:
    from quantkit.quantize import qat_loop as qat_stage
    from quantkit.data import build_calibration_set
    from quantkit.preflight import default_mode
    from quantkit.preflight import preflight as run_preflight
    from quantkit.export.artifact import compress_results, write_artifact
    from quantkit.model.arch import arch_for
    from quantkit.model.checkpoint import LazyCheckpoint, build_skeleton
    from quantkit.model.integrity import verify_model_folder
    from quantkit.model.sources import load_tokenizer, model_description, resolve_model_dir
    from quantkit.plan import make_plan
    from quantkit.quantize.layers import Job, process_layers
    from quantkit.quantize.workdir import WorkDir

    # everything that can refuse the inputs runs before the work folder exists
    device, device_why = placed
    compute, compute_why = compute_dtype(recipe.model.compute_dtype, device)
    model_dir = resolve_model_dir(recipe.model, quiet=quiet)
    verify_model_folder(model_dir)
    tok = load_tokenizer(model_dir, recipe.model.trust_remote_code)
    model = build_skeleton(model_dir, recipe.model.dtype, recipe.model.trust_remote_code)
    arch = arch_for(model.config)
    plan = make_plan(model, arch, recipe)
    # will the engine load what this produces? asked before any calibration (quantkit/preflight.py)
    checked = (run_preflight(recipe, model_dir, plan, arch, preflight or default_mode(),
                             "cuda" if device.type == "cuda" else "cpu", _say(quiet)) if ranks.root else None)
    calib = build_calibration_set(recipe.calibration, tok) if recipe.calibration else None
    if calib is not None and ranks.world > 1:
        ChunkLayout.of(calib.input_ids.shape[0], recipe.calibration.batch_size, calib.input_ids.shape[1],
                       ranks).check(f"recipe {recipe.name!r}")
    source = LazyCheckpoint(model_dir)
    partial = partial_dir(output)
    needed = disk_needed(plan, source, recipe, calib.input_ids.shape if calib else None, model.config)
    if not ranks.root:
        return _convert_rank(recipe, model, arch, plan, source, calib, partial, compute, device, ranks, on_weight)
    check_free_space(partial, needed)
    partial.mkdir(parents=True, exist_ok=True)
    try:
        with _log_to(partial / "convert.log"):
            log.info("convert %s -> %s (about %s of disk needed)", recipe.name, output, human_bytes(needed))
            log.info("device %s (%s); calibration forward in %s (%s)", device, device_why, compute, compute_why)
            if calib:
                log.info("calibration: %d x %d tokens, fingerprint %s", *calib.input_ids.shape, calib.fingerprint[:16])
            fingerprint = {"recipe": recipe.hash(), "model": model_fingerprint(model_dir),
                           "calibration": calib.fingerprint if calib else None, "compute_dtype": compute}
            work = WorkDir(partial / "work")
            start = work.start(fingerprint, restart)
            if start:
                log.info("resuming after layer %d", start - 1)
            if ranks.world > 1:
                log.info("%d processes: calibration chunks and solves split across ranks", ranks.world)
                share([torch.tensor([start])], 0, ranks)  # the others resume where rank 0 does
            job = Job(plan, getattr(torch, recipe.model.dtype), compute=getattr(torch, compute), on_weight=on_weight,
                      ranks=ranks)
            process_layers(model, arch, source, plan, job, work, start, calib.input_ids if calib else None, device, quiet)
            leave()  # the other ranks are done: QAT and the export are rank 0's

            n_layers = len(plan.layers)
            typed, qat = work.layer_files(n_layers), None
            if plan.finetune is not None:  # fine-tune the PTQ result; its typed results replace the layer files
                run = qat_stage.FinetuneRun(plan, model_dir, tok, recipe.model.trust_remote_code, job.scale_dtype,
                                            device, quiet, on_weight)
                qat = qat_stage.run(run, typed, work.root / "qat")
                typed = qat.files
            export_dir, compressed = partial / "export", partial / "compressed"
            for d in (export_dir, compressed):
                shutil.rmtree(d, ignore_errors=True)
            produced = compress_results(plan, typed, compressed, job.scale_dtype)
            export_dir.mkdir()
            shutil.copy2(partial / "convert.log", export_dir / "convert.log")
            facts = {"recipe": recipe, "recipe_sha256": fingerprint["recipe"],
                     "base_model": {"path": recipe.model.path, "resolved_dir": str(model_dir),
                                    "fingerprint": fingerprint["model"],
                                    "description": model_description(model_dir)},  # e.g. a dequantized GGUF
                     "calibration": calib.summary() if calib else None, "qat": qat.summary if qat else None,
                     "conversion": {"device": str(device), "device_reason": device_why, "compute_dtype": compute,
                                    "compute_dtype_reason": compute_why, "resumed_at_layer": start or None,
                                    "processes": ranks.world, "preflight": checked,
                                    "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}}
            manifest = write_artifact(export_dir, model_dir, source, LazyCheckpoint(compressed, produced), plan,
                                      work.layer_stats(n_layers), recipe.export.max_shard_size_mb * 1024 * 1024,
                                      qat.extra_files if qat else [], facts, t_start)
            log.info("export written: %d files, %.1f MB, %.1fs", len(manifest["files"]),
                     manifest["size_bytes"] / 1e6, time.perf_counter() - t_start)
        replace_dir(export_dir, output)  # the only moment the final name appears: one rename of a complete folder
    except OSError as exc:
        if exc.errno in ENVIRONMENT_ERRNOS:  # disk full, I/O error: say which file and that a rerun resumes
            raise environment_fault(exc, needed, resumes=True) from exc
        raise
    shutil.rmtree(partial, ignore_errors=True)
    return output


def _convert_rank(recipe: Recipe, model, arch, plan, source, calib, partial: Path, compute: str, device, ranks: Ranks,
                  on_weight) -> Path:
    """A rank other than 0: its share of the layer pipeline (rank 0 locks, writes and exports)."""
    from quantkit.quantize.layers import Job, process_layers
    from quantkit.quantize.workdir import WorkDir

    start = int(share(None, 0, ranks)[0].item())
    job = Job(plan, getattr(torch, recipe.model.dtype), compute=getattr(torch, compute), on_weight=on_weight,
              ranks=ranks)
    process_layers(model, arch, source, plan, job, WorkDir(partial / "work"), start,
                   calib.input_ids if calib else None, device, quiet=True)
    leave()
    return partial.parent / partial.name[1:-len(".partial")]


def _say(quiet: bool) -> Callable[[str], None]:
    """A progress line: logged, and on stderr unless quiet."""
    def say(msg: str) -> None:
        log.info(msg)
        if not quiet:
            print(msg, file=sys.stderr, flush=True)
    return say


def disk_needed(plan, source, recipe: Recipe, calib_shape, config) -> int:
    """Bytes a conversion writes at its peak, beside the output: the work folder (1-byte codes per quantized
    weight, the next layer's input twice while it is replaced), the compressed layer files, and the export
    (the tensors kept as they are plus the compressed ones); QAT adds its checkpoint (weight and two AdamW
    moments, fp32) and its typed layer files."""
    quantized = packed = 0
    for t in plan.targets.values():
        n = source.numel(t.name + ".weight")
        quantized += n
        packed += n * t.scheme.weights.num_bits // 8
    replaced = {t + ".weight" for t in plan.targets}
    kept = stored_bytes(source, replaced)
    hidden = 2 * 4 * calib_shape[0] * calib_shape[1] * config.hidden_size if calib_shape is not None else 0
    qat = quantized * (12 + 1) if plan.finetune is not None else 0
    return int(1.1 * (quantized + hidden + 2 * packed + kept + qat)) + (16 << 20)  # 10% and 16 MB for the rest


def check_free_space(partial: Path, needed: int) -> None:
    """Refuse up front when the output's file system has less free space than the conversion needs (what
    an unfinished conversion already wrote there counts as available)."""
    done = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file()) if partial.is_dir() else 0
    free = shutil.disk_usage(partial.parent).free
    if free + done < needed:
        raise EnvironmentFault(f"{partial.parent}: {human_bytes(free)} free, and this conversion needs about "
                               f"{human_bytes(needed - done)} more; free space or choose an --output on a larger disk")


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
