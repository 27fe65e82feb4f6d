"""The memory probe: checkpoint, weights, KV-cache capacity and the engine processes' peak
(quantkit/evaluate/memory.py), read while the engine still runs."""

from __future__ import annotations

import httpx

from quantkit.engine.prom import kv_capacity_tokens
from quantkit.evaluate.memory import memory_figures
from quantkit.evaluate.probes.base import Probe, ProbeResult, RunContext, Served, Side


class MemoryProbe(Probe):
    name = "memory"
    timed = False
    serving = True

    def run(self, ctx: RunContext, side: Side, served: Served | None) -> ProbeResult:
        ep, engine = served.ep, served.engine
        try:
            kv_metrics = kv_capacity_tokens(httpx.get(f"{ep.base_url}/metrics", timeout=10).text)
        except httpx.HTTPError:
            kv_metrics = None
        proc = engine.monitor.snapshot() if hasattr(engine, "monitor") else None
        return ProbeResult(memory_figures(side.model_dir if not side.url else None, ep.info, kv_metrics, proc))

    def values(self, side: dict) -> dict:
        mem = side.get("memory") or {}
        # the memory the engine process held (peak GPU memory on a GPU, else the process tree's peak PSS:
        # measured, not computed from the checkpoint), which the default memory gate reads
        held = mem.get("peak_gpu_bytes") if mem.get("peak_gpu_bytes") is not None else mem.get("peak_pss_bytes")
        out = {"memory.engine_bytes": held}
        for name in ("checkpoint_bytes", "weight_bytes", "kv_cache_tokens", "peak_rss_bytes", "peak_pss_bytes"):
            out[f"memory.{name}"] = mem.get(name)
        if mem.get("peak_gpu_bytes") is not None:
            out["memory.peak_gpu_bytes"] = mem.get("peak_gpu_bytes")
            out["memory.gpu_util_mean"] = mem.get("gpu_util_mean")
        return out
