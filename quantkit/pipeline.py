"""The conversion's core, under the convert verb and pre-flight's small-model check: resolve the inputs and plan
(`prepare`), then calibrate, quantize layer by layer (resumable), fine-tune, compress and export (`execute`).

    prepare: resolve -> plan        execute: calibrate -> quantize -> [finetune] -> compress -> export -> rename

A recipe of data-free quantizers only (RTN, no calibration section, no KV-cache scheme) takes the model-free
path instead, unless asked not to (`RunOptions.path`): each weight streamed from the checkpoint to the export
on its own, byte-identical to the layer path (quantkit/quantize/streamed.py).

Everything is built in `.<output>.partial/` beside the output (work/ is the resume point, export/ the
artifact being written); the output appears with one rename when it is complete. Locking, and asking the
engine first, are the verb's (quantkit/convert.py).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from quantkit.distributed import SINGLE, ChunkLayout, Ranks, leave, share
from quantkit.errors import ENVIRONMENT_ERRNOS, EnvironmentFault, environment_fault, human_bytes
from quantkit.export.manifest import RunFacts
from quantkit.export.shards import stored_bytes
from quantkit.hardware import compute_dtype
from quantkit.io import model_fingerprint, replace_dir
from quantkit.model.arch import ArchSpec
from quantkit.model.checkpoint import LazyCheckpoint
from quantkit.model import ModelError
from quantkit.plan import ConvertError, Plan
from quantkit.recipe import Recipe

log = logging.getLogger("quantkit")


@dataclass
class Inputs:
    """What a conversion works from, resolved and checked before anything is written."""

    recipe: Recipe
    model_dir: Path
    tokenizer: object
    model: nn.Module  # the skeleton on the meta device: each layer is materialized when its turn comes
    arch: ArchSpec
    plan: Plan
    source: LazyCheckpoint
    placed: tuple[torch.device, str]  # (device, why): where the layers, Hessians and activations live
    compute: tuple[str, str]  # (dtype, why) of the calibration forward


@dataclass(frozen=True)
class RunOptions:
    output: Path
    ranks: Ranks = SINGLE
    restart: bool = False
    quiet: bool = False
    # called with every quantized module's dequantized weight and every float tensor a transform or the
    # fine-tune rewrote, by parameter name (a public hook, quantkit.convert.convert)
    on_weight: Callable[[str, torch.Tensor], None] | None = None
    started: float = 0.0  # time.perf_counter() when the verb started
    preflight: dict | None = None  # what pre-flight checked, for the manifest
    # auto: the model-free path whenever the recipe allows it (quantkit/quantize/streamed.py), else the layers;
    # layers / streamed: that path (streamed refuses a recipe it cannot convert, with the reason)
    path: str = "auto"


def partial_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial"


def prepare(recipe: Recipe, placed: tuple[torch.device, str], quiet: bool = False) -> Inputs:
    """Resolve the model and plan the work: everything that can refuse the inputs before calibration."""
    from quantkit.model.arch import arch_for
    from quantkit.model.checkpoint import build_skeleton
    from quantkit.model.integrity import verify_model_folder
    from quantkit.model.sources import load_tokenizer, resolve_model_dir
    from quantkit.plan import make_plan

    compute = compute_dtype(recipe.model.compute_dtype, placed[0])
    model_dir = resolve_model_dir(recipe.model, quiet=quiet)
    verify_model_folder(model_dir)
    tok = load_tokenizer(model_dir, recipe.model.trust_remote_code)
    model = build_skeleton(model_dir, recipe.model.dtype, recipe.model.trust_remote_code)
    arch = arch_for(model.config)
    plan = make_plan(model, arch, recipe)
    source = LazyCheckpoint(model_dir)
    if plan.rotation is not None:  # the rotated model, read tensor by tensor (quantkit/model/rotated.py)
        try:
            source = plan.rotation.method.view(source, model.config, arch, plan.rotation.config)
        except ModelError as exc:
            raise ConvertError(f"recipe {recipe.name!r} stages[{plan.rotation.index}]: {exc}") from None
    return Inputs(recipe, model_dir, tok, model, arch, plan, source, placed, compute)


def execute(inp: Inputs, opts: RunOptions) -> Path:
    """Calibrate, quantize, fine-tune and export into `opts.output` (every rank calls it; rank 0 writes)."""
    from quantkit.data import build_calibration_set

    recipe, ranks, policy = inp.recipe, opts.ranks, inp.plan.calibration
    calib = build_calibration_set(policy.spec, inp.tokenizer) if policy is not None else None
    if calib is not None and ranks.world > 1:
        ChunkLayout.of(calib.input_ids.shape[0], policy.batch_size, calib.input_ids.shape[1],
                       ranks).check(f"recipe {recipe.name!r}")
    partial = partial_dir(opts.output)
    needed = disk_needed(inp.plan, inp.source, calib.input_ids.shape if calib else None, inp.model.config)
    streams, why = _streams(inp, opts)
    if not ranks.root:  # its share of the layer pipeline (or of the modules); rank 0 locks, writes and exports
        from quantkit.quantize.streamed import quantize_tensors
        from quantkit.quantize.workdir import WorkDir

        if streams:
            quantize_tensors(_tensor_job(inp, opts), WorkDir(partial / "work"), quiet=True)
        else:
            _quantize_layers(inp, calib, WorkDir(partial / "work"), int(share(None, 0, ranks)[0].item()), opts)
        leave()
        return opts.output
    check_free_space(partial, needed)
    partial.mkdir(parents=True, exist_ok=True)
    try:
        with _log_to(partial / "convert.log"):
            log.info("convert %s -> %s (about %s of disk needed)", recipe.name, opts.output, human_bytes(needed))
            log.info("conversion path: %s (%s)", "streamed" if streams else "layers", why)
            export_dir = _stream_root(inp, partial, opts) if streams else _convert_root(inp, calib, partial, opts)
        replace_dir(export_dir, opts.output)  # the only moment the final name appears: one rename of a complete folder
    except OSError as exc:
        if exc.errno in ENVIRONMENT_ERRNOS:  # disk full, I/O error: say which file and that a rerun resumes
            raise environment_fault(exc, needed, resumes=True) from exc
        raise
    shutil.rmtree(partial, ignore_errors=True)
    return opts.output


def _convert_root(inp: Inputs, calib, partial: Path, opts: RunOptions) -> Path:
    """Rank 0: the layer pipeline (resuming from the work folder), the fine-tune, then the export; returns
    the finished export folder inside `partial`."""
    from quantkit.model.sources import model_description
    from quantkit.quantize.workdir import WorkDir

    recipe, plan, (device, device_why), (compute, compute_why) = inp.recipe, inp.plan, inp.placed, inp.compute
    log.info("device %s (%s); calibration forward in %s (%s)", device, device_why, compute, compute_why)
    if calib:
        log.info("calibration: %d x %d tokens, fingerprint %s", *calib.input_ids.shape, calib.fingerprint[:16])
    fingerprint = {"recipe": recipe.hash(), "model": model_fingerprint(inp.model_dir),
                   "calibration": calib.fingerprint if calib else None, "compute_dtype": compute}
    work = WorkDir(partial / "work")
    start = work.start(fingerprint, opts.restart)
    if start:
        log.info("resuming after layer %d", start - 1)
    if opts.ranks.world > 1:
        log.info("%d processes: calibration chunks and solves split across ranks", opts.ranks.world)
        share([torch.tensor([start])], 0, opts.ranks)  # the others resume where rank 0 does
    job = _quantize_layers(inp, calib, work, start, opts)
    leave()  # the other ranks are done: the fine-tune and the export are rank 0's
    typed, finetuned = work.layer_files(len(plan.layers)), None
    if plan.finetune is not None:  # fine-tune the PTQ result; its typed results replace the layer files
        finetuned = _finetune(inp, typed, work.root / "qat", opts)
        typed = finetuned.files
    base = {"path": recipe.model.path, "resolved_dir": str(inp.model_dir), "fingerprint": fingerprint["model"],
            "description": model_description(inp.model_dir)}  # e.g. a dequantized GGUF
    conversion = {**_conversion_facts(inp, opts, "layers", job.timing), "resumed_at_layer": start or None}
    facts = RunFacts(recipe, fingerprint["recipe"], base, calib.summary() if calib else None, conversion,
                     finetuned.summary if finetuned else None, opts.started)
    return _export(inp, work, typed, job.scale_dtype, finetuned.extra_files if finetuned else [], facts, partial)


def _conversion_facts(inp: Inputs, opts: RunOptions, path: str, timing) -> dict:
    """The manifest's `conversion` section, as both paths record it."""
    (device, device_why), (compute, compute_why) = inp.placed, inp.compute
    return {"path": path, "device": str(device), "device_reason": device_why, "compute_dtype": compute,
            "compute_dtype_reason": compute_why, "processes": opts.ranks.world, "preflight": opts.preflight,
            "rotation": inp.source.summary, "phases_s": timing.summary(), **timing.memory(),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def _streams(inp: Inputs, opts: RunOptions) -> tuple[bool, str]:
    """Whether this conversion takes the model-free path (quantkit/quantize/streamed.py), and why."""
    from quantkit.quantize.streamed import LAYERS, PATHS, STREAMED, why_not_streamed

    if opts.path not in PATHS:
        raise ConvertError(f"conversion path {opts.path!r}: expected one of {', '.join(PATHS)}")
    if opts.path == LAYERS:
        return False, "asked for"
    why = why_not_streamed(inp.plan, inp.source)
    if why is not None and opts.path == STREAMED:
        raise ConvertError(f"recipe {inp.recipe.name!r} cannot take the streamed (model-free) path: {why}; "
                           "convert it with --path auto or --path layers")
    return why is None, why or ("asked for" if opts.path == STREAMED else "auto: every stage is a data-free quantizer")


def _tensor_job(inp: Inputs, opts: RunOptions):
    from quantkit.quantize.streamed import TensorJob
    from quantkit.quantize.timing import for_device

    return TensorJob(inp.plan, inp.source, inp.placed[0], getattr(torch, inp.compute[0]),
                     getattr(torch, inp.recipe.model.dtype), opts.ranks, opts.on_weight, for_device(inp.placed[0]))


def _stream_root(inp: Inputs, partial: Path, opts: RunOptions) -> Path:
    """Rank 0 of the model-free path: every module streamed into the work folder (resuming: finished modules
    are skipped), then the export; returns the finished export folder inside `partial`."""
    from quantkit.model.sources import model_description
    from quantkit.quantize import streamed
    from quantkit.quantize.workdir import WorkDir

    recipe = inp.recipe
    fingerprint = {"recipe": recipe.hash(), "model": model_fingerprint(inp.model_dir), "calibration": None,
                   "compute_dtype": inp.compute[0], "path": streamed.STREAMED}
    work = WorkDir(partial / "work")
    work.start(fingerprint, opts.restart)
    log.info("streamed (model-free) path: %d modules, one tensor at a time on %s, %d process(es)",
             len(inp.plan.targets), inp.placed[0], opts.ranks.world)
    job = _tensor_job(inp, opts)
    resumed = streamed.quantize_tensors(job, work, opts.quiet)
    if resumed:
        log.info("resuming: %d modules were already done", resumed)
    leave()
    base = {"path": recipe.model.path, "resolved_dir": str(inp.model_dir), "fingerprint": fingerprint["model"],
            "description": model_description(inp.model_dir)}
    conversion = {**_conversion_facts(inp, opts, streamed.STREAMED, job.timing), "resumed_at_layer": None,
                  "resumed_modules": resumed or None}
    facts = RunFacts(recipe, fingerprint["recipe"], base, None, conversion, None, opts.started)
    return _write_export(inp, streamed.produced(inp.plan, work), streamed.module_stats(inp.plan, work), [],
                         facts, partial)


def _quantize_layers(inp: Inputs, calib, work, start: int, opts: RunOptions):
    from quantkit.quantize.layers import Job, process_layers
    from quantkit.quantize.timing import for_device
    from quantkit.quantize.walk import Walk

    timing = for_device(inp.placed[0])
    job = Job(inp.plan, getattr(torch, inp.recipe.model.dtype), compute=getattr(torch, inp.compute[0]),
              on_weight=opts.on_weight, ranks=opts.ranks, timing=timing, spill=work.spill / f"rank{opts.ranks.rank}")
    walk = Walk(inp.model, inp.arch, inp.source, inp.plan, inp.placed[0], job.compute, opts.ranks, timing)
    process_layers(walk, job, work, start, calib.input_ids if calib else None, opts.quiet)
    return job


def _finetune(inp: Inputs, typed: list[Path], root: Path, opts: RunOptions):
    from quantkit.quantize import finetune

    run = finetune.FinetuneRun(inp.plan, inp.model_dir, inp.tokenizer, inp.recipe.model.trust_remote_code,
                               getattr(torch, inp.recipe.model.dtype), inp.placed[0], opts.quiet, opts.on_weight)
    return finetune.run(run, typed, root)


def _export(inp: Inputs, work, typed: list[Path], scale_dtype: torch.dtype, extra_files: list[Path],
            facts: RunFacts, partial: Path) -> Path:
    from quantkit.export.artifact import compress_results

    compressed = partial / "compressed"
    shutil.rmtree(compressed, ignore_errors=True)
    produced = compress_results(inp.plan, typed, compressed, scale_dtype)
    return _write_export(inp, LazyCheckpoint(compressed, produced), work.layer_stats(len(inp.plan.layers)),
                         extra_files, facts, partial)


def _write_export(inp: Inputs, produced: LazyCheckpoint, stats: dict[str, dict], extra_files: list[Path],
                  facts: RunFacts, partial: Path) -> Path:
    """The artifact from the produced (compressed) tensors, in `partial/export`; returns that folder."""
    from quantkit.export.artifact import write_artifact

    export_dir = partial / "export"
    shutil.rmtree(export_dir, ignore_errors=True)
    export_dir.mkdir()
    shutil.copy2(partial / "convert.log", export_dir / "convert.log")
    manifest = write_artifact(export_dir, inp.model_dir, inp.source, produced, inp.plan, stats, extra_files, facts)
    log.info("export written: %d files, %.1f MB, %.1fs", len(manifest["files"]),
             manifest["size_bytes"] / 1e6, time.perf_counter() - facts.started)
    return export_dir


def disk_needed(plan: Plan, source, calib_shape, config) -> int:
    """Bytes a conversion writes at its peak, beside the output: the work folder (1-byte codes per quantized
    weight, the next layer's input twice while it is replaced), the compressed layer files, and the export
    (the tensors kept as they are plus the compressed ones); a fine-tune adds its checkpoint (weight and two
    AdamW moments, fp32) and its typed layer files."""
    quantized = packed = 0
    for t in plan.targets.values():
        n = source.numel(t.name + ".weight")
        quantized += n
        packed += n * t.scheme.weights.num_bits // 8
    replaced = {t + ".weight" for t in plan.targets}
    kept = stored_bytes(source, replaced)
    hidden = 2 * 4 * calib_shape[0] * calib_shape[1] * config.hidden_size if calib_shape is not None else 0
    finetune = quantized * (12 + 1) if plan.finetune is not None else 0
    return int(1.1 * (quantized + hidden + 2 * packed + kept + finetune)) + (16 << 20)  # 10% and 16 MB for the rest


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
