"""A tune study: one base recipe, axes that each change one thing (a value changes the quantization or the
serving, never both), and the cells to measure. The file format and the expansion: docs/tune.md."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from quantkit.recipe import (EvalSpec, Recipe, RecipeError, apply_override, check_engine_args, find_recipe,
                             format_errors, parse_recipe)
from quantkit.strict import Strict

LABEL = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class AxisValue(Strict):
    """One alternative to the base on an axis: exactly one of recipe, set, engine_args."""

    label: str = Field(pattern=LABEL, description="short name, used in cell ids and tables")
    recipe: str | None = Field(None, description="a recipe file or shipped name: its calibration and stages replace "
                                                 "the base's (the scheme and method axis)")
    set: dict[str, Any] | None = Field(None, description="recipe fields by path, as `quantkit convert --set` takes "
                                                         "them, e.g. {stages[0].group_size: 32}")
    engine_args: dict[str, Any] | None = Field(None, description="vLLM server flags, e.g. {max_num_seqs: 8}")

    @model_validator(mode="after")
    def _one_change(self) -> "AxisValue":
        given = [k for k in ("recipe", "set", "engine_args") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"value {self.label!r}: give exactly one of recipe, set, engine_args (got "
                             f"{', '.join(given) or 'none'}): a value changes one thing")
        if self.engine_args:
            check_engine_args(self.engine_args)
        return self

    @property
    def serving(self) -> bool:
        return bool(self.engine_args)


class Axis(Strict):
    name: str = Field(pattern=LABEL)
    values: list[AxisValue] = Field(min_length=1)

    @field_validator("values")
    @classmethod
    def _distinct(cls, v: list[AxisValue]) -> list[AxisValue]:
        labels = [x.label for x in v]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup or "base" in labels:
            raise ValueError(f"labels must be distinct and not 'base' (the base is implied): {dup or ['base']}")
        return v


class LoadSpec(Strict):
    """The load every cell is measured at: normal and peak closed-loop concurrency, optional open-loop rates."""

    normal: int = Field(1, ge=1)
    peak: int = Field(4, ge=1)
    rates: list[float] = Field(default_factory=list, description="open-loop Poisson request rates (req/s)")

    @model_validator(mode="after")
    def _order(self) -> "LoadSpec":
        if self.peak < self.normal:
            raise ValueError(f"peak ({self.peak}) must be at least normal ({self.normal})")
        return self

    @property
    def levels(self) -> list[int]:
        return sorted({self.normal, self.peak})


class StudySpec(Strict):
    name: str = Field(pattern=LABEL)
    description: str = ""
    base: str = Field(description="the base recipe (file or shipped name)")
    mode: Literal["one_at_a_time", "grid"] = "one_at_a_time"
    price_per_hour: float = Field(gt=0, description="USD per hour of the serving machine")
    load: LoadSpec = Field(default_factory=LoadSpec)
    eval: dict[str, Any] = Field(default_factory=dict, description="eval fields replacing the base recipe's")
    axes: list[Axis] = Field(min_length=1)
    cost_tolerance: float = Field(0.15, ge=0, le=1, description="costs within this fraction of the cheapest passing "
                                  "cell are a tie (run-to-run spread of the speed measurements; 13% measured on 2 "
                                  "cores), and the tie goes to the best perplexity ratio")
    max_cells: int = Field(24, ge=1, description="refuse a study that expands to more cells than this")
    publish_name: str | None = Field(None, pattern=LABEL, description="registered model name the recommended "
                                     "artifact is published under (default: the base recipe's publish name)")

    @field_validator("axes")
    @classmethod
    def _distinct_axes(cls, v: list[Axis]) -> list[Axis]:
        names = [a.name for a in v]
        if len(set(names)) != len(names):
            raise ValueError(f"axis names must be distinct: {names}")
        return v


@dataclass
class Cell:
    """One configuration to measure. `quant_id` names its artifact (cells with equal quantization share it)."""

    id: str
    choices: dict[str, str]                 # axis -> value label ("base" omitted)
    recipe: Recipe
    quant_id: str
    engine_args: dict[str, Any] = field(default_factory=dict)

    @property
    def serving(self) -> bool:
        """A serving cell: its artifact is another cell's; only the engine settings differ."""
        return bool(self.engine_args)

    @property
    def folder(self) -> str:
        return safe_name(self.id)


