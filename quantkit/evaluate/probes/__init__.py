"""Eval probes: each measures one thing on one side and reads its metrics back (quantkit/evaluate/probes/base.py
has the protocol). A full side runs FULL; a serving variant is the same run with SERVING only.

Files: quality (the engine's perplexity and divergence), reference (engine-free perplexity), tasks (lm-eval),
chat (tool-call, safety and generation checks), speed, memory, artifact (export coverage of the candidate).
"""

from __future__ import annotations

from quantkit.evaluate.probes.artifact import ArtifactProbe
from quantkit.evaluate.probes.base import Probe, ProbeResult, RunContext, Served, Side
from quantkit.evaluate.probes.chat import ChecksProbe
from quantkit.evaluate.probes.memory import MemoryProbe
from quantkit.evaluate.probes.quality import QualityProbe
from quantkit.evaluate.probes.reference import ReferenceProbe
from quantkit.evaluate.probes.speed import SpeedProbe
from quantkit.evaluate.probes.tasks import TasksProbe

QUALITY, REFERENCE, TASKS, CHECKS = QualityProbe(), ReferenceProbe(), TasksProbe(), ChecksProbe()
SPEED, MEMORY, ARTIFACT = SpeedProbe(), MemoryProbe(), ArtifactProbe()

FULL = (REFERENCE, QUALITY, TASKS, CHECKS, SPEED, MEMORY)  # in the order they run on a side
SERVING = tuple(p for p in FULL if p.serving)
PROBES = (QUALITY, REFERENCE, TASKS, CHECKS, SPEED, MEMORY, ARTIFACT)  # every probe, in report order

__all__ = ["ARTIFACT", "CHECKS", "FULL", "MEMORY", "PROBES", "Probe", "ProbeResult", "QUALITY", "REFERENCE",
           "RunContext", "SERVING", "SPEED", "Served", "Side", "TASKS"]
