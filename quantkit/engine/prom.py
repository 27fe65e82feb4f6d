"""Sample a server's Prometheus `/metrics` during a load run and summarise what the engine felt.

vLLM v1 metric names (label sets are summed over; the `vllm:` prefix is kept):
- gauges, sampled: `vllm:kv_cache_usage_perc` (0..1, cache pressure), `vllm:num_requests_running`,
  `vllm:num_requests_waiting`
- counters, first/last difference: `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`
- histograms, difference of _sum/_count = mean over the run: `vllm:request_queue_time_seconds`,
  `vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds`
- `vllm:cache_config_info` labels `num_gpu_blocks` x `block_size` = KV-cache capacity in tokens.
Servers that are not vLLM expose other names; missing series give None.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFNa]+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
COUNTERS = ("vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
HISTOGRAMS = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: value summed over label sets} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            val = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + val
    return out


def kv_capacity_tokens(text: str) -> int | None:
    """num_gpu_blocks x block_size from `vllm:cache_config_info` (CPU blocks are reported there too)."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL.findall(line))
            try:
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            except (KeyError, ValueError):
                return None
    return None


def summarize(samples: list[dict[str, float]]) -> dict:
    """Figures for one load run from a list of parsed scrapes (first = before, last = after)."""
    if len(samples) < 2:
        return {"samples": len(samples)}
    first, last = samples[0], samples[-1]
    out: dict = {"samples": len(samples)}
    for g in GAUGES:
        vals = [s[g] for s in samples if g in s]
        short = g.split(":", 1)[1]
        out[f"{short}_max"] = max(vals) if vals else None
        out[f"{short}_mean"] = sum(vals) / len(vals) if vals else None
    for c in COUNTERS:
        short = c.split(":", 1)[1].removesuffix("_total")
        out[short] = (last[c] - first.get(c, 0.0)) if c in last else None
    for h in HISTOGRAMS:
        short = h.split(":", 1)[1].removesuffix("_seconds")
        n = last.get(h + "_count", 0.0) - first.get(h + "_count", 0.0)
        s = last.get(h + "_sum", 0.0) - first.get(h + "_sum", 0.0)
        out[f"{short}_mean_ms"] = (1000.0 * s / n) if n > 0 else None
    return out


class MetricsSampler:
    """`async with MetricsSampler(client, url) as s: ...` scrapes every interval; `s.summary()` after."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval_s: float = 0.5) -> None:
        self.client = client
        self.url = f"{base_url}/metrics"
        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self.timeline: list[tuple[float, float | None, float | None, float | None]] = []  # t, kv, run, wait
        self.available = True
        self._task: asyncio.Task | None = None
        self._t0 = 0.0

    async def scrape(self) -> None:
        try:
            r = await self.client.get(self.url, timeout=5)
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            self.available = False
            return
        s = parse_prometheus(r.text)
        self.samples.append(s)
        self.timeline.append((round(time.perf_counter() - self._t0, 3), *(s.get(g) for g in GAUGES)))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    async def __aenter__(self) -> "MetricsSampler":
        self._t0 = time.perf_counter()
        await self.scrape()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.scrape()

    def summary(self) -> dict:
        out = summarize(self.samples) if self.available else {"samples": 0}
        out["timeline"] = self.timeline
        return out
