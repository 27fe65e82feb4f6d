"""Which suite an eval runs, and the files it names.

A suite is an `EvalSpec` (quantkit.recipe): the recipe's `eval:` section, or a YAML file with the same
fields. Resolution order for `quantkit eval ARTIFACT [--suite S]`:
1. `--suite FILE` (an existing .yaml path) or `--suite NAME` (evals/suites/NAME.yaml) replaces the
   recipe's section entirely (no field merging: what you read in the file is what runs);
2. otherwise the `eval:` section of the recipe recorded in the artifact's manifest;
3. otherwise `EvalSpec()` defaults, which equal evals/suites/default.yaml (a unit test keeps them equal).
Suites and perplexity files come from quantkit's shipped data when they are not files in the working
directory (quantkit.resources), so `--suite default` and the default perplexity texts work from any folder.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from quantkit.recipe import EvalSpec, RecipeError, format_errors
from quantkit.resources import find_file, shipped


def suites_dir() -> Path:
    return shipped("evals", "suites")


def list_suites() -> list[str]:
    return sorted(p.stem for p in suites_dir().glob("*.yaml"))


def parse_suite(data: object, source: str, label: str | None = None) -> EvalSpec:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a suite must be a YAML mapping of eval fields (see evals/suites/default.yaml)")
    if label and "suite" not in data:
        data = {**data, "suite": label}
    try:
        return EvalSpec.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_errors(exc, source)) from None


def load_suite(suite: str | Path | EvalSpec | None, manifest: dict | None = None) -> EvalSpec:
    """The EvalSpec to run (see the module docstring for the order); an EvalSpec is taken as it is."""
    if isinstance(suite, EvalSpec):
        return suite
    if suite is not None:
        path = Path(suite).expanduser()
        if not path.is_file():
            path = suites_dir() / f"{suite}.yaml"
            if not path.is_file():
                raise RecipeError(f"suite {suite!r}: neither a file nor a known suite "
                                  f"(known: {', '.join(list_suites()) or 'none'} in {suites_dir()})")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path}: not valid YAML: {exc}") from None
        return parse_suite(data, str(path), label=path.stem)
    section = ((manifest or {}).get("recipe") or {}).get("eval")
    if section is not None:
        return parse_suite(section, "manifest.json: recipe.eval")
    return EvalSpec()


def resolve_file(name: str) -> Path:
    """A suite's perplexity file, absolute (the working directory first, then the shipped data)."""
    try:
        return find_file(name)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"perplexity file {exc}; fix eval.perplexity_files in the suite") from None
