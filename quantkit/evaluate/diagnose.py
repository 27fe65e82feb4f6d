""""Where the wait is": read one model's speed figures the way an engineer would, in a few sentences.

Rules (each only when the figures it needs exist; thresholds are rules of thumb, stated in the text):
- First token: split TTFT p50 into queue time and prefill time (engine histograms over the run).
  Queue > half of TTFT -> requests wait for a slot (scheduling / concurrency); otherwise prefill
  dominates, reported as prompt tokens per second of prefill, i.e. TTFT grows with prompt length.
- Tokens: TPOT at the lowest vs the highest concurrency (batching costs per-token pace) and ITL p99
  against p50 (a long tail means decode steps share the batch with prefills of new requests).
- Memory: KV-cache usage peak and preemptions -> whether cache pressure limits the batch, and how
  the engine's memory splits into weights and KV cache.
- Throughput: output tok/s scaling from the lowest to the highest concurrency; little scaling with
  KV room left and nothing waiting -> compute-bound; waiting requests with KV room -> scheduler
  limits (max_num_seqs, max_num_batched_tokens).
"""

from __future__ import annotations


def _lvl_key(name: str) -> tuple[int, float]:
    return (0 if name.startswith("c") else 1, float(name[1:]))


def _fmt(x: float | None, unit: str = "", nd: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{nd}f}{unit}"


def where_the_wait_is(side: dict, label: str, kv_cache_gib: float | None = None) -> list[str]:
    speed = side.get("speed") or {}
    closed = sorted((k for k in speed if k.startswith("c")), key=_lvl_key)
    if not closed:
        return [f"{label}: no closed-loop speed levels measured."]
    kv_max = max(((s.get("engine_metrics") or {}).get("kv_cache_usage_perc_max") or 0.0) for s in speed.values())
    out = [_first_token(speed, closed), _tokens(speed, closed), _memory(side, kv_max, kv_cache_gib),
           _throughput(speed, closed, kv_max)]
    return [x for x in out if x]


def _first_token(speed: dict, closed: list[str]) -> str | None:
    hi = speed[closed[-1]]
    em = hi.get("engine_metrics") or {}
    ttft, queue, prefill = hi.get("ttft_ms_p50"), em.get("request_queue_time_mean_ms"), em.get("request_prefill_time_mean_ms")
    if ttft is None or queue is None or prefill is None:
        return None
    ptoks = hi["prompt_tokens"] / max(1, hi["requests"] - hi["failed"])
    rate = ptoks / (prefill / 1000) if prefill else None
    if queue > 0.5 * ttft:
        return (f"First token ({closed[-1]}): TTFT p50 {_fmt(ttft, ' ms')} is mostly queueing "
                f"({_fmt(queue, ' ms')} mean queue time): requests wait for a slot, so more concurrency "
                f"than the engine schedules at once only adds wait; prefill takes {_fmt(prefill, ' ms')}.")
    return (f"First token ({closed[-1]}): TTFT p50 {_fmt(ttft, ' ms')} is prefill, not queueing "
            f"(queue {_fmt(queue, ' ms', 1)}, prefill {_fmt(prefill, ' ms')} for ~{ptoks:.0f} prompt tokens, "
            f"{_fmt(rate, ' tok/s')}): it grows with prompt length and with prefills sharing the step.")


def _tokens(speed: dict, closed: list[str]) -> str | None:
    lo, hi = speed[closed[0]], speed[closed[-1]]
    t_lo, t_hi = lo.get("tpot_ms_p50"), hi.get("tpot_ms_p50")
    i50, i99 = hi.get("itl_ms_p50"), hi.get("itl_ms_p99")
    if not (t_lo and t_hi):
        return None
    text = (f"Tokens: TPOT p50 {_fmt(t_lo, ' ms', 1)} at {closed[0]} and {_fmt(t_hi, ' ms', 1)} at {closed[-1]} "
            f"({t_hi / t_lo:.2f}x): ")
    text += ("decode pace barely changes with the batch, so decode is not saturated."
             if t_hi / t_lo < 1.3 else "each step gets slower as more sequences share it (decode is compute-bound here).")
    if i50 and i99 and i99 > 3 * i50:
        text += (f" ITL p99 {_fmt(i99, ' ms')} vs p50 {_fmt(i50, ' ms')}: the tail comes from steps that also "
                 "prefill newly arrived prompts (batch mix).")
    return text


def _memory(side: dict, kv_max: float, kv_cache_gib: float | None) -> str:
    speed = side.get("speed") or {}
    pre = sum(((s.get("engine_metrics") or {}).get("num_preemptions") or 0.0) for s in speed.values())
    mem = side.get("memory") or {}
    wb, kvt = mem.get("weight_bytes"), mem.get("kv_cache_tokens")
    split = ""
    if wb and kv_cache_gib:
        split = f" Engine memory: weights {wb / 2**20:,.0f} MiB, KV cache {kv_cache_gib * 1024:,.0f} MiB ({_fmt(kvt)} tokens)."
    if kv_max >= 0.9 or pre > 0:
        return (f"Memory: the KV cache is full (peak use {kv_max:.0%}, {pre:.0f} preemptions): the batch is limited by "
                f"cache space; a smaller KV dtype, shorter max_model_len or more cache memory helps more than "
                f"smaller weights.{split}")
    return f"Memory: KV-cache use peaked at {kv_max:.1%} with no preemptions: memory does not limit this load.{split}"


def _throughput(speed: dict, closed: list[str], kv_max: float) -> str | None:
    lo, hi = speed[closed[0]], speed[closed[-1]]
    em = hi.get("engine_metrics") or {}
    x_lo, x_hi = lo.get("output_tok_s"), hi.get("output_tok_s")
    wait_max = em.get("num_requests_waiting_max") or 0.0
    run_max = em.get("num_requests_running_max")
    if not (x_lo and x_hi and len(closed) > 1):
        return None
    c_lo, c_hi = float(closed[0][1:]), float(closed[-1][1:])
    scale = x_hi / x_lo
    text = (f"Throughput: {_fmt(x_lo, ' tok/s', 1)} at {closed[0]} -> {_fmt(x_hi, ' tok/s', 1)} at {closed[-1]} "
            f"({scale:.2f}x for {c_hi / c_lo:.0f}x the concurrency). ")
    if wait_max > 0 and kv_max < 0.9:
        return text + (f"Up to {wait_max:.0f} requests waited while the KV cache had room: the scheduler limits the "
                       "batch (max_num_seqs / max_num_batched_tokens).")
    if scale < 0.5 * c_hi / c_lo:
        return text + (f"With KV room left and {_fmt(run_max)} running at most, the engine is compute-bound: "
                       "the hardware, not scheduling, sets the ceiling.")
    return text + "Batching pays off; a higher concurrency level would show where it stops."
