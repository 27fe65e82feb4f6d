"""Write quantized weights as a compressed-tensors checkpoint (the format vLLM loads natively).

The packing itself (int8 codes, int4 packed into int32, fp8 casts, zero-point packing) is done by the
`compressed-tensors` library's own compressors, module by module, so the checkpoint is exactly what
its readers expect. quantkit decides the codes (scales, zero points, dequantized weight); the
compressor re-derives the same codes from them, which is exact because the scales were rounded to
their storage dtype before the codes were chosen.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.model_compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme


def compress_linear(prefix: str, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                    g_idx: torch.Tensor | None, scheme: QuantizationScheme,
                    scale_dtype: torch.dtype, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Compressed tensors of one Linear, named `<prefix>.weight_packed` etc. FP4 scales go to the compressor in
    fp32 (it stores them as fp8 or E8M0 itself); NVFP4's stored group scale is scale x global_scale."""
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    fp4 = scheme.weights.type == "float" and scheme.weights.num_bits == 4
    if global_scale is not None:  # NVFP4: the fp8 value (exact: the global scale is a power of two)
        sd = {"weight": weight.float(), "weight_scale": scale.float() * global_scale.float(),
              "weight_global_scale": global_scale.float().reshape(1)}
    else:
        sd = {"weight": weight.float(), "weight_scale": scale.float() if fp4 else scale.to(scale_dtype)}
    if zero_point is not None:
        sd["weight_zero_point"] = zero_point.to(torch.int8)
    if g_idx is not None:
        sd["weight_g_idx"] = g_idx.to(torch.int32)
    out = compressor.compress(sd, scheme)
    return {f"{prefix}.{k}": v.detach().cpu().contiguous().clone() for k, v in out.items()}  # own storage each


# fields of a compressor's output that hold one entry (or packed run) per weight row: concatenated across row
# blocks; anything else must come out of every block the same (g_idx, global scale), or is the weight's shape
ROW_FIELDS = frozenset({"weight_packed", "weight", "weight_scale", "weight_zero_point"})
COMPRESS_BLOCK = 4 << 20  # weight elements per compressor call: its fp32 temporaries stay near 100 MB


def compress_by_rows(prefix: str, shape: tuple[int, int], rows_of: Callable[[slice], tuple], g_idx: torch.Tensor | None,
                     scheme: QuantizationScheme, scale_dtype: torch.dtype, global_scale: torch.Tensor | None = None,
                     block_rows: int | None = None) -> dict[str, torch.Tensor]:
    """`compress_linear` of a whole [out, in] weight, made a block of rows at a time (`rows_of(rows)` gives the
    block's dequantized weight, scale and zero point): the compressor's temporaries, several fp32 copies of what
    it is given, stay a block's (an 8B down_proj's took the export 1.2 GB above its 224 MB fp32 weight).
    Rows are compressed independently in every format (packing runs along the input; zero points pack 8 rows
    to an int32 and a block is a multiple of 64 rows), so the result is the whole weight's bit for bit
    (tests/test_quant_math.py, every scheme)."""
    out_f, in_f = shape
    step = block_rows or max(64, COMPRESS_BLOCK // max(in_f, 1) // 64 * 64)
    rows: dict[str, list[torch.Tensor]] = {}
    once: dict[str, torch.Tensor] = {}
    for r in range(0, out_f, step):
        w, scale, zp = rows_of(slice(r, min(r + step, out_f)))
        for k, v in compress_linear(prefix, w, scale, zp, g_idx, scheme, scale_dtype, global_scale).items():
            field = k[len(prefix) + 1:]
            if field in ROW_FIELDS:
                rows.setdefault(k, []).append(v)
            elif field == "weight_shape":
                once[k] = torch.tensor([out_f, in_f], dtype=v.dtype)
            elif k not in once:
                once[k] = v
            elif not torch.equal(once[k], v):
                raise ValueError(f"{k}: the compressor's output differs between row blocks; it is not row-wise")
    return {**{k: torch.cat(v) if len(v) > 1 else v[0] for k, v in rows.items()}, **once}


def quantization_config(schemes: dict[str, QuantizationScheme], ignore: list[str],
                        kv_cache_scheme: QuantizationArgs | None = None) -> ModelCompressor:
    """`kv_cache_scheme`: the static FP8 KV-cache args (quantkit.quantize.kvcache.kv_cache_args), whose
    per-layer k_scale / v_scale tensors the shards carry."""
    formats = sorted({s.format for s in schemes.values()})
    qc = QuantizationConfig(config_groups=schemes, format=formats[0] if len(formats) == 1 else "mixed-precision",
                            quantization_status="compressed", ignore=ignore, kv_cache_scheme=kv_cache_scheme)
    return ModelCompressor(quantization_config=qc)


def write_config(src_config: Path, out_dir: Path, compressor: ModelCompressor, overrides: dict | None = None) -> None:
    """`overrides`: config fields the conversion changed (a rotation unties the embeddings)."""
    from quantkit.model.sources import normalize_config

    cfg = {**normalize_config(json.loads(src_config.read_text()), drop_quantization=True), **(overrides or {})}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    compressor.update_config(str(out_dir))
