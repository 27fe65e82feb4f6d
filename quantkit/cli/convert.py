"""Commands to make artifacts: convert, inspect, capability, recipes, models. Each calls quantkit.api.

Examples:
    quantkit models fetch smollm2-135m
    quantkit convert recipes/smollm2-w4a16-gptq.yaml
    quantkit convert recipes/smollm2-w8a8-rtn.yaml --set calibration.num_samples=64 --output runs/w8a8-64
    quantkit inspect runs/smollm2-w8a8-rtn
    quantkit recipes list                       # shipped recipes: convert them by name from any folder
    quantkit capability runs/smollm2-w4a16-gptq # can vLLM serve it on this machine, and why
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.cli.common import JsonOut, Quiet, fail, tracked

recipes_app = typer.Typer(no_args_is_help=True, help="Validate and list recipes.")
models_app = typer.Typer(no_args_is_help=True, help="Demo models.")


def convert(
    ctx: typer.Context,
    recipe: Annotated[str, typer.Argument(help="Recipe YAML file, or the name of a shipped recipe.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output folder (default: export.output_dir or runs/<name>).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a recipe field: a.b=value (repeatable).")] = None,
    restart: Annotated[bool, typer.Option(help="Discard an unfinished conversion of a different recipe/model/data.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder (atomically, at the end).")] = False,
    device: Annotated[str, typer.Option("--device", help="auto (the first GPU, else the CPU), cpu, cuda or cuda:N.")] = "auto",
    nproc: Annotated[int, typer.Option("--nproc", min=1, help="Processes on this machine (torchrun underneath): calibration chunks and GPTQ solves are split across them; the result is the same.")] = 1,
    preflight: Annotated[Optional[str], typer.Option("--preflight", help="Before calibrating: engine (vLLM loads a small model in the recipe's formats and generates a token; cached), capability (format rules and the capability check only) or off. Default: QUANTKIT_PREFLIGHT, else engine.")] = None,
    path: Annotated[Optional[str], typer.Option("--path", help="auto (the model-free path, each weight streamed from the checkpoint to the export, when every stage is data-free RTN with no calibration or kv_cache section; else layer by layer), layers, or streamed. The export is byte-identical either way. Default: QUANTKIT_CONVERT_PATH, else auto.")] = None,
    quiet: Quiet = False,
) -> None:
    """Quantize the model a recipe names and export a compressed-tensors checkpoint with a manifest.

    Under `torchrun ... -m quantkit convert RECIPE` (several nodes, a shared work folder), or with --nproc N
    on one machine, the ranks split the work; see docs/distributed.md.
    """
    from quantkit import api
    from quantkit.preflight import MODES
    from quantkit.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])  # refuse a bad recipe once, before any process starts
    if preflight is not None and preflight not in MODES:
        fail(f"--preflight {preflight!r}: expected one of {', '.join(MODES)}")
    import os

    from quantkit.quantize.streamed import PATH_ENV, PATHS

    if path is not None and path not in PATHS:
        fail(f"--path {path!r}: expected one of {', '.join(PATHS)}")
    if path is not None:
        os.environ[PATH_ENV] = path  # read by quantkit.convert.convert, here and in every rank --nproc starts
    from quantkit.distributed import launched_world

    rank0 = launched_world()[0] == 0  # under torchrun, rank 0 alone tracks and reports
    with tracked(ctx, "convert", str(r.model.path), f"convert {r.name}", {"quantkit.nproc": nproc}, on=rank0) as run:
        if nproc > 1:
            out = _convert_nproc(r, recipe, nproc, set_, output, device, preflight, restart, overwrite, quiet)
        else:
            out = api.convert(r, output, restart=restart, overwrite=overwrite, quiet=quiet, device=device,
                              preflight=preflight)
        if run is not None:
            from quantkit import tracking

            tracking.log_convert(run, Path(out))
    if rank0 and nproc == 1:
        typer.echo(str(out))


def _convert_nproc(r, recipe, nproc, set_, output, device, preflight, restart, overwrite, quiet) -> Path:
    """--nproc N: start N ranks of the same command (torchrun underneath); rank 0 prints the output folder."""
    from quantkit.api import default_output
    from quantkit.distributed import ChunkLayout, RankFailed, Ranks, launch, launched_world

    if launched_world()[1] > 1:
        fail("--nproc inside torchrun: torchrun already started the processes; drop --nproc")
    if r.calibration is not None:  # refuse before starting processes that would refuse it
        c = r.calibration
        ChunkLayout.of(c.num_samples, c.batch_size, c.seq_len, Ranks(world=nproc)).check(recipe)
    # the launching process holds the one tracking run; the ranks open none
    args = ["--no-track", "convert", recipe, *(a for s in set_ or [] for a in ("--set", s)), "--device", device]
    args += ["--preflight", preflight] if preflight else []
    args += ["--output", str(output)] if output else []
    args += (["--restart"] if restart else []) + (["--overwrite"] if overwrite else []) + (["--quiet"] if quiet else [])
    try:
        launch(nproc, args)  # rank 0 prints the output folder
    except RankFailed as exc:
        fail(str(exc), exc.exit_code)
    return Path(output).expanduser().resolve() if output else default_output(r)


def inspect(folder: Annotated[Path, typer.Argument(help="An exported artifact folder.")],
            json_out: JsonOut = False) -> None:
    """Print an artifact's summary and verify every file's sha256 (exit 1 on any mismatch)."""
    from quantkit import api

    summary = api.inspect(folder)
    problems = summary.pop("problems")
    if json_out:
        typer.echo(json.dumps({**summary, "problems": problems}, indent=2))
    else:
        for k, v in summary.items():
            typer.echo(f"{k:>18}: {v}")
        for p in problems:
            typer.echo(f"  ! {p}", err=True)
    raise typer.Exit(1 if problems else 0)


def capability(artifacts: Annotated[Optional[list[Path]], typer.Argument(help="Artifact folders to check.")] = None,
               json_out: JsonOut = False) -> None:
    """What this machine and engine can serve, and why (exit 1 if any ARTIFACT cannot be served here).

    Decided from the CPU flags and the export's quantization config, without starting an engine.
    """
    from quantkit import api

    cap = api.capability(artifacts or [])
    if json_out:
        typer.echo(json.dumps(cap, indent=2))
    else:
        hw = cap["hardware"]
        typer.echo(f"cpu: {hw['cpu']} ({hw['cpu_count']} cores; {hw['cpu_kind']}: {' '.join(hw['cpu_flags']) or 'no key flags'})")
        typer.echo(f"gpu: {hw['gpu'] or 'none'}   engine: {cap['engine'] or 'vLLM not installed'}")
        typer.echo(f"eval dtype: {cap['eval_dtype']['dtype']} ({cap['eval_dtype']['reason']})")
        for path, a in cap["artifacts"].items():
            typer.echo(f"{path}: {'servable' if a['servable'] else 'NOT servable'}: {a['reason']}")
            if "kv_cache" in a:
                kv = a["kv_cache"]
                typer.echo(f"  KV cache: {'fp8' if kv['fp8_cache'] else 'model dtype (the FP8 cache cannot run here)'}: "
                           f"{kv['reason']}")
    raise typer.Exit(0 if all(a["servable"] for a in cap["artifacts"].values()) else 1)


@recipes_app.command("validate")
def recipes_validate(files: Annotated[list[str], typer.Argument(help="Recipe files or shipped recipe names.")],
                     set_: Annotated[Optional[list[str]], typer.Option("--set")] = None) -> None:
    """Validate recipes without loading any weights (exit 2 on the first invalid one)."""
    from quantkit.recipe import RecipeError, load_recipe

    bad = 0
    for f in files:
        try:
            r = load_recipe(f, set_ or [])
            typer.echo(f"{f}: ok ({r.name}: " + ", ".join(s.method + (f"/{s.scheme}" if s.scheme else "") for s in r.stages) + ")")
        except RecipeError as exc:
            typer.echo(str(exc), err=True)
            bad += 1
    raise typer.Exit(2 if bad else 0)


@recipes_app.command("list")
def recipes_list(folder: Annotated[Optional[Path], typer.Option(help="Where to look (default: the shipped recipes).")] = None) -> None:
    """List recipes with their one-line description (each shipped one can be named instead of a path)."""
    import yaml

    from quantkit.resources import recipe_files

    files = sorted(folder.glob("*.yaml")) if folder else recipe_files()
    for f in files:
        data = yaml.safe_load(f.read_text()) or {}
        typer.echo(f"{f.stem:<32} {data.get('description', '')}")
    if not folder and files:
        typer.echo(f"(in {files[0].parent}; use a name or a path, e.g. quantkit convert {files[0].stem})")


@recipes_app.command("corpora")
def recipes_corpora() -> None:
    """List the builtin calibration corpora a recipe can name: `{type: builtin, name: NAME}`."""
    from quantkit.resources import BUILTIN_CORPORA, shipped

    for name, c in BUILTIN_CORPORA.items():
        typer.echo(f"{name:<10} {c.reader:<6} {c.about}")
    typer.echo(f"(files under {shipped('calibration', 'train')})")


@models_app.command("fetch")
def models_fetch(name: Annotated[str, typer.Argument(help="Demo model name, e.g. smollm2-135m.")], quiet: Quiet = False) -> None:
    """Make a demo model available as a local bf16 safetensors folder in QUANTKIT_HOME."""
    from quantkit.model.sources import ensure_demo_model

    typer.echo(str(ensure_demo_model(name, quiet=quiet)))


def register(app: typer.Typer) -> None:
    """Add these commands to `app`."""
    app.command()(convert)
    app.command()(inspect)
    app.command()(capability)
    app.add_typer(recipes_app, name="recipes")
    app.add_typer(models_app, name="models")
