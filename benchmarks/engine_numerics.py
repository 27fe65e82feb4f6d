"""One Linear of the demo model through vLLM's own CPU kernels vs quantkit's reference of the same export,
with the difference taken apart into single operations. Prints one JSON document (progress on stderr).

    python benchmarks/engine_numerics.py                                   # both schemes, 2 layers, 256 tokens
    python benchmarks/engine_numerics.py --scheme W8A8 --layer model.layers.3.self_attn.q_proj --tokens 512
    python benchmarks/engine_numerics.py --isa avx2,avx2_vnni,avx512_core  # more CPU kinds for W8A8's oneDNN path
    python benchmarks/engine_numerics.py --ppl-tokens 4096                 # + the whole model, suite-sized (~10 min)

Why: `quantkit eval` measured the candidate losing more perplexity inside vLLM than the same export in the
engine-free reference (transformers fp32, compressed-tensors decompression): W4A16 g64 x1.327 vs x1.292 (on
an AMX CPU), W8A8 +6.8% vs +2.6% (on an AVX2 CPU). This takes one real Linear, its real input (the float
model's activations on calibration/heldout/technical.txt, captured with a hook) and the tensors the
export wrote (read from a `quantkit convert` of recipes/smollm2-<scheme>-rtn.yaml, converted into
--work on first use, and checked against quantkit's export code run on the float weight), and computes:

- float: x @ W^T, float64, W the checkpoint's bf16 weight;
- quantkit_reference: quantkit's meaning of the export (codes x scales in fp32; for W8A8 quantkit's own
  per-token activation fake quantization), float64 product;
- compressed_tensors_reference: what transformers computes in the reference column (compressed-tensors'
  decompression with float32 scales, its dynamic activation quantization with scale absmax/127.5),
  checked against the transformers module itself;
- vllm[...]: vLLM's own layer (quantkit.diagnostics.numerics.vllm_linear: CompressedTensorsConfig, the scheme and
  CPU kernel vLLM selects, its weight loaders, process_weights_after_loading, forward), in the activation
  dtype `quantkit eval` runs here (quantkit.engine.vllm_server.resolve_dtype), plus the other kernels
  vLLM picks on other CPUs or settings: the oneDNN int8 path in float32 (CPUs without AMX), that path with
  vLLM's AVX2 library and oneDNN limited to an ISA (`--isa`; each in its own process: the library and
  ONEDNN_MAX_CPU_ISA are chosen once per process), and W4A16 with VLLM_CPU_INT4_W4A8=0;
- single_operations: quantkit's reference with exactly one operation changed to what an engine does
  (bf16 input, the activation quantizer's variants, bf16 dequantized weights (W4A16), bf16 output, int8 per-token
  activations for the W4A8 kernel, int16 pair saturation of a non-VNNI int8 GEMM), each against quantkit's
  reference and the float output;
- engine_emulation: those operations composed as each vLLM kernel does them, against that kernel's output
  (near 0 means the kernel is understood operation by operation);
- with --ppl-tokens: the whole model's perplexity on the default suite's windows, float32 transformers with
  every quantized Linear computed by quantkit's reference or by each of those vLLM kernels. With int8
  dynamic activations the model is chaotic at rounding boundaries (float-rounding-level differences flip
  codes that cascade), so W8A8 figures that agree per Linear to 1e-7 still differ by a few tenths of a
  percent: read only larger differences.

Errors are ||y - ref|| / ||ref|| over all tokens and outputs, and SQNR in dB (10 log10 |ref|^2/|y-ref|^2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_MODEL = Path(os.environ.get("QUANTKIT_REAL_HOME", Path.home() / ".cache" / "quantkit")) / "models" / "smollm2-135m"
DEFAULT_LAYERS = ["model.layers.3.mlp.down_proj", "model.layers.3.self_attn.q_proj"]
RECIPES = {"W8A8": "smollm2-w8a8-rtn.yaml", "W4A16": "smollm2-w4a16-rtn.yaml"}
GROUP_SIZE = {"W8A8": None, "W4A16": 64}
# oneDNN ISA limits for W8A8's oneDNN path -> vLLM library an x86 CPU of that kind loads
ISA = {"avx2": ("AVX2", "_C_AVX2"), "avx2_vnni": ("AVX2_VNNI", "_C_AVX2"),
       "avx512_core": ("AVX512_CORE", "_C_AVX512"), "avx512_core_vnni": ("AVX512_CORE_VNNI", "_C_AVX512")}


def log(msg: str) -> None:
    print(f"[engine_numerics] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ emulated operations
def bf16(t):
    import torch

    return t.to(torch.bfloat16).to(t.dtype)


def int_gemm(qa, qb):
    """Exact integer product of codes (float64 holds every partial sum here exactly)."""
    return qa.double() @ qb.double().t()


# ------------------------------------------------------------------------- whole-model perplexity check
def quantized_names(export: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        return sorted(k[: -len(".weight_scale")] for k in f.keys() if k.endswith(".weight_scale"))


def linear_impl(nm, lin, kind: str):
    """x [tokens, in] fp32 -> y fp32 for one quantized Linear: quantkit's reference ops, or a vLLM kernel."""
    import torch

    if kind == "quantkit":
        W = nm.dequantize(lin)
        acts = lin.activations
        return lambda x: (nm.quantkit_act_fakequant(x) if acts is not None else x.float()) @ W.t()
    dtype, env, onednn = {"vllm": (nm.engine_dtype(), None, False),
                          "vllm_w4a16_kernel": (nm.engine_dtype(), {"VLLM_CPU_INT4_W4A8": "0"}, False),
                          "vllm_onednn_fp32": (torch.float32, None, True)}[kind]
    layer = nm.vllm_linear(lin, dtype, env=env, force_onednn=onednn)
    return lambda x: nm.vllm_forward(layer, x)


