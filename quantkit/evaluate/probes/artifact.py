"""The artifact probe: is everything the plan meant to quantize quantized in the export, and finite
(quantkit/export/coverage.py)? The candidate's export only; no engine."""

from __future__ import annotations

from quantkit.evaluate.probes.base import Probe, ProbeResult, RunContext, Served, Side


class ArtifactProbe(Probe):
    name = "artifact"
    on_engine = False
    timed = False

    def wanted(self, ctx: RunContext, side: Side) -> bool:
        return side.role == "candidate" and side.model_dir is not None and ctx.manifest is not None

    def run(self, ctx: RunContext, side: Side, served: Served | None) -> ProbeResult:
        from quantkit.export.coverage import export_coverage

        return ProbeResult(export_coverage(side.model_dir, ctx.manifest))

    def values(self, side: dict) -> dict:
        art = side.get("artifact") or {}
        return {f"artifact.{name}": art[name] for name in ("coverage", "nonfinite_tensors", "experts_unrecorded")
                if name in art}
