"""`quantkit` command line: thin typer adapters, each calling one function of quantkit.api.

Examples:
    quantkit models fetch smollm2-135m
    quantkit convert recipes/smollm2-w4a16-gptq.yaml
    quantkit convert recipes/smollm2-w8a8-rtn.yaml --set calibration.num_samples=64 --output runs/w8a8-64
    quantkit inspect runs/smollm2-w8a8-rtn
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Quantize an LLM from a YAML recipe into a vLLM-ready checkpoint, and prove it is worth serving.")
recipes_app = typer.Typer(no_args_is_help=True, help="Validate and list recipes.")
models_app = typer.Typer(no_args_is_help=True, help="Demo models.")
app.add_typer(recipes_app, name="recipes")
app.add_typer(models_app, name="models")

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars; errors only.")]
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _user_errors():
    from quantkit.data import DataError
    from quantkit.models import ModelError
    from quantkit.pipeline import ConvertError
    from quantkit.recipe import RecipeError

    return (RecipeError, ModelError, DataError, ConvertError, FileExistsError, FileNotFoundError)


@app.command()
def convert(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output folder (default: export.output_dir or runs/<name>).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a recipe field: a.b=value (repeatable).")] = None,
    restart: Annotated[bool, typer.Option(help="Discard an unfinished conversion of a different recipe/model/data.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder (atomically, at the end).")] = False,
    quiet: Quiet = False,
) -> None:
    """Quantize the model a recipe names and export a compressed-tensors checkpoint with a manifest."""
    from quantkit import api
    from quantkit.recipe import load_recipe

    try:
        r = load_recipe(recipe, set_ or [])
        out = api.convert(r, output, restart=restart, overwrite=overwrite, quiet=quiet)
    except _user_errors() as exc:
        _fail(str(exc))
    typer.echo(str(out))


@app.command()
def inspect(folder: Annotated[Path, typer.Argument(help="An exported artifact folder.")],
            json_out: Annotated[bool, typer.Option("--json", help="Print the manifest summary as JSON.")] = False) -> None:
    """Print an artifact's summary and verify every file's sha256 (exit 1 on any mismatch)."""
    from quantkit.export.manifest import read_manifest, verify

    try:
        man = read_manifest(folder)
    except FileNotFoundError as exc:
        _fail(str(exc))
    problems = verify(folder)
    layers = man.get("layers", {})
    sq = [v.get("output_sqnr_db", v.get("weight_sqnr_db")) for v in layers.values()]
    summary = {
        "name": man["name"], "base_model": man["base_model"]["path"],
        "stages": man["quantization"]["stages"], "format": man["quantization"]["format"],
        "modules_quantized": man["quantization"]["modules_quantized"],
        "size_mb": round(man["size_bytes"] / 1e6, 2),
        "calibration": (man["calibration"] or {}).get("fingerprint"),
        "sqnr_db_min": min(sq) if sq else None, "sqnr_db_mean": round(sum(sq) / len(sq), 2) if sq else None,
        "wall_time_s": man["conversion"]["wall_time_s"], "peak_rss_mb": round(man["conversion"]["peak_rss_bytes"] / 1e6),
        "checksums": "ok" if not problems else "MISMATCH",
    }
    if json_out:
        typer.echo(json.dumps({**summary, "problems": problems}, indent=2))
    else:
        for k, v in summary.items():
            typer.echo(f"{k:>18}: {v}")
        for p in problems:
            typer.echo(f"  ! {p}", err=True)
    raise typer.Exit(1 if problems else 0)


@recipes_app.command("validate")
def recipes_validate(files: Annotated[list[Path], typer.Argument(help="Recipe files.")],
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
def recipes_list(folder: Annotated[Path, typer.Option(help="Where to look.")] = RECIPES_DIR) -> None:
    """List the shipped recipes with their one-line description."""
    import yaml

    for f in sorted(folder.glob("*.yaml")):
        data = yaml.safe_load(f.read_text()) or {}
        typer.echo(f"{f.name:<36} {data.get('description', '')}")


@models_app.command("fetch")
def models_fetch(name: Annotated[str, typer.Argument(help="Demo model name, e.g. smollm2-135m.")], quiet: Quiet = False) -> None:
    """Make a demo model available as a local bf16 safetensors folder in QUANTKIT_HOME."""
    from quantkit.demo import ensure_demo_model
    from quantkit.models import ModelError

    try:
        typer.echo(str(ensure_demo_model(name, quiet=quiet)))
    except ModelError as exc:
        _fail(str(exc))


# Commands that live in their own modules, registered explicitly (no discovery).
from quantkit.cli_eval import register as _register_eval  # noqa: E402
from quantkit.cli_registry import register as _register_registry  # noqa: E402

_register_eval(app)
_register_registry(app)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