def perplexity_with(model_dir: Path, export: Path, kind: str, max_tokens: int) -> dict:
    """Perplexity of the float32 transformers model on the default suite's windows (512 tokens, the first
    `max_tokens` of each heldout file) with every quantized Linear of `export` computed by `kind`."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.diagnostics import numerics as nm
    from quantkit.evaluate.hf_perplexity import token_windows, window_nll

    tok = AutoTokenizer.from_pretrained(model_dir)
    # the rest of the model (embeddings, norms, head) as the export has it: a rotated export's differ from the
    # float model's (quantkit/algorithms/rotate.py folds the rotation into them)
    src = model_dir if kind == "float" else export
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, use_safetensors=True).eval()
    if kind != "float":
        for name in quantized_names(export):
            fn = linear_impl(nm, nm.read_exported_linear(export, name), kind)
            mod = model.get_submodule(name)
            mod.forward = lambda x, fn=fn: fn(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1).to(x.dtype)
    t0 = time.perf_counter()
    nll, n = 0.0, 0
    for f in ("technical.txt", "general.txt"):
        wins = token_windows((REPO / "calibration" / "heldout" / f).read_text(encoding="utf-8"), tok, 512, max_tokens)
        a, b = window_nll(model, wins, batch=1)
        nll, n = nll + a, n + b
    return {"perplexity": math.exp(nll / n), "tokens": n, "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------- the worker
def worker(isa: str, work: Path) -> None:
    """In its own process: vLLM's oneDNN int8 path with the library an `isa` CPU loads and oneDNN limited to
    that ISA; writes the outputs and the activation codes of every job layer."""
    import torch

    torch.set_num_threads(1)
    limit, lib = ISA[isa]
    os.environ["ONEDNN_MAX_CPU_ISA"] = limit
    if lib == "_C_AVX2":  # vllm.platforms.cpu.import_kernels picks the library from these
        torch.cpu._is_avx512_supported = lambda: False
    elif lib == "_C_AVX512":
        torch.cpu._is_avx512_bf16_supported = lambda: False
    from safetensors.torch import load_file, save_file

    from quantkit.diagnostics import numerics as nm

    job = json.loads((work / "job.json").read_text())
    xs = load_file(str(work / "x.safetensors"))
    out, info = {}, {}
    for name in job["layers"]:
        lin = nm.read_exported_linear(Path(job["export"]), name)
        layer = nm.vllm_linear(lin, torch.float32, force_onednn=True)  # a CPU without AMX: oneDNN, float32
        out[f"{name}:y"] = nm.vllm_forward(layer, xs[name]).contiguous()
        q, s = nm.vllm_onednn_activation_codes(xs[name], torch.float32)
        out[f"{name}:q"], out[f"{name}:s"] = q.contiguous(), s.contiguous()
        info[name] = {**nm.describe(layer), "library": lib, "ONEDNN_MAX_CPU_ISA": limit}
    save_file(out, str(work / f"out-{isa}.safetensors"))
    if job.get("ppl_tokens"):
        info["perplexity"] = perplexity_with(Path(job["model"]), Path(job["export"]), "vllm_onednn_fp32",
                                             job["ppl_tokens"])
    (work / f"out-{isa}.json").write_text(json.dumps(info))


def run_isa_variants(isas: list[str], export: Path, layers: list[str], xs: dict, work: Path,
                     model: Path, ppl_tokens: int = 0) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    work.mkdir(parents=True, exist_ok=True)
    save_file({n: xs[n].contiguous() for n in layers}, str(work / "x.safetensors"))
    (work / "job.json").write_text(json.dumps({"export": str(export), "layers": layers, "model": str(model),
                                               "ppl_tokens": ppl_tokens}))
    got = {}
    for isa in isas:
        log(f"W8A8 oneDNN path as a {isa} CPU runs it (subprocess)")
        t0 = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, __file__, "--worker", isa, "--work", str(work)], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            log(f"{isa}: worker failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
            got[isa] = {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
            continue
        t = load_file(str(work / f"out-{isa}.safetensors"))
        info = json.loads((work / f"out-{isa}.json").read_text())
        got[isa] = {n: {"y": t[f"{n}:y"].to(torch.float64), "q": t[f"{n}:q"], "s": t[f"{n}:s"], "kernel": info[n]}
                    for n in layers}
        if "perplexity" in info:
            got[isa]["__perplexity__"] = info["perplexity"]
        log(f"{isa}: {time.perf_counter() - t0:.1f}s")
    return got


# ------------------------------------------------------------------------------------------ analysis
def ensure_export(scheme: str, model: Path, root: Path) -> Path:
    out = root / f"{scheme.lower()}-rtn"
    if (out / "config.json").is_file():
        return out
    log(f"converting {RECIPES[scheme]} into {out} (once)")
    cmd = [str(Path(sys.executable).parent / "quantkit"), "convert", str(REPO / "recipes" / RECIPES[scheme]),
           "--output", str(out), "--device", "cpu", "--set", f"model.path={model}"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


def both(nm, y, y_float, y_ref) -> dict:
    return {"vs_float": nm.compare(y, y_float), "vs_quantkit": nm.compare(y, y_ref)}


def analyse_w8a8(nm, lin, x, y_float, y_ref, engine, isa_out, dtype) -> dict:
    import torch

    name = lin.name
    qw, sw = nm.codes_and_scales(lin)
    s_w = sw[:, :1].double().t()  # per output channel [1, out]
    W = nm.dequantize(lin).double()
    xq_qk = nm.quantkit_act_fakequant(x).double()

    def act_variant(xin, **kw):
        q, s = nm.int8_per_token(xin, **kw)
        return (q.double() * s.double()) @ W.t()

    ops = {
        "input_bf16": act_variant(bf16(x)),
        "act_scale_absmax_over_127.5 (compressed-tensors)": act_variant(x, divisor=127.5),
        "act_multiply_by_inverse_scale (vLLM kernels)": act_variant(x, multiply_inverse=True),
        "act_round_half_away_from_zero (std::round)": act_variant(x, rounding="half_away"),
        "output_bf16": bf16(y_ref.float()).double(),
    }
    qx, sx = nm.int8_per_token(x)
    ops["int8_gemm_int16_pair_saturation (oneDNN s8s8 without VNNI)"] = (
        nm.int8_gemm_int16_pairs(qx, qw).double() * sx.double() * s_w)
    single = {k: both(nm, v, y_float, y_ref) for k, v in ops.items()}

    # the activation codes each engine path actually used, against quantkit's
    codes = {}
    emul = {}
    if engine["native"]["kernel"]["op"].startswith("int8_scaled_mm_with_quant"):
        qv = nm.vllm_int8_activation_codes(x, dtype)
        xb = bf16(x.to(dtype).float())
        cand = {f"{r}{'+inv' if inv else ''}": nm.int8_per_token(xb, multiply_inverse=inv, rounding=r)[0]
                for r in ("half_even", "half_away") for inv in (False, True)}
        codes["vllm_sgl_vs_quantkit_on_fp32_input"] = float((qv != qx).double().mean())
        codes["vllm_sgl_vs_emulations_on_bf16_input"] = {k: float((qv != c).double().mean()) for k, c in cand.items()}
        best = min(cand, key=lambda k: float((qv != cand[k]).double().mean()))
        q_e, s_e = nm.int8_per_token(xb, multiply_inverse="inv" in best,
                                     rounding="half_away" if best.startswith("half_away") else "half_even")
        acc = int_gemm(q_e, qw).float()  # int32 accumulator, converted to fp32 as the kernel does
        y_e = ((acc * s_e.float()) * sw[:, :1].t().float()).to(dtype).double()
        emul["vllm"] = {"ops": [f"bf16 input", f"codes: {best}", "exact int32 GEMM", "(acc * s_x) * s_w in fp32",
                                f"{str(dtype).replace('torch.', '')} output"],
                        "emulation_vs_vllm": nm.compare(y_e, engine["native"]["y"])}
    if "onednn_fp32" in engine:
        q1, s1 = nm.vllm_onednn_activation_codes(x, torch.float32)
        codes["vllm_onednn_vs_quantkit"] = float((q1 != qx).double().mean())
        y_e = int_gemm(q1, qw) * s1.double() * s_w
        emul["vllm_onednn_fp32"] = {"ops": ["codes from onednn_scaled_int8_quant", "exact int32 GEMM",
                                            "per-token x per-channel scale, fp32 output"],
                                    "emulation_vs_vllm": nm.compare(y_e, engine["onednn_fp32"]["y"])}
    for isa, res in isa_out.items():
        if "error" in res:
            continue
        r = res[name]
        codes[f"vllm_onednn_{isa}_vs_quantkit"] = float((r["q"] != qx).double().mean())
        exact = int_gemm(r["q"], qw) * r["s"].double() * s_w
        sat = nm.int8_gemm_int16_pairs(r["q"], qw).double() * r["s"].double() * s_w
        emul[f"vllm_onednn_fp32[{isa}]"] = {
            "gemm_vs_exact_integer_math": nm.compare(r["y"], exact),
            "emulation_with_int16_pair_saturation_vs_vllm": nm.compare(sat, r["y"]),
            "outputs_touched_by_saturation": float(((sat - exact).abs() > 0).double().mean()),
        }
    return {"single_operations": single, "activation_codes_mismatch_fraction": codes, "engine_emulation": emul}


def analyse_w4a16(nm, lin, x, y_float, y_ref, engine, dtype) -> dict:
    W = nm.dequantize(lin).double()
    xf = x.double()
    W_bf = bf16(W.float()).double()
    ops = {
        "input_bf16": bf16(x).double() @ W.t(),
        "weight_dequant_in_bf16 (cpu_gemm_wna16)": xf @ W_bf.t(),
        "output_bf16": bf16(y_ref.float()).double(),
    }
    q, s = nm.int8_per_token(x)
    ops["act_int8_per_token (the W4A8 kernel int4_scaled_mm_cpu)"] = (q.double() * s.double()) @ W.t()
    single = {k: both(nm, v, y_float, y_ref) for k, v in ops.items()}
    emul, codes = {}, {}
    qw, sw = nm.codes_and_scales(lin)
    if "W4A8" in (engine["native"]["kernel"]["op"] or ""):
        qv = nm.vllm_int8_activation_codes(x, dtype)  # int4_scaled_mm_cpu shares the sgl row quantizer
        xb = bf16(x.to(dtype).float())
        q_e, s_e = nm.int8_per_token(xb, multiply_inverse=True, rounding="half_even")
        codes["w4a8_kernel_vs_quantkit_w8a8_quantizer_on_bf16_input"] = float((qv != nm.int8_per_token(xb)[0]).double().mean())
        g = lin.tensors["weight_scale"].shape[1]
        K = x.shape[1]
        acc = sum(((q_e[:, j * (K // g):(j + 1) * (K // g)].double()
                    @ qw[:, j * (K // g):(j + 1) * (K // g)].double().t()).float() * s_e.float()
                   * sw[:, j * (K // g)].float()[None, :]) for j in range(g))  # per group, fp32 partial sums
        y_e = acc.to(dtype).double()
        emul["vllm"] = {"ops": ["bf16 input", "int8 per-token codes round(x * 127/absmax)", "exact int32 per group",
                                "fp32 sum over groups of acc * s_x * s_w", "bf16 output"],
                        "emulation_vs_vllm": nm.compare(y_e, engine["native"]["y"])}
    if "w4a16_kernel" in engine:
        y_e = bf16((bf16(x).double() @ W_bf.t()).float()).double()
        emul["vllm_w4a16_kernel"] = {"ops": ["bf16 input", "bf16 dequantized weight", "fp32 accumulation", "bf16 output"],
                                     "emulation_vs_vllm": nm.compare(y_e, engine["w4a16_kernel"]["y"])}
    return {"single_operations": single, "activation_codes_mismatch_fraction": codes, "engine_emulation": emul}


def rotated(export: Path) -> bool:
    """Whether the export's recipe rotated the model before quantizing (its manifest's stages)."""
    manifest = json.loads((export / "manifest.json").read_text())
    return any(st.get("method") == "rotate" for st in manifest.get("quantization", {}).get("stages", []))


def run_scheme(scheme: str, args, xs: dict, model: Path) -> dict:
    import torch

    from quantkit.diagnostics import numerics as nm

    export = args.export if args.export and len(args.schemes) == 1 else ensure_export(scheme, model, args.work)
    dtype = nm.engine_dtype()
    res = {"export": str(export), "engine_dtype": str(dtype).replace("torch.", ""), "layers": {}}
    tf_model = None
    if args.transformers:  # the reference column's own computation: the export loaded by transformers
        from transformers import AutoModelForCausalLM

        tf_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, use_safetensors=True).eval()
        with torch.no_grad():  # transformers decompresses the export on the model's first forward
            tf_model(input_ids=torch.tensor([[1, 2, 3]]))
    layers = args.layer
    if rotated(export):
        layers = []
        res["layers_skipped"] = ("a rotated export: its Linears read the rotated residual stream, not the float "
                                 "model's activations this section feeds them; the perplexity below is whole-model")
    isa_out = {}
    if scheme == "W8A8" and args.isa:
        isa_out = run_isa_variants(args.isa, export, layers, xs, args.work / "isa", model, args.ppl_tokens)
    for name in layers:
        log(f"{scheme} {name}")
        x = xs[name]
        lin = nm.read_exported_linear(export, name)
        w = nm.float_weight(model, name)
        mine, deq = nm.export_linear(w, scheme, name, GROUP_SIZE[scheme])
        export_check = {
            "tensors": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in lin.tensors.items()},
            "same_tensors_as_quantkit_export_code": set(lin.tensors) == set(mine.tensors) and all(
                lin.tensors[k].dtype == mine.tensors[k].dtype and torch.equal(lin.tensors[k], mine.tensors[k])
                for k in lin.tensors),
            "codes_x_scales_equal_quantkit_rtn": bool(torch.equal(nm.dequantize(lin), deq)),
        }
        y_float = x.double() @ w.double().t()
        y_ref = nm.quantkit_reference(lin, x)
        y_ct = nm.compressed_tensors_reference(lin, x)
        paths = {"quantkit_reference": {"vs_float": nm.compare(y_ref, y_float)},
                 "compressed_tensors_reference": both(nm, y_ct, y_float, y_ref)}
        if tf_model is not None:
            with torch.no_grad():
                y_tf = tf_model.get_submodule(name)(x.float().unsqueeze(0))[0].double()
            paths["compressed_tensors_reference"]["vs_transformers_module"] = nm.compare(y_ct, y_tf)
        engine = {}
        variants = [("native", dtype, None, False)]
        if scheme == "W8A8":
            variants.append(("onednn_fp32", torch.float32, None, True))
        else:
            variants.append(("w4a16_kernel", dtype, {"VLLM_CPU_INT4_W4A8": "0"}, False))
        for key, dt, env, onednn in variants:
            label = "vllm" if key == "native" else f"vllm_{key}"
            why = None if onednn else nm.kernel_unavailable(lin, dt)
            if why:
                paths[label] = {"skipped": why}
                continue
            layer = nm.vllm_linear(lin, dt, env=env, force_onednn=onednn)
            y = nm.vllm_forward(layer, x).double()
            engine[key] = {"y": y, "kernel": nm.describe(layer)}
            paths[label] = {**both(nm, y, y_float, y_ref), "kernel": engine[key]["kernel"],
                            **({"env": env} if env else {}),
                            **({"note": "as quantkit eval runs it on this machine"} if key == "native" else {})}
        for isa, r in isa_out.items():
            if "error" in r:
                paths[f"vllm_onednn_fp32[{isa}]"] = {"error": r["error"]}
                continue
            paths[f"vllm_onednn_fp32[{isa}]"] = {**both(nm, r[name]["y"], y_float, y_ref), "kernel": r[name]["kernel"]}
        if "native" not in engine:
            detail = {}
        elif scheme == "W8A8":
            detail = analyse_w8a8(nm, lin, x, y_float, y_ref, engine, isa_out, dtype)
        else:
            detail = analyse_w4a16(nm, lin, x, y_float, y_ref, engine, dtype)
        res["layers"][name] = {"shape": list(lin.shape), "tokens": int(x.shape[0]), "export_check": export_check,
                               "paths": paths, **detail}
    if args.ppl_tokens:
        from quantkit.diagnostics import numerics as nm2

        kinds = ["float", "quantkit"]
        native_ok = nm2.kernel_unavailable(nm2.read_exported_linear(export, args.layer[0]), dtype) is None
        if native_ok:
            kinds.append("vllm")
            if scheme == "W4A16":
                kinds.append("vllm_w4a16_kernel")
        if scheme == "W8A8":
            kinds.append("vllm_onednn_fp32")
        ppl = {}
        for kind in kinds:
            log(f"{scheme}: perplexity with every quantized Linear computed by {kind}")
            ppl[kind] = perplexity_with(model, export, kind, args.ppl_tokens)
        for isa, r in isa_out.items():
            if "__perplexity__" in r:
                ppl[f"vllm_onednn_fp32[{isa}]"] = r["__perplexity__"]
        base = ppl["float"]["perplexity"]
        for v in ppl.values():
            v["vs_float"] = round(v["perplexity"] / base, 4)
        res["perplexity_linears_swapped"] = {
            "what": ("float32 transformers model on the default suite's windows; every quantized Linear computed "
                     "by: quantkit's reference ops, or vLLM's kernel (in its dtype, output cast back to float32)"),
            **ppl}
    return res


def summary(out: dict) -> list[dict]:
    """One row per scheme, layer and engine path: error vs float (engine and quantkit), vs quantkit."""
    rows = []
    for scheme, r in out["schemes"].items():
        for name, L in r["layers"].items():
            ref = L["paths"]["quantkit_reference"]["vs_float"]["rel_err"]
            for path, p in L["paths"].items():
                if path == "quantkit_reference" or "vs_float" not in p:
                    continue
                rows.append({"scheme": scheme, "layer": name, "path": path, "op": (p.get("kernel") or {}).get("op"),
                             "rel_err_vs_float": round(p["vs_float"]["rel_err"], 5),
                             "quantkit_rel_err_vs_float": round(ref, 5),
                             "rel_err_vs_quantkit": round(p["vs_quantkit"]["rel_err"], 5),
                             "sqnr_vs_quantkit_db": p["vs_quantkit"]["sqnr_db"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", default="all", help="W8A8, W4A16 or all (default)")
    ap.add_argument("--layer", action="append", help=f"Linear name (repeatable; default {DEFAULT_LAYERS})")
    ap.add_argument("--tokens", type=int, default=256, help="tokens of calibration/heldout/technical.txt (default 256)")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the float demo model folder")
    ap.add_argument("--export", type=Path, help="an existing export of --scheme to read (default: convert into --work)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/engine-numerics"), help="conversions and worker files")
    ap.add_argument("--isa", default="avx2", help="comma list for W8A8's oneDNN path in other CPU kinds: "
                    f"{', '.join(ISA)}; 'none' to skip (default avx2)")
    ap.add_argument("--no-transformers", dest="transformers", action="store_false",
                    help="skip checking the compressed-tensors reference against the transformers module")
    ap.add_argument("--ppl-tokens", type=int, default=0,
                    help="also the whole model: perplexity on the default suite's windows (this many tokens per "
                         "heldout file; the suite uses 4096) with every quantized Linear computed by quantkit's "
                         "reference or by each vLLM kernel (default 0: off; minutes)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.work)

    import torch

    torch.set_num_threads(1)
    from quantkit import hardware
    from quantkit.diagnostics import numerics as nm
    from quantkit.engine.vllm_server import vllm_version

    args.layer = args.layer or DEFAULT_LAYERS
    args.schemes = ["W8A8", "W4A16"] if args.scheme == "all" else [args.scheme]
    args.isa = [] if args.isa in ("none", "") else [s for s in args.isa.split(",") if s]
    for s in args.isa:
        if s not in ISA:
            ap.error(f"--isa {s}: one of {', '.join(ISA)}")
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(f"capturing the inputs of {args.layer} on {args.tokens} tokens (transformers, float32)")
    text = (REPO / "calibration" / "heldout" / "technical.txt").read_text(encoding="utf-8")
    xs = nm.capture_linear_inputs(args.model, args.layer, text, args.tokens)
    out = {"machine": {k: hardware.hardware()[k] for k in ("cpu", "cpu_flags", "cpu_kind")},
           "vllm": vllm_version(), "torch": torch.__version__, "model": str(args.model), "tokens": args.tokens,
           "input_text": "calibration/heldout/technical.txt", "schemes": {}}
    for scheme in args.schemes:
        out["schemes"][scheme] = run_scheme(scheme, args, xs, args.model)
    out["summary"] = summary(out)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
