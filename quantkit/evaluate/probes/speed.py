"""The speed probe: the seeded streaming workload at every load level (quantkit/evaluate/speed.py)."""

from __future__ import annotations

from quantkit.evaluate.probes.base import Probe, ProbeResult, RunContext, Served, Side
from quantkit.evaluate.speed import PCTS, run_speed

LAT = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def concurrency_levels(speed: dict | None) -> list[str]:
    """The closed-loop levels ("c1", "c4", ...) of a side's speed figures, lowest concurrency first."""
    return sorted((k for k in (speed or {}) if k[:1] == "c" and k[1:].isdigit()), key=lambda k: int(k[1:]))


class SpeedProbe(Probe):
    name = "speed"
    serving = True

    def run(self, ctx: RunContext, side: Side, served: Served | None) -> ProbeResult:
        w, d = ctx.spec.workload, side.data
        # an engine that has just served the chat checks (generation at check_concurrency) needs no warm-up
        warm = bool(d.get("checks")) and not any("error" in v for v in d["checks"].values())
        return ProbeResult(run_speed(served.ep, ctx.items, [] if warm else ctx.warmup, w.concurrency, w.request_rates,
                                     w.temperature, w.seed, progress=lambda m: ctx.say(side, m)))

    def failures(self, side: dict, suite: dict) -> list[tuple[str, str]]:
        # single failed requests are the metric speed.failed_requests' (a default gate requires 0), not a failure
        speed = side.get("speed")
        out = [] if speed else [("speed", "no level was measured")]
        for level, s in (speed or {}).items():
            if isinstance(s, dict) and s.get("requests") and s.get("failed") == s.get("requests"):
                out.append((f"speed {level}", f"every one of its {s['requests']} requests failed"))
        return out

    def values(self, side: dict) -> dict:
        speed = side.get("speed") or {}
        out: dict = {}
        for lvl, s in speed.items():
            for m in LAT:
                for p in PCTS:
                    out[f"speed.{lvl}.{m}_p{p}"] = s.get(f"{m}_p{p}")
            out[f"speed.{lvl}.output_tok_s"] = s.get("output_tok_s")
            out[f"speed.{lvl}.requests_s"] = s.get("requests_s")
            out[f"speed.{lvl}.failed"] = float(s.get("failed", 0))
            em = s.get("engine_metrics") or {}
            out[f"speed.{lvl}.queue_ms_mean"] = em.get("request_queue_time_mean_ms")
            out[f"speed.{lvl}.kv_cache_usage_max"] = em.get("kv_cache_usage_perc_max")
            out[f"speed.{lvl}.preemptions"] = em.get("num_preemptions")
        # what the default gates read, whatever levels the suite measured: decode TPOT p50 at the lowest
        # concurrency, output throughput at the highest, failed requests over all levels
        levels = concurrency_levels(speed)
        out["speed.decode_tpot_ms_p50"] = speed[levels[0]].get("tpot_ms_p50") if levels else None
        out["speed.peak_output_tok_s"] = speed[levels[-1]].get("output_tok_s") if levels else None
        out["speed.failed_requests"] = float(sum(s.get("failed", 0) for s in speed.values())) if speed else None
        return out
