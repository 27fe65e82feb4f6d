"""The convert verb: recipe -> compressed-tensors checkpoint + manifest.json, resumable.

    lock -> prepare (resolve, plan) -> pre-flight -> execute (calibrate, quantize, [finetune], export, rename)

The work itself is the pipeline core's (quantkit/pipeline.py); the verb adds the lock, the output
checks and asking the engine first (quantkit/preflight.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from quantkit.distributed import join, launched_world
from quantkit.hardware import conversion_device
from quantkit.locks import exclusive, lock_beside
from quantkit.pipeline import RunOptions, execute, prepare
from quantkit.quantize.streamed import PATH_ENV
from quantkit.recipe import Recipe

log = logging.getLogger("quantkit")


def default_output(recipe: Recipe) -> Path:
    return Path(recipe.export.output_dir or Path("runs") / recipe.name).expanduser().resolve()


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

    The conversion path is QUANTKIT_CONVERT_PATH's (`quantkit convert --path` sets it, for every rank): auto
    (default: the model-free path, quantkit/quantize/streamed.py, whenever every stage is a quantizer that needs
    no data and there is no calibration or KV-cache section; else the layer path), layers, or streamed (refused,
    with the reason, for a recipe the model-free path cannot convert). The export is byte-identical either way;
    the manifest's conversion.path says which ran.

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
    opts = RunOptions(output, ranks, restart, quiet if ranks.root else True, on_weight, t_start,
                      path=os.environ.get(PATH_ENV) or "auto")
    if not ranks.root:  # rank 0 holds the lock for the whole group
        if output.exists() and not overwrite:
            raise FileExistsError(f"{output} already exists; pass --overwrite to replace it, or choose --output")
        return _convert_locked(recipe, placed, opts, preflight)
    with exclusive(lock_beside(output), f"a conversion into {output}"):
        if output.exists() and not overwrite:
            raise FileExistsError(f"{output} already exists; pass --overwrite to replace it, or choose --output")
        return _convert_locked(recipe, placed, opts, preflight)


def _convert_locked(recipe: Recipe, placed: tuple, opts: RunOptions, preflight: str | None) -> Path:
    from dataclasses import replace

    from quantkit.preflight import default_mode
    from quantkit.preflight import preflight as run_preflight

    inp = prepare(recipe, placed, opts.quiet)  # everything that can refuse the inputs, before any work folder
    if opts.ranks.root:  # will the engine load what this produces? asked before any calibration
        checked = run_preflight(recipe, inp.model_dir, inp.plan, inp.arch, preflight or default_mode(),
                                "cuda" if placed[0].type == "cuda" else "cpu", _say(opts.quiet))
        opts = replace(opts, preflight=checked)
    return execute(inp, opts)


def _say(quiet: bool) -> Callable[[str], None]:
    """A progress line: logged, and on stderr unless quiet."""
    def say(msg: str) -> None:
        log.info(msg)
        if not quiet:
            print(msg, file=sys.stderr, flush=True)
    return say
