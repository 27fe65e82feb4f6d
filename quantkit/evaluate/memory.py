"""Memory figures of one served model: checkpoint, weights, KV-cache capacity, engine process peak.

- checkpoint_bytes: the model folder's *.safetensors files on disk.
- weight_bytes: what the engine reports ("Model loading took X GiB", GPU runners). vLLM's CPU runner
  does not report it, so there it is computed from the checkpoint's tensor headers: every tensor's
  element count x its element size, with floating-point tensors counted at the engine's compute
  dtype (a bf16 checkpoint served in float32 holds twice its file size) and integer tensors as
  stored. `weight_bytes_source` says which one a report holds.
- kv_cache_tokens: the engine's own figure (log line, or `vllm:cache_config_info` in /metrics).
- peak_rss_bytes / peak_pss_bytes: the engine's process tree, sampled; peak_hwm_bytes: the serving processes'
  high-water marks, summed (quantkit.engine.procmon; what the default memory gate reads on a CPU);
  peak_gpu_bytes / gpu_util_*: the GPUs (nvidia-smi) over the engine's lifetime, None without a GPU.
"""

from __future__ import annotations

from pathlib import Path

_TORCH_SIZES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def tensor_bytes(model_dir: Path, compute_dtype: str | None = None) -> int:
    """Sum over tensors of numel x element size; 16/32/64-bit float tensors at `compute_dtype` when given
    (read from the headers through the one safetensors reader, quantkit.model.checkpoint.LazyCheckpoint)."""
    from quantkit.export.shards import stored_bytes
    from quantkit.model.checkpoint import LazyCheckpoint

    return stored_bytes(LazyCheckpoint(Path(model_dir)), float_size=_TORCH_SIZES.get(compute_dtype or ""))


def memory_figures(model_dir: Path | None, engine_info: dict, kv_from_metrics: int | None,
                   proc: dict | None) -> dict:
    out: dict = {"checkpoint_bytes": checkpoint_bytes(model_dir) if model_dir else None}
    if engine_info.get("weight_bytes"):
        out["weight_bytes"] = engine_info["weight_bytes"]
        out["weight_bytes_source"] = "engine log"
    elif model_dir is not None:
        out["weight_bytes"] = tensor_bytes(model_dir, engine_info.get("dtype"))
        out["weight_bytes_source"] = f"checkpoint tensors at engine dtype {engine_info.get('dtype', 'as stored')}"
    else:
        out["weight_bytes"] = None
    out["kv_cache_tokens"] = engine_info.get("kv_cache_tokens") or kv_from_metrics
    out["peak_rss_bytes"] = (proc or {}).get("peak_rss_bytes")
    out["peak_pss_bytes"] = (proc or {}).get("peak_pss_bytes")
    out["peak_hwm_bytes"] = (proc or {}).get("peak_hwm_bytes")
    for k in ("peak_gpu_bytes", "gpu_util_max", "gpu_util_mean"):
        out[k] = (proc or {}).get(k)
    return out
