"""Write quantized weights as a compressed-tensors checkpoint (the format vLLM loads natively).

The packing itself (int8 codes, int4 packed into int32, fp8 casts, zero-point packing) is done by the
`compressed-tensors` library's own compressors, module by module, so the checkpoint is exactly what
its readers expect. quantkit decides the codes (scales, zero points, dequantized weight); the
compressor re-derives the same codes from them, which is exact because the scales were rounded to
their storage dtype before the codes were chosen.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.model_compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from safetensors.torch import save_file


def compress_linear(prefix: str, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                    g_idx: torch.Tensor | None, scheme: QuantizationScheme,
                    scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Compressed tensors of one Linear, named `<prefix>.weight_packed` etc."""
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    sd = {"weight": weight.float(), "weight_scale": scale.to(scale_dtype)}  # scale [out, n_groups]
    if zero_point is not None:
        sd["weight_zero_point"] = zero_point.to(torch.int8)
    if g_idx is not None:
        sd["weight_g_idx"] = g_idx.to(torch.int32)
    out = compressor.compress(sd, scheme)
    return {f"{prefix}.{k}": v.detach().cpu().contiguous().clone() for k, v in out.items()}  # own storage each


def quantization_config(schemes: dict[str, QuantizationScheme], ignore: list[str]) -> ModelCompressor:
    formats = sorted({s.format for s in schemes.values()})
    qc = QuantizationConfig(config_groups=schemes, format=formats[0] if len(formats) == 1 else "mixed-precision",
                            quantization_status="compressed", ignore=ignore)
    return ModelCompressor(quantization_config=qc)


def write_config(src_config: Path, out_dir: Path, compressor: ModelCompressor) -> None:
    cfg = json.loads(src_config.read_text())
    cfg.pop("quantization_config", None)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        cfg.setdefault("rope_theta", theta)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    compressor.update_config(str(out_dir))


def write_shards(out_dir: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int) -> list[str]:
    """Stream (name, tensor) pairs into safetensors shards of at most `max_shard_bytes` (one tensor may exceed)."""
    tmp_names: list[Path] = []
    weight_map_tmp: dict[str, int] = {}
    chunk: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal chunk, size
        if not chunk:
            return
        path = out_dir / f".shard-{len(tmp_names):05d}.tmp"
        save_file(chunk, str(path), metadata={"format": "pt"})
        for k in chunk:
            weight_map_tmp[k] = len(tmp_names)
        tmp_names.append(path)
        chunk, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > max_shard_bytes:
            flush()
        chunk[name] = t
        size += nbytes
    flush()

    n = len(tmp_names)
    final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, name in zip(tmp_names, final):
        os.replace(tmp, out_dir / name)
    if n > 1:
        total = sum((out_dir / f).stat().st_size for f in final)
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: final[i] for k, i in sorted(weight_map_tmp.items())}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        final.append("model.safetensors.index.json")
    return final


def iter_safetensors(paths: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for p in paths:
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                yield k, f.get_tensor(k)
