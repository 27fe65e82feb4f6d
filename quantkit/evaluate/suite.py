"""Which suite an eval runs, and the files it names.

A suite is an `EvalSpec` (quantkit.recipe): the recipe's `eval:` section, or a YAML file with the same
fields. Resolution order for `quantkit eval ARTIFACT [--suite S]`:
1. `--suite FILE` (an existing .yaml path) or `--suite NAME` (evals/suites/NAME.yaml) replaces the
   recipe's section entirely (no field merging: what you read in the file is what runs);
2. otherwise the `eval:` section of the recipe recorded in the artifact's manifest;
3. otherwise `EvalSpec()` defaults, which equal evals/suites/default.yaml (a unit test keeps them equal).
Relative perplexity files resolve against the working directory first, then the repository root.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from quantkit.recipe import EvalSpec, RecipeError, format_errors

REPO_ROOT = Path(__file__).resolve().parents[2]
SUITES_DIR = REPO_ROOT / "evals" / "suites"


def list_suites() -> list[str]:
    return sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))


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


def load_suite(suite: str | Path | None, manifest: dict | None = None) -> EvalSpec:
    """The EvalSpec to run (see the module docstring for the order)."""
    if suite is not None:
        path = Path(suite)
        if not path.is_file():
            path = SUITES_DIR / f"{suite}.yaml"
            if not path.is_file():
                raise RecipeError(f"suite {suite!r}: neither a file nor a known suite "
                                  f"(known: {', '.join(list_suites()) or 'none'} in {SUITES_DIR})")
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
    p = Path(name)
    for cand in (p, REPO_ROOT / p):
        if cand.is_file():
            return cand.resolve()
    raise FileNotFoundError(f"perplexity file {name!r} not found (looked in {Path.cwd()} and {REPO_ROOT}); "
                            "fix eval.perplexity_files in the suite")
