"""The files quantkit ships besides its code: recipes, the calibration corpus, eval suites and tasks.

The repository's top-level `recipes/`, `calibration/` and `evals/` folders are the only copy. A wheel
carries them as package data: setup.py's build step copies them into `quantkit/_data/` at build time.
So at run time they are found in one of two places, in this order:

1. `quantkit/_data/` inside the installed package (a wheel, `pip install .`);
2. the repository root above the package (a source checkout or an editable install).

`shipped(...)` is the one way to reach them; nothing else computes a path from `__file__`.
Named calibration corpora (`{type: builtin, name: prose}` in a recipe) are listed in BUILTIN_CORPORA:
only `calibration/train/` is offered, so held-out text can never become calibration data by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SHIPPED = ("recipes", "calibration", "evals")  # the folders a wheel carries (setup.py copies these)
_PACKAGE = Path(__file__).resolve().parent


class ResourceError(FileNotFoundError):
    """A shipped file is missing: the installation is incomplete."""


def data_root() -> Path:
    """The folder that holds recipes/, calibration/ and evals/ for this installation."""
    for root in (_PACKAGE / "_data", _PACKAGE.parent):
        if all((root / name).is_dir() for name in SHIPPED):
            return root
    raise ResourceError(f"quantkit's shipped data ({', '.join(SHIPPED)}) is missing from {_PACKAGE / '_data'} "
                        f"and {_PACKAGE.parent}; reinstall quantkit (pip install quantkit) or run from a checkout")


def shipped(*parts: str) -> Path:
    """A path inside the shipped data, e.g. shipped("evals", "suites")."""
    return data_root().joinpath(*parts)


def find_file(name: str | Path) -> Path:
    """A user-named file: as given (absolute, or relative to the working directory), else the same relative
    path inside the shipped data (`calibration/heldout/technical.txt` works from any folder). Absolute."""
    p = Path(name).expanduser()
    if p.is_file():
        return p.resolve()
    if not p.is_absolute():
        cand = shipped() / p
        if cand.is_file():
            return cand.resolve()
    raise FileNotFoundError(f"{name}: no such file (looked in {Path.cwd()} and in quantkit's shipped data {shipped()})")


# ---------------------------------------------------------------------------------- recipes by name
def recipe_files() -> list[Path]:
    return sorted(shipped("recipes").glob("*.yaml"), key=lambda p: p.stem)


def shipped_recipe(name: str) -> Path | None:
    """`smollm2-w8a8-rtn` or `smollm2-w8a8-rtn.yaml` -> the shipped recipe file, if there is one."""
    if "/" in name or "\\" in name:
        return None
    stem = name[:-5] if name.endswith(".yaml") else name
    p = shipped("recipes") / f"{stem}.yaml"
    return p if p.is_file() else None


# -------------------------------------------------------------------------------- builtin corpora
@dataclass(frozen=True)
class Corpus:
    """A named part of the shipped calibration corpus and how to read it."""

    reader: str  # a calibration source type: text | jsonl | chat
    pattern: str  # glob relative to calibration/train
    field: str = "text"
    about: str = ""


BUILTIN_CORPORA = {
    "prose": Corpus("text", "prose/*.txt", about="essays, explainers, how-to guides, stories, news-style reports"),
    "code": Corpus("text", "code/*", about="Python, JavaScript, TypeScript, SQL, Bash, Rust, Makefile, Markdown"),
    "chat": Corpus("chat", "chat/conversations.jsonl", field="messages",
                   about="multi-turn conversations, rendered with the model's chat template"),
    "json": Corpus("jsonl", "json/records.jsonl", field="text", about="JSON records as text"),
    "numbers": Corpus("text", "numbers/*", about="tables, timetables, receipts and other number-heavy text"),
}


def corpus_glob(name: str) -> str:
    """The absolute glob of a builtin corpus (the name is validated by the recipe)."""
    return str(shipped("calibration", "train") / BUILTIN_CORPORA[name].pattern)
