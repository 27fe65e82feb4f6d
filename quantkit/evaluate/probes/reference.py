"""The reference probe: the engine-free perplexity of the same windows (quantkit/evaluate/reference.py),
measured in this process while the engine boots."""

from __future__ import annotations

from quantkit.evaluate.probes.base import Probe, ProbeResult, RunContext, Served, Side, section_failure
from quantkit.evaluate.reference import engine_vs_reference, reference_perplexity
from quantkit.evaluate.suite import resolve_file


class ReferenceProbe(Probe):
    name = "reference"
    on_engine = False

    def wanted(self, ctx: RunContext, side: Side) -> bool:
        return bool(ctx.spec.reference) and side.model_dir is not None

    def run(self, ctx: RunContext, side: Side, served: Served | None) -> ProbeResult:
        spec = ctx.spec
        ctx.say(side, "reference perplexity (transformers, float32, the same windows)")
        try:
            out = reference_perplexity(side.model_dir, [resolve_file(f) for f in spec.perplexity_files], ctx.tokenizer,
                                       spec.perplexity_window, spec.perplexity_max_tokens)
        except (OSError, ValueError, RuntimeError, ImportError) as exc:  # never lose the engine's figures to it
            ctx.say(side, f"reference perplexity unavailable: {exc}")
            return ProbeResult({"error": f"{type(exc).__name__}: {exc}"[:500]})
        if "skipped" in out:
            ctx.say(side, f"reference perplexity skipped: {out['skipped']}")
        else:
            ctx.say(side, f"reference perplexity {out['perplexity']:.3f} ({out['seconds']:.0f} s)")
        return ProbeResult(out)

    def failures(self, side: dict, suite: dict) -> list[tuple[str, str]]:
        # "skipped" (a model too large for this machine's memory) is a decision the report states, not a failure
        if not (suite.get("reference") and side.get("model_dir") and "reference" in side):
            return []
        why = section_failure(side.get("reference"))
        return [("reference", why)] if why else []

    def values(self, side: dict) -> dict:
        ref = side.get("reference")
        if not isinstance(ref, dict):
            return {}
        engine = (side.get("quality") or {}).get("perplexity")
        return {"quality.reference_perplexity": ref.get("perplexity"),
                "quality.engine_vs_reference": engine_vs_reference(engine, ref.get("perplexity"))}
