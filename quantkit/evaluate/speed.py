"""Serving speed: a seeded workload through the streaming API at several load levels.

The workload is built once per eval from the suite's `workload` section and the tokenizer, so the
baseline and the candidate get identical requests: prompt lengths and output lengths are drawn
uniformly from their [min, max] ranges with `random.Random(seed)`, prompts are slices of a token
stream (the held-out text, repeated as needed) sent as token ids, and outputs are forced to their
drawn length (`ignore_eos`, `min_tokens`). Levels:

- `c<N>`: closed loop, N requests in flight at all times (normal vs peak concurrency).
- `r<R>`: open loop, Poisson arrivals at R requests/s (seeded), no cap on requests in flight.

The first level starts with `warmup_requests` unmeasured requests (an engine that has just served the
eval's chat checks, generation at concurrency 16, is warm already and gets none: quantkit/evaluate/run.py);
each summary records how many preceded it (`warmup_requests`). Every level empties vLLM's prefix cache
(`POST /reset_prefix_cache`, served because the launcher sets VLLM_SERVER_DEV_MODE=1; an external
server without it keeps its cache, recorded as `prefix_cache_reset: false`), then sends all `num_requests` while a
`MetricsSampler` scrapes /metrics. Percentiles use linear interpolation between order statistics
(numpy's default "linear" method).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from quantkit.engine.client import RequestRecord, stream_completion
from quantkit.engine.prom import MetricsSampler

PCTS = (50, 90, 99)


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: tuple[int, ...]
    output_tokens: int


def build_workload(token_stream: list[int], num_requests: int, prompt_range: tuple[int, int],
                   output_range: tuple[int, int], seed: int) -> list[WorkItem]:
    """Seeded requests; prompts are consecutive slices of `token_stream` (wrapped around)."""
    if not token_stream:
        raise ValueError("empty token stream for building prompts")
    rng = random.Random(seed)
    items, cursor = [], 0
    n = len(token_stream)
    for _ in range(num_requests):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        ids = [token_stream[(cursor + i) % n] for i in range(plen)]
        cursor = (cursor + plen) % n
        items.append(WorkItem(tuple(ids), olen))
    return items


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy method='linear'); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_level(records: list[RequestRecord], wall_s: float) -> dict:
    """Latency percentiles (ms), throughput and failures of one level's measured requests."""
    ok = [r for r in records if r.ok]
    out: dict = {"requests": len(records), "failed": len(records) - len(ok), "wall_s": wall_s}
    series = {
        "ttft_ms": [1000 * r.ttft_s for r in ok],
        "tpot_ms": [1000 * r.tpot_s for r in ok if r.tpot_s is not None],
        "itl_ms": [1000 * x for r in ok for x in r.itl_s],
        "e2e_ms": [1000 * r.e2e_s for r in ok],
    }
    for name, vals in series.items():
        for p in PCTS:
            out[f"{name}_p{p}"] = percentile(vals, p)
        out[f"{name}_mean"] = sum(vals) / len(vals) if vals else None
    out_tokens = sum(r.output_tokens for r in ok)
    out["output_tokens"] = out_tokens
    out["prompt_tokens"] = sum(r.prompt_tokens for r in ok)
    out["output_tok_s"] = out_tokens / wall_s if wall_s > 0 else None
    out["requests_s"] = len(ok) / wall_s if wall_s > 0 else None
    out["short_outputs"] = sum(1 for r in ok if r.output_tokens < r.max_tokens)
    return out


async def _closed_loop(client, ep, items, concurrency, temperature) -> list[RequestRecord]:
    queue: asyncio.Queue = asyncio.Queue()
    for i, it in enumerate(items):
        queue.put_nowait((i, it))
    results: list[RequestRecord | None] = [None] * len(items)

    async def worker():
        while True:
            try:
                i, it = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results[i] = await stream_completion(client, ep.base_url, ep.model, list(it.prompt_ids),
                                                 it.output_tokens, temperature)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))
    return results  # type: ignore[return-value]


async def _open_loop(client, ep, items, rate, temperature, seed) -> list[RequestRecord]:
    rng = random.Random(seed + 1)
    tasks = []
    for it in items:
        tasks.append(asyncio.create_task(stream_completion(client, ep.base_url, ep.model, list(it.prompt_ids),
                                                           it.output_tokens, temperature)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def _run_level(ep, items, warmup, level: tuple[str, float], temperature, seed) -> dict:
    kind, value = level
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        if warmup:  # not measured; the first level only (run_speed)
            await _closed_loop(client, ep, warmup, max(1, int(value)) if kind == "c" else 2, temperature)
        reset = await _reset_prefix_cache(client, ep.base_url)
        async with MetricsSampler(client, ep.base_url) as sampler:
            t0 = time.perf_counter()
            if kind == "c":
                records = await _closed_loop(client, ep, items, int(value), temperature)
            else:
                records = await _open_loop(client, ep, items, value, temperature, seed)
            wall = time.perf_counter() - t0
    summary = summarize_level(records, wall)
    summary["prefix_cache_reset"] = reset
    summary["warmup_requests"] = len(warmup)
    summary["engine_metrics"] = sampler.summary()
    summary["records"] = [r.to_json() for r in records]
    return summary


async def _reset_prefix_cache(client: httpx.AsyncClient, base_url: str) -> bool:
    """Empty vLLM's prefix cache (dev-mode endpoint) so every level prefills its prompts for real."""
    try:
        r = await client.post(f"{base_url}/reset_prefix_cache", timeout=30)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def level_name(kind: str, value: float) -> str:
    return f"c{int(value)}" if kind == "c" else f"r{value:g}"


def run_speed(ep, items: list[WorkItem], warmup_items: list[WorkItem], concurrency: list[int],
              rates: list[float], temperature: float, seed: int, progress=None) -> dict[str, dict]:
    """{level name: summary} for every concurrency level, then every request rate. `warmup_items` go before
    the first level only: after it the engine is warm, and each level still starts with an empty prefix cache."""
    levels = [("c", float(c)) for c in concurrency] + [("r", float(r)) for r in rates]
    out = {}
    for i, (kind, value) in enumerate(levels):
        name = level_name(kind, value)
        if progress:
            progress(f"speed {name}: {len(items)} requests")
        out[name] = asyncio.run(_run_level(ep, items, warmup_items if i == 0 else [], (kind, value), temperature,
                                           seed))
    return out
