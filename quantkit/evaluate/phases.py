"""Which phases of one side's eval failed. A failed phase makes the report incomplete: `quantkit eval` exits
non-zero naming it, the gates refuse the report, and the baseline cache never stores such a side.

What counts as failed (a side is one model's figures, quantkit/evaluate/run.py):
- quality: the engine's perplexity pass raised (an "error" entry) or did not run;
- reference: the engine-free reference raised ("skipped" for a model too large for this machine's memory is
  a decision the report states, not a failure);
- tasks / each chat check the suite asks for: an "error" entry, or no entry at all;
- speed: no level measured, or a level where every request failed (single failed requests are counted by
  the metric speed.failed_requests, which a default gate requires to be 0).
A speed-only side (a serving variant) is judged on speed alone.
"""

from __future__ import annotations


def _failed(section) -> str | None:
    if section is None:
        return "did not run"
    if isinstance(section, dict) and "error" in section:
        return str(section["error"])[:300]
    return None


def failed_phases(side: dict | None, role: str, suite: dict, speed_only: bool = False) -> list[str]:
    """["<role> <phase>: <why>", ...] for every phase of the side that the suite asked for and that failed."""
    if side is None:
        return []
    wanted: list[tuple[str, object]] = []
    if not speed_only:
        wanted.append(("quality", side.get("quality")))
        if suite.get("reference") and side.get("model_dir") and "reference" in side:
            wanted.append(("reference", side.get("reference")))
        if suite.get("tasks"):
            wanted.append(("tasks", side.get("tasks")))
        for name in suite.get("checks") or []:
            wanted.append((f"checks.{name}", (side.get("checks") or {}).get(name)))
    out = [f"{role} {phase}: {why}" for phase, section in wanted if (why := _failed(section))]
    speed = side.get("speed")
    if not speed:
        out.append(f"{role} speed: no level was measured")
    for level, s in (speed or {}).items():
        if isinstance(s, dict) and s.get("requests") and s.get("failed") == s.get("requests"):
            out.append(f"{role} speed {level}: every one of its {s['requests']} requests failed")
    return out
