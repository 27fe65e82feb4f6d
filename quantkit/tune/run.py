"""Run a study's cells: convert each artifact once, evaluate it against the cached baseline, gate it, and
record everything; resumable (a cell's record is written last: a cell with one is finished). The study
folder's layout: docs/tune.md."""

from __future__ import annotations

import json
import shlex
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from quantkit.io import atomic_write_json
from quantkit.locks import exclusive, lock_beside
from quantkit.recipe import EvalSpec, Recipe
from quantkit.tune.study import Cell, Study

CELL_FILE = "cell.json"


@dataclass
class Steps:
    """The operations a study runs, injectable so the runner's logic is testable without an engine.

    can_run(recipe) -> (ok, reason)            decided before converting (quantkit.engine.capability)
    convert(recipe, output) -> artifact folder
    evaluate(artifact, spec, output) -> report.json path          (a full eval against the cached baseline)
    serve(artifact, spec, engine_args, quality_report, output) -> report.json   (a serving cell)
    gate(report) -> {"passed": bool, "results": [...]}
    """

    can_run: Callable[[Recipe], tuple[bool, str]]
    convert: Callable[[Recipe, Path], Path]
    evaluate: Callable[[Path, EvalSpec, Path], Path]
    serve: Callable[[Path, EvalSpec, dict, Path, Path], Path]
    gate: Callable[[Path], dict]


def real_steps(progress: Callable[[str], None]) -> Steps:
    """The product's own convert, eval and gate."""
    from quantkit.convert import convert
    from quantkit.engine.capability import recipe_can_run
    from quantkit.evaluate.run import run_eval, run_serving_variant
    from quantkit.export.manifest import read_manifest
    from quantkit.gates import run_gates
    from quantkit.hardware import hardware

    device = "cuda" if hardware()["gpu"] else "cpu"

    def do_convert(recipe: Recipe, output: Path) -> Path:
        if (output / "manifest.json").is_file():
            done = read_manifest(output).get("recipe")
            if json.dumps(done, sort_keys=True) == json.dumps(recipe.model_dump(mode="json"), sort_keys=True):
                progress(f"  artifact {output} already converted from this recipe: reused")
                return output
        return convert(recipe, output, overwrite=True, quiet=True)

    def do_gate(report: Path) -> dict:
        gr = run_gates(report)
        return {"passed": gr.passed, "source": gr.source,
                "results": [{"gate": r.name, "passed": r.passed, "reason": r.reason} for r in gr.results]}

    return Steps(
        can_run=lambda recipe: recipe_can_run(recipe, device),
        convert=do_convert,
        evaluate=lambda art, spec, out: run_eval(art, suite=spec, output=out, overwrite=True, progress=progress)
        / "report.json",
        serve=lambda art, spec, args, rep, out: run_serving_variant(art, spec, args, rep, out, progress=progress),
        gate=do_gate,
    )


def study_dir(study: Study, output: Path | None = None) -> Path:
    return Path(output).expanduser().resolve() if output else (Path("runs") / "tune" / study.spec.name).resolve()


def cell_command(study: Study, cell: Cell, output: Path) -> str:
    """The one command that re-runs this cell alone (and refreshes the study's tables)."""
    return (f"quantkit tune {shlex.quote(str(study.path))} --output {shlex.quote(str(output))} "
            f"--cell {shlex.quote(cell.id)} --rerun")


def read_record(output: Path, cell: Cell) -> dict | None:
    f = output / "cells" / cell.folder / CELL_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None  # a torn record from an old crash: the cell counts as unfinished


def run_study(study: Study, output: Path | None = None, *, cells: list[str] | None = None, rerun: bool = False,
              retry_failed: bool = False, steps: Steps | None = None,
              progress: Callable[[str], None] = print) -> Path:
    """Run (or continue) the study; returns its folder. `cells` limits the run to those ids (with their
    artifact cells, which a serving cell needs); `rerun` runs them even if finished."""
    output = study_dir(study, output)
    output.mkdir(parents=True, exist_ok=True)
    known = {c.id for c in study.cells} | set(study.invalid)
    unknown = [c for c in cells or [] if c not in known]
    if unknown:
        from quantkit.tune.study import StudyError

        raise StudyError(f"{study.path}: no cell {', '.join(map(repr, unknown))} in this study (cells: "
                         f"{', '.join(sorted(known))})")
    with exclusive(lock_beside(output), f"the study in {output}"):
        steps = steps or real_steps(progress)
        atomic_write_json(output / "study.json", _study_json(study, output))
        wanted = set(cells) if cells else None
        if wanted:  # a serving cell's artifact cell runs too (it is only re-used if already finished)
            wanted |= {c.quant_id for c in study.cells if c.id in wanted and c.serving}
        records: dict[str, dict] = {}
        todo = [c for c in study.cells if wanted is None or c.id in wanted]
        for n, cell in enumerate(todo, 1):
            prev = read_record(output, cell)
            forced = rerun and cells is not None and cell.id in cells
            if prev is not None and not forced and (prev["status"] != "failed" or not retry_failed):
                progress(f"[{n}/{len(todo)}] {cell.id}: {prev['status']} earlier ({prev.get('reason') or 'see its record'})"
                         if prev["status"] != "done" else f"[{n}/{len(todo)}] {cell.id}: finished earlier")
                records[cell.id] = prev
                continue
            progress(f"[{n}/{len(todo)}] {cell.id}")
            rec = _run_cell(study, cell, output, steps, records, progress)
            atomic_write_json(output / "cells" / cell.folder / CELL_FILE, rec)
            records[cell.id] = rec
            progress(f"[{n}/{len(todo)}] {cell.id}: {rec['status']}"
                     + (f" ({rec['reason']})" if rec.get("reason") else ""))
    return output


