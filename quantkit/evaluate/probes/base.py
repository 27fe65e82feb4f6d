"""What every probe gets and gives: the run context of one eval, one side (a model under measurement), what a
served side offers a probe, and the probe protocol itself (quantkit/evaluate/probes/__init__.py lists them)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass
class RunContext:
    """One eval's fixed inputs, shared by every side and probe (replaces the long parameter lists)."""

    spec: Any  # quantkit.recipe.EvalSpec
    output: Path
    tokenizer: Any
    tok_dir: Path | None
    items: list = field(default_factory=list)  # the measured speed requests (quantkit/evaluate/speed.py)
    warmup: list = field(default_factory=list)
    served_model: str | None = None
    manifest: dict | None = None  # the artifact's, when the candidate is one
    progress: Callable[[str], None] = print
    baseline: Side | None = None  # once measured: what the candidate is compared with

    def say(self, side: Side, msg: str) -> None:
        self.progress(f"[{side.role}] {msg}")


class Side:
    """One model's measurements (baseline, candidate or a serving variant); `data` is its raw/<role>.json."""

    def __init__(self, role: str, model_dir: Path | None, url: str | None, probes: tuple = (),
                 extra_args: dict | None = None) -> None:
        self.role, self.model_dir, self.url = role, model_dir, url
        self.probes, self.extra_args = probes, dict(extra_args or {})
        self.data: dict = {"role": role, "model_dir": str(model_dir) if model_dir else None, "url": url}
        self.quality = None  # the quality probe's QualityRun, for the divergence of a later side

    @property
    def speed_only(self) -> bool:
        return all(p.serving for p in self.probes)


@dataclass
class Served:
    """A started engine: its endpoint, and the engine object (whose `monitor`, where it has one, samples
    the engine's processes)."""

    ep: Any  # quantkit.engine.Endpoint
    engine: Any


@dataclass
class ProbeResult:
    """What one probe measured on one side: its figures (kept in the side's record under the probe's name;
    an "error" entry makes the report incomplete) and how long it took."""

    figures: dict
    seconds: float = 0.0

    @property
    def error(self) -> str | None:
        return self.figures.get("error") if isinstance(self.figures, dict) else None


class Probe(ABC):
    """One measurement. `run` measures a side; `values` reads its metrics back from a side's record (also
    from a cached or carried-over one), named as in the catalogue (quantkit/evaluate/catalogue.py)."""

    name = ""
    timed = True  # its seconds go to the side's timings as <name>_s
    on_engine = True  # False: measured without the server (the reference, while the engine boots)
    serving = False  # True: a serving variant measures it too

    def wanted(self, ctx: RunContext, side: Side) -> bool:
        return True

    @abstractmethod
    def run(self, ctx: RunContext, side: Side, served: Served | None) -> ProbeResult:
        """Measure `side` (on `served`, or None for a probe off the engine)."""

    @abstractmethod
    def values(self, side: dict) -> dict[str, Any]:
        """{metric name: value} from a side's record."""

    def failures(self, side: dict, suite: dict) -> list[tuple[str, str]]:
        """[(phase, why)] for what of this probe failed in a side's record, where the suite asked for it; any
        makes the report incomplete (quantkit/evaluate/phases.py)."""
        return []


def section_failure(section) -> str | None:
    """Why a probe's section of a side's record is a failure: absent, or an "error" entry; None if it is not."""
    if section is None:
        return "did not run"
    if isinstance(section, dict) and "error" in section:
        return str(section["error"])[:300]
    return None
