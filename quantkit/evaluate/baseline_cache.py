"""Reuse a baseline's measurements across evals: many candidates are compared against one baseline.

An entry holds everything `quantkit eval` measured on the baseline side (raw side figures, the
scored positions that KL and top-1 agreement are computed from, the engine log and lm-eval samples),
under `$QUANTKIT_HOME/baselines/<key>/`. The key is the sha256 of:

- the baseline's weights and config (sha256 of every *.safetensors / *.json file, quantkit.io.model_fingerprint)
- the suite as it runs: every field that changes a baseline figure (not the label, the candidate-only
  serving variants or the price, which is applied when the report is built), plus the bytes of the
  perplexity texts and of the shipped task files
- the engine's name and version, and the engine dtype actually used
- the hardware line: CPU model, its key flags, core count, memory, GPU
- MEASUREMENT, the version of how quantkit measures (raised when a phase's method changes what it records,
  e.g. the chat checks' per-request token budgets in 2)

Entries made before per-window data was recorded (no `window_positions` in quality.json, no `windows` in
the side's quality) still load; the report then has no bootstrap interval for the baseline's side.

Anything else changes nothing the baseline measures. A changed model, suite, task file, engine,
dtype or machine gives another key, so a fresh measurement. `--fresh-baseline` measures anew and
replaces the entry. Speed figures in a reused entry were measured when the entry was made: the report
says so, with that time, so a reader can judge whether the machine was alike then.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

from quantkit.evaluate.quality import QualityRun
from quantkit.io import atomic_dir, model_fingerprint, quantkit_home, sha256_file

SCHEMA = "quantkit.baseline-cache/1"
MEASUREMENT = 5  # 1: up to session 5; 2: tool requests get per-item budgets (probes/chat.TOOL_BUDGET);
# 3: speed warms the engine up before the first level only, and not after the chat checks (speed.py);
# 4: a side with a failed phase is never stored (evaluate/phases.py), and failed safety requests count against it;
# 5: the engine's memory is the serving processes' high-water marks (engine/procmon.py), which an older entry lacks:
# its sampled PSS against the candidate's high-water marks would compare two different measures
SUITE_FIELDS_NOT_IN_KEY = ("suite", "variants", "price_per_hour")
FILES = ("side.json", "quality.json", "key.json")
KEPT = ("logs/vllm-baseline.log", "tasks/baseline/samples.json")  # evidence copied into each eval that reuses it


def cache_root() -> Path:
    return quantkit_home() / "baselines"


def key_parts(model_dir: Path, spec: dict, files: list[Path], engine: str, engine_version: str | None,
              dtype: str, hardware: dict) -> dict:
    """What the key is made of (also stored in the entry, so a reader sees why it matched)."""
    suite = {k: v for k, v in spec.items() if k not in SUITE_FIELDS_NOT_IN_KEY}
    return {
        "model": model_fingerprint(Path(model_dir)),
        "suite": hashlib.sha256(json.dumps(suite, sort_keys=True, default=str).encode()).hexdigest(),
        "suite_files": {str(f): sha256_file(f) for f in sorted(files)},
        "engine": engine, "engine_version": engine_version, "dtype": dtype,
        "hardware": {k: hardware.get(k) for k in ("cpu", "cpu_flags", "cpu_count", "memory_bytes", "gpu")},
        "measurement": MEASUREMENT,
    }


def make_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def quality_to_json(run: QualityRun | None) -> dict | None:
    if run is None:
        return None
    return {"actual": run.actual, "per_file": run.per_file, "window_positions": run.window_positions,
            "positions": [[[t, lp, rank] for t, (lp, rank) in pos.items()] for pos in run.positions]}


def quality_from_json(data: dict | None) -> QualityRun | None:
    if data is None:
        return None
    return QualityRun(actual=list(data["actual"]), per_file=data["per_file"],
                      positions=[{int(t): (float(lp), int(rank)) for t, lp, rank in pos} for pos in data["positions"]],
                      window_positions=[int(n) for n in data.get("window_positions") or []])  # absent in older entries


def lookup(key: str) -> Path | None:
    """The entry folder for `key`, if a complete one exists."""
    entry = cache_root() / key
    if all((entry / f).is_file() for f in FILES):
        try:
            if json.loads((entry / "key.json").read_text(encoding="utf-8")).get("schema") == SCHEMA:
                return entry
        except (OSError, json.JSONDecodeError):
            return None
    return None


def load(entry: Path, eval_dir: Path) -> tuple[dict, QualityRun | None, dict]:
    """(side figures, scored positions, key.json) of an entry; its logs and samples are copied into `eval_dir`."""
    side = json.loads((entry / "side.json").read_text(encoding="utf-8"))
    quality = quality_from_json(json.loads((entry / "quality.json").read_text(encoding="utf-8")))
    meta = json.loads((entry / "key.json").read_text(encoding="utf-8"))
    for rel in KEPT:
        if (entry / rel).is_file():
            (eval_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(entry / rel, eval_dir / rel)
    if (side.get("engine") or {}).get("log"):
        side["engine"]["log"] = str(eval_dir / KEPT[0])
    return side, quality, meta


def store(key: str, parts: dict, side: dict, quality: QualityRun | None, eval_dir: Path) -> Path:
    """Write an entry atomically (a crash leaves no half entry that a later lookup could take)."""
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with atomic_dir(cache_root() / key, overwrite=True) as tmp:
        (tmp / "side.json").write_text(json.dumps(side, default=str) + "\n", encoding="utf-8")
        (tmp / "quality.json").write_text(json.dumps(quality_to_json(quality)) + "\n", encoding="utf-8")
        for rel in KEPT:
            if (eval_dir / rel).is_file():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(eval_dir / rel, tmp / rel)
        (tmp / "key.json").write_text(json.dumps({"schema": SCHEMA, "key": key, "created": created,
                                                  "source_eval": str(eval_dir), "parts": parts}, indent=1) + "\n",
                                      encoding="utf-8")
    return cache_root() / key
