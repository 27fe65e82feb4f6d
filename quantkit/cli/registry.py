"""CLI commands for gates and the registry (`quantkit gate|publish|promote|rollback|registry`).

Thin adapters over quantkit.gates and quantkit.registry (exit codes: quantkit.cli.common).

Examples:
    quantkit gate runs/smollm2-w8a8-rtn --junit gates.xml
    quantkit publish runs/smollm2-w8a8-rtn
    quantkit publish runs/smollm2-w8a8-rtn --registry http://127.0.0.1:5000 --name smollm2-w8a8
    quantkit promote smollm2-135m-w8a8 2 --alias production
    quantkit rollback smollm2-135m-w8a8
    quantkit registry list
    quantkit registry show smollm2-135m-w8a8 production
    quantkit registry pull smollm2-135m-w8a8 production ./model
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.cli.common import JsonOut, tracked

Registry = Annotated[Optional[str], typer.Option(
    "--registry", "-r", envvar="QUANTKIT_REGISTRY",
    help="http(s)://host:port (MLflow server), sqlite:///x.db, hf://org[/name]; default: embedded in QUANTKIT_HOME.")]
Alias = Annotated[str, typer.Option("--alias", "-a", help="The alias to move.")]


def _quiet_mlflow() -> None:
    # mlflow logs every wait and migration at INFO, and sets its logger up when first imported (so import it
    # first); the CLI prints its own one-line results. A user's own setting of the progress bar wins.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow  # noqa: F401

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _print_version(info, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(info.to_dict(), indent=2))
        return
    typer.echo(f"{info.name} version {info.version}" + (f"  aliases: {', '.join(info.aliases)}" if info.aliases else ""))
    typer.echo(f"  source: {info.source}")
    if info.created:
        typer.echo(f"  created: {info.created}")
    for k, v in sorted(info.tags.items()):
        typer.echo(f"  {k}: {v}")


def gate(ctx: typer.Context,
         report: Annotated[Path, typer.Argument(help="report.json, or the artifact / eval folder holding it.")],
         junit: Annotated[Optional[Path], typer.Option("--junit", help="Also write JUnit XML here (for CI).")] = None,
         json_out: JsonOut = False) -> None:
    """Check the gates (recipe's, else the scheme's defaults) on an eval report; exit 0 if all pass, else 1."""
    from quantkit import tracking
    from quantkit.gates import format_table, gate_path, resolve_report_path, run_gates, write_junit

    path = resolve_report_path(report)
    model, name = tracking.subject_of_report(path)
    with tracked(ctx, "gate", model, f"gate {name}") as run:
        gr = run_gates(path)
        if run is not None:
            tracking.log_gate(run, gr.to_dict(), gate_path(path))
        if junit:
            write_junit(gr, junit)
        typer.echo(json.dumps(gr.to_dict(), indent=2) if json_out else format_table(gr))
        raise typer.Exit(0 if gr.passed else 1)


def publish(artifact: Annotated[Path, typer.Argument(help="An exported artifact folder (eval'd and gated).")],
            registry: Registry = None,
            name: Annotated[Optional[str], typer.Option("--name", "-n", help="Registered model name (default: recipe publish.name, else the artifact name).")] = None,
            report: Annotated[Optional[Path], typer.Option("--report", help="report.json (default: ARTIFACT/eval/report.json); gate.json must sit beside it.")] = None,
            json_out: JsonOut = False) -> None:
    """Publish a gated artifact as a new registry version (refused if ungated, failing or tampered)."""
    from quantkit import registry as reg

    _quiet_mlflow()
    info = reg.publish(artifact, registry_uri=registry, name=name, report=report)
    if json_out:
        _print_version(info, True)
    else:
        typer.echo(f"published {info.name} version {info.version}  "
                   f"(promote: quantkit promote {info.name} {info.version} --alias {reg.DEFAULT_ALIAS})")


def promote(name: Annotated[str, typer.Argument(help="Registered model name.")],
            version: Annotated[str, typer.Argument(help="Version number (or an alias to copy).")],
            alias: Alias = "production", registry: Registry = None) -> None:
    """Point an alias (default: production) at a version; rollback can return to the previous one."""
    from quantkit import registry as reg

    _quiet_mlflow()
    info = reg.promote(name, version, alias, registry_uri=registry)
    typer.echo(f"{name}@{alias} -> version {info.version}")


def rollback(name: Annotated[str, typer.Argument(help="Registered model name.")],
             alias: Alias = "production", registry: Registry = None) -> None:
    """Move an alias back to the version it pointed at before."""
    from quantkit import registry as reg

    _quiet_mlflow()
    info = reg.rollback(name, alias, registry_uri=registry)
    typer.echo(f"{name}@{alias} -> version {info.version} (rolled back)")
    _print_lineage(info)  # the evidence of the version that serves now


registry_app = typer.Typer(no_args_is_help=True, help="Browse and download registered models.")


@registry_app.command("list")
def registry_list(name: Annotated[Optional[str], typer.Argument(help="Model name: list its versions.")] = None,
                  registry: Registry = None, json_out: JsonOut = False) -> None:
    """List registered models, or the versions of one model."""
    from quantkit import registry as reg

    _quiet_mlflow()
    rows = [v.to_dict() for v in reg.list_versions(name, registry)] if name else reg.list_models(registry)
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
    elif name:
        for v in rows:
            t = v["tags"]
            typer.echo(f"{v['version']:>4}  {v['created']:<25} {t.get('quantkit.scheme', ''):<8} "
                       f"{t.get('quantkit.gate', ''):<10} {','.join(v['aliases'])}")
    else:
        for m in rows:
            al = ", ".join(f"{a}={v}" for a, v in sorted(m["aliases"].items()))
            typer.echo(f"{m['name']:<40} versions={m['versions']} latest={m['latest_version']} {al}")


@registry_app.command("show")
def registry_show(name: Annotated[str, typer.Argument(help="Registered model name.")],
                  version: Annotated[str, typer.Argument(help="Version number or alias.")] = "production",
                  registry: Registry = None, json_out: JsonOut = False) -> None:
    """Show one version: source, aliases, its tags (base model, scheme, gate summary, key metrics) and its lineage
    (recipe, calibration, convert/eval/gate runs in the tracking store)."""
    from quantkit import registry as reg

    _quiet_mlflow()
    info = reg.show(name, version, registry)
    _print_version(info, json_out)
    if not json_out:
        _print_lineage(info)


def _print_lineage(info) -> None:
    """Recipe -> calibration -> convert run -> eval run -> gate verdict, from the version's tags."""
    from quantkit.tracking import lineage

    typer.echo("lineage:")
    for label, value in lineage(info.tags):
        typer.echo(f"  {label:<14} {value}")


@registry_app.command("pull")
def registry_pull(name: Annotated[str, typer.Argument(help="Registered model name.")],
                  version: Annotated[str, typer.Argument(help="Version number or alias.")],
                  dest: Annotated[Path, typer.Argument(help="New folder to download into (vLLM can serve it).")],
                  registry: Registry = None,
                  overwrite: Annotated[bool, typer.Option(help="Replace DEST if it exists.")] = False) -> None:
    """Download a version and verify every file's sha256 (nothing is left at DEST if any check fails)."""
    from quantkit import registry as reg

    _quiet_mlflow()
    out = reg.pull(name, version, dest, registry, overwrite=overwrite)
    typer.echo(str(out))


def register(app: typer.Typer) -> None:
    """Add the gate and registry commands to `app`."""
    app.command()(gate)
    app.command()(publish)
    app.command()(promote)
    app.command()(rollback)
    app.add_typer(registry_app, name="registry")