def _run_cell(study: Study, cell: Cell, output: Path, steps: Steps, records: dict, progress) -> dict:
    from quantkit.tune.choose import cell_figures

    folder = output / "cells" / cell.folder
    folder.mkdir(parents=True, exist_ok=True)
    rec = {"id": cell.id, "choices": cell.choices, "kind": "serving" if cell.serving else "artifact",
           "quant_id": cell.quant_id, "engine_args": cell.engine_args, "recipe_hash": cell.recipe.hash(),
           "quantization": [_stage_summary(s) for s in cell.recipe.stages],
           "command": cell_command(study, cell, output), "status": None, "reason": None, "timings": {}}
    t0 = time.perf_counter()
    try:
        ok, why = steps.can_run(cell.recipe)
        if not ok:
            return _finish(rec, "skipped", f"this machine's engine cannot serve it: {why}", t0)
        artifact = output / "artifacts" / cell.recipe.name  # <study>-<quant id>: shared by equal quantizations
        spec = study.eval
        if cell.serving:
            base = records.get(cell.quant_id)
            if base is None and any(c.id == cell.quant_id for c in study.cells):
                base = read_record(output, _cell(study, cell.quant_id))
            if base is None or base["status"] != "done":
                what = "was not run" if base is None else f"is {base['status']}: {base.get('reason')}"
                return _finish(rec, "skipped", f"its artifact cell {cell.quant_id} {what}", t0)
            rec["artifact"] = base["artifact"]
            t = time.perf_counter()
            report = steps.serve(Path(base["artifact"]), spec, cell.engine_args, Path(base["report"]),
                                 folder / "eval")
            rec["timings"]["eval_s"] = time.perf_counter() - t
        else:
            t = time.perf_counter()
            art = steps.convert(cell.recipe, artifact)
            rec["timings"]["convert_s"] = time.perf_counter() - t
            rec["artifact"] = str(art)
            t = time.perf_counter()
            report = steps.evaluate(art, spec, folder / "eval")
            rec["timings"]["eval_s"] = time.perf_counter() - t
        rec["report"] = str(report)
        rec["gates"] = steps.gate(report)
        data = json.loads(Path(report).read_text(encoding="utf-8"))
        rec["figures"] = cell_figures(data, study.spec.load.peak)
        rec["config"] = _config(data)
        return _finish(rec, "done", None, t0)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one cell's failure is recorded; the study goes on
        tb = traceback.format_exc()
        (folder / "error.log").write_text(tb, encoding="utf-8")
        progress(f"  {cell.id} failed: {type(exc).__name__}: {exc} (traceback in {folder / 'error.log'})")
        return _finish(rec, "failed", f"{type(exc).__name__}: {exc}"[:500], t0)


def _finish(rec: dict, status: str, reason: str | None, t0: float) -> dict:
    rec.update(status=status, reason=reason, finished=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    rec["timings"]["total_s"] = time.perf_counter() - t0
    return rec


def _cell(study: Study, cell_id: str) -> Cell:
    return next(c for c in study.cells if c.id == cell_id)


def _stage_summary(stage) -> dict:
    d = stage.model_dump(mode="json")
    return {k: d[k] for k in ("method", "scheme", "group_size", "actorder", "ignore", "smoothing_strength")
            if d.get(k) is not None}


def _config(report: dict) -> dict:
    """What a reviewer needs to know about how the cell was measured (the field guide's list)."""
    eng, work, gen = report.get("engine") or {}, report.get("workload") or {}, report.get("generation") or {}
    hw = report.get("hardware") or {}
    art = report.get("artifact") or {}
    return {
        "model": (report.get("baseline") or {}).get("path"),
        "artifact": art.get("path"),
        "format": (art.get("quantization") or {}).get("format"),
        "size_bytes": art.get("size_bytes"),
        "engine": f"{eng.get('name')} {eng.get('version')}", "dtype": eng.get("dtype"),
        "engine_args": eng.get("engine_args"), "max_model_len": eng.get("max_model_len"),
        "kv_cache_gib": eng.get("kv_cache_gib"),
        "hardware": {k: hw.get(k) for k in ("cpu", "cpu_kind", "cpu_flags", "cpu_count", "memory_bytes", "gpu")
                     if k in hw},
        "prompt_tokens": work.get("prompt_tokens"), "output_tokens": work.get("output_tokens"),
        "requests_per_level": work.get("num_requests"), "concurrency": work.get("concurrency"),
        "request_rates": work.get("request_rates"),
        "generation": gen.get("speed"),
    }


def _study_json(study: Study, output: Path) -> dict:
    return {"study": study.spec.model_dump(mode="json"), "path": str(study.path), "base": str(study.base_path),
            "eval": study.eval.model_dump(mode="json"), "invalid": study.invalid,
            "cells": [{"id": c.id, "choices": c.choices, "quant_id": c.quant_id, "engine_args": c.engine_args,
                       "kind": "serving" if c.serving else "artifact", "recipe": c.recipe.model_dump(mode="json"),
                       "command": cell_command(study, c, output)} for c in study.cells]}


def load_records(study: Study, output: Path) -> list[dict]:
    """Every finished cell's record, in study order; unfinished cells are listed as status None."""
    out = []
    for c in study.cells:
        rec = read_record(output, c)
        out.append(rec if rec is not None else {"id": c.id, "choices": c.choices, "status": None,
                                                "kind": "serving" if c.serving else "artifact",
                                                "command": cell_command(study, c, output)})
    for cid, why in study.invalid.items():
        out.append({"id": cid, "status": "invalid", "reason": why})
    return out


__all__ = ["Steps", "real_steps", "run_study", "study_dir", "load_records", "cell_command", "read_record"]
