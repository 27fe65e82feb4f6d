"""The memory probe: checkpoint, weights, KV-cache capacity and the engine processes' peak
(quantkit/evaluate/memory.py), read while the engine still runs."""

from __future__ import annotations

import httpx

from quantkit.engine.prom import kv_capacity_tokens
from quantkit.evaluate.memory import memory_figures
from quantkit.evaluate.probes.base import Probe, ProbeResult, RunContext, Served, Side


def engine_bytes(mem: dict) -> float | None:
    """The memory the engine held, measured (not computed from the checkpoint), which the default memory gate
    reads: peak GPU memory on a GPU; on a CPU the kernel's high-water mark of each serving process, summed
    (every peak counted, none missed between samples, and no helper process of the start that has exited:
    sampled PSS peaks moved by +-3% between runs of the same artifact, by what the sampling caught);
    the sampled PSS peak only where the kernel gave no high-water mark."""
    for key in ("peak_gpu_bytes", "peak_hwm_bytes", "peak_pss_bytes"):
        if mem.get(key) is not None:
            return mem[key]
    return None


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
        out = {"memory.engine_bytes": engine_bytes(mem)}
        for name in ("checkpoint_bytes", "weight_bytes", "kv_cache_tokens", "peak_rss_bytes", "peak_pss_bytes",
                     "peak_hwm_bytes"):
            out[f"memory.{name}"] = mem.get(name)
        if mem.get("peak_gpu_bytes") is not None:
            out["memory.peak_gpu_bytes"] = mem.get("peak_gpu_bytes")
            out["memory.gpu_util_mean"] = mem.get("gpu_util_mean")
        return out