def safe_name(cell_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", cell_id.replace("=", "-").replace(",", "__"))


@dataclass
class Study:
    spec: StudySpec
    path: Path
    base_path: Path
    base: Recipe
    eval: EvalSpec
    cells: list[Cell]
    invalid: dict[str, str]                 # cell id -> why its recipe does not validate


class StudyError(RecipeError):
    """A study problem, phrased for the user (file: field: problem)."""


def load_study(path: str | Path) -> Study:
    """Read and validate a study, expand its cells; relative paths are taken against the study's folder,
    then the working directory, then the shipped recipes."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise StudyError(f"{path}: no such study file")
    data = _raw(path, "a study must be a YAML mapping with name, base, price_per_hour and axes")
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as exc:
        raise StudyError(format_errors(exc, str(path))) from None
    return expand(spec, path)


def _recipe_file(ref: str, study_path: Path, field_name: str) -> Path:
    local = (study_path.parent / ref).expanduser()
    if local.is_file():
        return local.resolve()
    try:
        return find_recipe(ref)
    except RecipeError:
        raise StudyError(f"{study_path}: {field_name}: {ref!r} is neither a file (beside the study or in the working "
                         "directory) nor a shipped recipe (`quantkit recipes list`)") from None


def _raw(path: Path, what: str = "a recipe must be a YAML mapping") -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise StudyError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise StudyError(f"{path}: {what}")
    return data


def expand(spec: StudySpec, path: Path) -> Study:
    base_path = _recipe_file(spec.base, path, "base")
    base_raw = _raw(base_path)
    base = parse_recipe(base_raw, str(base_path)).with_absolute_paths(base_path.parent)
    evspec = _study_eval(spec, base, path)
    other = {v.recipe: _raw(_recipe_file(v.recipe, path, f"axes[{ai}].values[{vi}].recipe"))
             for ai, axis in enumerate(spec.axes) for vi, v in enumerate(axis.values) if v.recipe}
    cells, invalid, seen_quant = [], {}, {}
    for combo in _combos(spec, path):
        chosen = [(a.name, v) for a, v in zip(spec.axes, combo) if v is not None]
        cid = ",".join(f"{a}={v.label}" for a, v in chosen) or "base"
        quant = [(a, v) for a, v in chosen if not v.serving]
        qid = ",".join(f"{a}={v.label}" for a, v in quant) or "base"
        raw = _cell_raw(spec, evspec, base_raw, other, [v for _, v in quant], qid)
        try:
            recipe = parse_recipe(raw, f"{path}: cell {cid}").with_absolute_paths(base_path.parent)
        except RecipeError as exc:
            invalid[cid] = str(exc)
            continue
        engine: dict[str, Any] = {}
        for _, v in chosen:
            engine.update(v.engine_args or {})
        if qid in seen_quant and seen_quant[qid].recipe.hash() != recipe.hash():  # pragma: no cover (by construction)
            raise StudyError(f"{path}: cells with quantization {qid!r} disagree on their recipe")
        cell = Cell(cid, {a: v.label for a, v in chosen}, recipe, qid, engine)
        seen_quant.setdefault(qid, cell)
        cells.append(cell)
    # a serving cell needs its artifact's cell (the same quantization, no engine change) to run first
    ids = {c.id for c in cells}
    for c in [c for c in cells if c.serving]:
        if c.quant_id not in ids and c.quant_id not in invalid:  # pragma: no cover (both modes include it)
            raise StudyError(f"{path}: cell {c.id} has no artifact cell {c.quant_id}")
    cells.sort(key=lambda c: (c.serving, 0 if c.id == "base" else 1))
    return Study(spec, path, base_path, base, evspec, cells, invalid)


def _study_eval(spec: StudySpec, base: Recipe, path: Path) -> EvalSpec:
    """Every cell is measured on the same work: the base eval with the study's fields, load and price."""
    ev = {**base.eval.model_dump(mode="json"), **spec.eval}
    work = dict(ev.get("workload") or {})
    work.update(concurrency=spec.load.levels, request_rates=list(spec.load.rates))
    ev.update(workload=work, price_per_hour=spec.price_per_hour, variants=[])
    try:
        return EvalSpec.model_validate(ev)
    except ValidationError as exc:
        raise StudyError(format_errors(exc, f"{path} (eval)")) from None


def _combos(spec: StudySpec, path: Path) -> list[tuple]:
    """Each cell's value per axis (None: the base's)."""
    options = [[None] + list(a.values) for a in spec.axes]
    if spec.mode == "grid":
        combos = list(itertools.product(*options))
    else:
        combos = [tuple(None for _ in spec.axes)]
        for ai, axis in enumerate(spec.axes):
            for v in axis.values:
                combos.append(tuple(v if i == ai else None for i in range(len(spec.axes))))
    if len(combos) > spec.max_cells:
        raise StudyError(f"{path}: mode {spec.mode} expands to {len(combos)} cells, more than max_cells "
                         f"({spec.max_cells}); use one_at_a_time, fewer values, or raise max_cells")
    return combos


def _cell_raw(spec: StudySpec, evspec: EvalSpec, base_raw: dict, other: dict[str, dict], quant: list[AxisValue],
              qid: str) -> dict:
    """A cell's recipe as data: the base with its quantization values applied, the study's name and eval."""
    raw = json.loads(json.dumps(base_raw))
    for v in quant:
        if v.recipe:
            src = other[v.recipe]
            for key in ("calibration", "stages"):
                if key in src:
                    raw[key] = src[key]
                else:
                    raw.pop(key, None)
        for key, value in (v.set or {}).items():
            apply_override(raw, f"{key}={json.dumps(value)}")
    raw["name"] = safe_name(f"{spec.name}-{qid}")
    raw["eval"] = evspec.model_dump(mode="json")
    if spec.publish_name:
        raw["publish"] = {**(raw.get("publish") or {}), "name": spec.publish_name}
    raw.setdefault("export", {})
    return raw


__all__ = ["AxisValue", "Axis", "LoadSpec", "StudySpec", "Cell", "Study", "StudyError", "load_study", "expand",
           "safe_name"]
