"""The quality probe: perplexity of the engine's own log-probabilities over the suite's windows, and the
divergence (KL, top-1 agreement) from the baseline's (the math: quantkit/evaluate/quality.py)."""

from __future__ import annotations

import httpx

from quantkit.engine.client import ServerError, prompt_logprobs
import quantkit.evaluate.quality as Q
from quantkit.evaluate.catalogue import dig
from quantkit.evaluate.probes.base import Probe, ProbeResult, RunContext, Served, Side, section_failure
from quantkit.evaluate.suite import resolve_file


class QualityProbe(Probe):
    name = "quality"

    def run(self, ctx: RunContext, side: Side, served: Served | None) -> ProbeResult:
        spec, ep = ctx.spec, served.ep
        files = [resolve_file(f) for f in spec.perplexity_files]
        ctx.say(side, f"perplexity on {', '.join(f.name for f in files)}")
        try:
            with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
                run = Q.score_texts(files, ctx.tokenizer, lambda ids: prompt_logprobs(client, ep.base_url, ep.model,
                                                                                      ids, spec.logprobs_top_k),
                                    spec.perplexity_window, spec.perplexity_max_tokens)
        except (ServerError, httpx.HTTPError, RuntimeError) as exc:
            ctx.say(side, f"perplexity unavailable: {exc}")
            return ProbeResult({"error": str(exc)})
        side.quality = run
        out = {"perplexity": Q.perplexity(run.actual_logprobs()), "tokens": len(run.actual), "per_file": run.per_file,
               "window": spec.perplexity_window, "top_k": spec.logprobs_top_k}
        sums = run.window_sums()  # per window, for the bootstrap intervals (quantkit/evaluate/confidence.py)
        if sums is not None:
            out["windows"] = sums
        base = ctx.baseline.quality if ctx.baseline is not None else None
        if side.role == "baseline":
            out["divergence"] = Q.divergence(run, run, spec.logprobs_top_k)  # itself: KL 0, agreement 1
        elif base is not None:
            out["divergence"] = Q.divergence(base, run, spec.logprobs_top_k)
        return ProbeResult(out)

    def failures(self, side: dict, suite: dict) -> list[tuple[str, str]]:
        why = section_failure(side.get("quality"))  # the engine's perplexity pass raised, or did not run
        return [("quality", why)] if why else []

    def values(self, side: dict) -> dict:
        q = side.get("quality") or {}
        return {"quality.perplexity": q.get("perplexity"), "quality.kl_mean": dig(q, "divergence", "kl_mean"),
                "quality.kl_p99": dig(q, "divergence", "kl_p99"),
                "quality.top1_agreement": dig(q, "divergence", "top1_agreement")}
