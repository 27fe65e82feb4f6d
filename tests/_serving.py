"""Serving checks shared by the slow tests: does a quantized export, served in vLLM, still follow the float
model? Teacher-forced top-1 agreement with the float model's own greedy continuations is robust where a
free-running comparison would diverge for good after one different token."""

from __future__ import annotations

from pathlib import Path

import torch

PROMPTS = ["The three primary colours are", "To boil an egg, first", "def fibonacci(n):\n    "]
# Teacher-forced top-1 agreement with the float model's greedy continuations, over 3 prompts x 24 tokens.
# Measured on a 2-core AMX CPU (vLLM bf16): W4A16 GPTQ g64 0.722, W8A8 RTN 0.833, SmoothQuant mixed W8A8
# 0.944, W8A8 QAT (3 steps) 0.847. A broken export or
# mismatched scales land near 0; the floors leave room for another machine's kernels and rounding.
AGREEMENT_FLOOR = {"W4A16": 0.6, "W8A8": 0.7}


def float_continuations(demo: Path) -> list[tuple[list[int], int]]:
    """The float model's greedy continuations (transformers, fp32): (prompt + generated token ids, prompt length)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo)
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=24, do_sample=False)
        out.append((gen[0].tolist(), ids.shape[1]))
    return out


def serve_and_agree(model_dir: Path, run_dir: Path, refs: list[tuple[list[int], int]]) -> tuple[str, float]:
    """Serve `model_dir` in vLLM: its greedy text for the first prompt, and its teacher-forced top-1 agreement
    with the float model's greedy continuations (each reference token position: does the served model rank
    the float model's choice first?). Robust where free-running outputs diverge after one different token."""
    import httpx

    from quantkit.engine.client import prompt_logprobs
    from quantkit.engine.vllm_server import VLLMServer
    from quantkit.evaluate.quality import top1

    with VLLMServer(model_dir, run_dir, "m", max_model_len=512) as ep:
        r = httpx.post(f"{ep.base_url}/v1/completions", timeout=300,
                       json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0})
        r.raise_for_status()
        text = r.json()["choices"][0]["text"]
        agree = total = 0
        with httpx.Client(timeout=300) as client:
            for ids, n_prompt in refs:
                pos = prompt_logprobs(client, ep.base_url, "m", ids, 5)
                for i in range(n_prompt, len(ids)):  # position i predicts ids[i]: a generated token
                    agree += top1(pos[i]) == ids[i]
                    total += 1
    return text, agree / total
