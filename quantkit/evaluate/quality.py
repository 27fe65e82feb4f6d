"""Perplexity and divergence from the engine's prompt log-probabilities.

Text is tokenized once with the baseline's tokenizer (an artifact carries the same tokenizer) and cut
into non-overlapping windows of `window` tokens; each window is sent as a token-id prompt, so baseline
and candidate score exactly the same positions. Position 0 of each window is not scored (nothing
predicts it), so a window of n tokens gives n - 1 predictions. No BOS is added.

- Perplexity: exp(-mean log p(actual token)) over all scored positions of all files.
- Top-1 agreement: share of positions where baseline and candidate rank the same token first.
- KL(P_baseline || Q_candidate), per position, from the top-k lists only (vLLM returns at most k=20).
  Approximation: both distributions are coarsened to S ∪ {rest}, S = the baseline's top-k tokens:
      KL ≈ Σ_{t∈S} p_t log(p_t / q_t) + p_rest log(p_rest / q_rest),  p_rest = 1 - Σ_S p, q_rest = 1 - Σ_S q.
  With exact q_t this is a lower bound of the full KL (data-processing inequality). A token of S that
  the candidate did not return has q_t ≤ the candidate's k-th probability; it is imputed as
  min(q_kth, r / (m + 1)) with r = the candidate's mass outside its own list and m = the number of
  such tokens, which keeps q_rest > 0. Reported: mean over positions (and p99).

Per window, for the confidence intervals (quantkit/evaluate/confidence.py bootstraps over windows):
`QualityRun.window_positions` holds each window's number of scored positions, in scoring order across
files; `window_sums` gives {"logprob_sum": [...], "positions": [...]} (one entry per window) and
`divergence` adds {"kl_sum", "top1_agree", "positions"} per window under "windows". Baseline and
candidate score the same windows, so these lists align by index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

Position = dict[int, tuple[float, int]]  # token id -> (logprob, 1-based rank)
_EPS = 1e-12


def windows(token_ids: list[int], window: int, max_tokens: int | None = None) -> list[list[int]]:
    """Non-overlapping windows (the last may be shorter; windows under 2 tokens are dropped)."""
    ids = token_ids[:max_tokens] if max_tokens else token_ids
    out = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in out if len(w) >= 2]


def perplexity(logprobs: list[float]) -> float:
    """exp of the mean negative log-likelihood (natural log)."""
    if not logprobs:
        raise ValueError("no scored tokens")
    return math.exp(-sum(logprobs) / len(logprobs))


def top1(pos: Position) -> int:
    """The token ranked first (rank 1; ties broken by the highest logprob)."""
    return min(pos.items(), key=lambda kv: (kv[1][1] if kv[1][1] > 0 else 10**9, -kv[1][0]))[0]


def topk_set(pos: Position, k: int) -> dict[int, float]:
    """{token: prob} of the tokens with rank <= k (the actual-token extra entry is left out if rank > k)."""
    ranked = sorted(pos.items(), key=lambda kv: -kv[1][0])
    return {t: math.exp(lp) for t, (lp, rank) in ranked if 0 < rank <= k} or \
        {t: math.exp(lp) for t, (lp, _) in ranked[:k]}


def kl_topk(p_pos: Position, q_pos: Position, k: int) -> float:
    """Approximate KL(P || Q) in nats from top-k lists (see the module docstring for the approximation)."""
    p = topk_set(p_pos, k)
    q_top = topk_set(q_pos, k)
    q_known = {t: math.exp(lp) for t, (lp, _) in q_pos.items()}  # top-k plus the actual token
    q_kth = min(q_top.values())
    r = max(1.0 - sum(q_top.values()), _EPS)  # candidate mass outside its own top-k
    missing = [t for t in p if t not in q_known]
    q_missing = min(q_kth, r / (len(missing) + 1))
    kl = 0.0
    q_sum = 0.0
    for t, pt in p.items():
        qt = q_known.get(t, q_missing)
        q_sum += qt
        kl += pt * math.log(pt / max(qt, _EPS))
    p_rest = max(1.0 - sum(p.values()), 0.0)
    q_rest = max(1.0 - q_sum, _EPS)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


@dataclass
class QualityRun:
    """Scored positions of one model on the perplexity texts. `positions[i]` aligns with `actual[i]`."""

    actual: list[int] = field(default_factory=list)
    positions: list[Position] = field(default_factory=list)
    per_file: dict[str, dict] = field(default_factory=dict)
    window_positions: list[int] = field(default_factory=list)  # scored positions per window ([] = not recorded)

    def actual_logprobs(self) -> list[float]:
        return [pos[t][0] for pos, t in zip(self.positions, self.actual)]

    def window_sums(self) -> dict | None:
        """{"logprob_sum": [...], "positions": [...]} per window, or None where windows were not recorded."""
        sums = _per_window(self.actual_logprobs(), self.window_positions)
        return None if sums is None else {"logprob_sum": sums, "positions": list(self.window_positions)}


def _per_window(values: list[float], sizes: list[int]) -> list[float] | None:
    """Sum `values` over consecutive windows of `sizes`; None if the sizes do not cover the values exactly."""
    if not sizes or sum(sizes) != len(values):
        return None
    out, i = [], 0
    for n in sizes:
        out.append(math.fsum(values[i:i + n]))
        i += n
    return out


def restore_windows(run: QualityRun, files: list[Path], tokenizer, window: int, max_tokens: int | None) -> bool:
    """Give a run scored before windows were recorded (an older baseline-cache entry) its window layout,
    recomputed from the same files and settings; only if the scored tokens match exactly. True if set."""
    if run.window_positions:
        return True
    scored = [w[1:] for f in files
              for w in windows(tokenizer(f.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"],
                               window, max_tokens)]
    if [t for w in scored for t in w] != run.actual:
        return False
    run.window_positions = [len(w) for w in scored]
    return True


def score_texts(files: list[Path], tokenizer, query, window: int, max_tokens: int | None) -> QualityRun:
    """Tokenize each file, send its windows through `query(ids) -> list[Position | None]`."""
    run = QualityRun()
    for f in files:
        ids = tokenizer(f.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        n0 = len(run.actual)
        for w in windows(ids, window, max_tokens):
            pos = query(w)
            if len(pos) != len(w):
                raise RuntimeError(f"the server returned {len(pos)} prompt positions for {len(w)} tokens")
            for i in range(1, len(w)):  # position i predicts token w[i]
                if pos[i] is None or w[i] not in pos[i]:
                    raise RuntimeError(f"position {i}: the actual token's logprob is missing from the response")
                run.actual.append(w[i])
                run.positions.append(pos[i])
            run.window_positions.append(len(w) - 1)
        lps = [p[t][0] for p, t in zip(run.positions[n0:], run.actual[n0:])]
        run.per_file[f.name] = {"tokens": len(lps), "perplexity": perplexity(lps)}
    return run


def divergence(base: QualityRun, cand: QualityRun, k: int) -> dict:
    """Top-1 agreement and approximate KL of the candidate against the baseline on the same positions."""
    if base.actual != cand.actual:
        raise ValueError("baseline and candidate were scored on different tokens; cannot compare")
    n = len(base.actual)
    if n == 0:
        raise ValueError("no scored positions")
    agrees = [float(top1(b) == top1(c)) for b, c in zip(base.positions, cand.positions)]
    kl_pos = [kl_topk(b, c, k) for b, c in zip(base.positions, cand.positions)]
    agree = int(sum(agrees))
    kls = sorted(kl_pos)
    out = {"top1_agreement": agree / n, "kl_mean": sum(kls) / n, "kl_p99": kls[min(n - 1, int(0.99 * n))],
           "positions": n, "top_k": k}
    # per window, for the bootstrap; either side's window layout will do (same tokens), a cached baseline
    # from before windows were recorded has none
    sizes = cand.window_positions or base.window_positions
    if base.window_positions and cand.window_positions and base.window_positions != cand.window_positions:
        sizes = []
    kl_w, agree_w = _per_window(kl_pos, sizes), _per_window(agrees, sizes)
    if kl_w is not None and agree_w is not None:
        out["windows"] = {"kl_sum": kl_w, "top1_agree": [int(round(a)) for a in agree_w], "positions": list(sizes)}
    return out
