"""Model sources, architecture specs and lazy, layer-at-a-time loading from safetensors.

The pipeline never needs the whole model in memory: it builds the module tree on the meta device,
then materializes one decoder layer at a time from the safetensors files (read lazily with
`safe_open`) and drops it again when the layer is done. Weights load from safetensors only; a pickle
checkpoint (`.bin`, `.pt`) is refused. GGUF files are converted once, through transformers, into a
cached safetensors folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantkit.io import quantkit_home  # noqa: F401  (re-exported: models live under it)
from quantkit.recipe import ModelSpec


class ModelError(RuntimeError):
    """A model problem, phrased for the user: what was tried and what to do."""


# ------------------------------------------------------------------------------ architecture specs
@dataclass(frozen=True)
class ArchSpec:
    """Where things are in one model family, as data. Names are relative to a decoder layer."""

    name: str
    model_types: tuple[str, ...]
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    # true-sequential order: each group shares its input and is quantized before the next group runs
    sequential: tuple[tuple[str, ...], ...] = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )
    # (preceding op, ops it feeds): used by smoothing transforms (AWQ, SmoothQuant)
    smoothing: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),
    )
    extra: dict = field(default_factory=dict)


ARCHS: dict[str, ArchSpec] = {}


def register_arch(spec: ArchSpec) -> ArchSpec:
    for mt in spec.model_types:
        if mt in ARCHS:
            raise ValueError(f"model_type {mt!r} registered twice")
        ARCHS[mt] = spec
    return spec


register_arch(ArchSpec("llama", ("llama",)))
register_arch(ArchSpec("mistral", ("mistral",)))
register_arch(ArchSpec("qwen2", ("qwen2",)))
register_arch(ArchSpec("qwen3", ("qwen3",)))  # q_norm / k_norm sit inside attention; linears as llama
# Gemma: the norms are applied as (1 + weight); folding a smoothing scale into them needs care.
register_arch(ArchSpec("gemma", ("gemma",), extra={"norm_offset": 1.0}))
# Gemma 2/3 normalise the attention output (post_attention_layernorm) before the residual add; the MLP
# reads pre_feedforward_layernorm, so that is the norm a smoothing scale folds into.
register_arch(ArchSpec("gemma2", ("gemma2", "gemma3_text"), extra={"norm_offset": 1.0}, smoothing=(
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)))


def arch_for(config) -> ArchSpec:
    mt = getattr(config, "model_type", None)
    if mt not in ARCHS:
        raise ModelError(f"model_type {mt!r} has no architecture spec (known: {', '.join(sorted(ARCHS))}); "
                         "add one with quantkit.models.register_arch")
    return ARCHS[mt]


# ------------------------------------------------------------------------------------- resolution
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def resolve_model_dir(spec: ModelSpec, quiet: bool = False) -> Path:
    """Turn `model.path` into a local HF folder with safetensors weights (fetching/converting if needed)."""
    from quantkit import demo

    p = spec.path
    if p in demo.DEMO_MODELS:
        return demo.ensure_demo_model(p, quiet=quiet)
    path = Path(p).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"model.path: {p}: no such GGUF file")
        return convert_gguf(path, spec.dtype, quiet=quiet)
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model.path: {p}: expected a Hugging Face model folder or a .gguf file")
        check_safetensors_folder(path)
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", p):
        return download_from_hub(p, spec.revision)
    raise ModelError(f"model.path: {p!r} is not a folder, a .gguf file, a hub id (org/name) or a demo model "
                     f"(known: {', '.join(demo.DEMO_MODELS)})")


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
    from quantkit.io import atomic_dir, sha256_file

    digest = sha256_file(gguf)
    out = quantkit_home() / "gguf" / f"{gguf.stem}-{digest[:16]}-{dtype}"
    if (out / "quantkit_source.json").is_file():
        return out
    with atomic_dir(out) as tmp:
        save_gguf_as_hf(gguf, tmp, dtype)
        (tmp / "quantkit_source.json").write_text(json.dumps(
            {"gguf": str(gguf), "gguf_sha256": digest, "dtype": dtype}, indent=2))
    return out


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


def normalize_config_json(config_json: Path, drop_quantization: bool = False) -> None:
    """Make config.json safe for every reader.

    transformers 5 keeps only `rope_parameters`; older readers silently fall back to the wrong
    rope_theta, so the top-level `rope_theta` is written too. A GGUF-loaded model carries a
    `quantization_config` (quant_method gguf) that no longer describes the dequantized weights.
    """
    cfg = json.loads(config_json.read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in cfg:
        cfg["rope_theta"] = theta
    if drop_quantization:
        cfg.pop("quantization_config", None)
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- lazy checkpoint view
class LazyCheckpoint:
    """Read tensors by name from a folder of safetensors files.

    A file is open only while tensors are read from it: safetensors reads through a memory map, and the
    pages of a file that stays open count in the resident set, so a checkpoint held open would make
    peak memory grow with every layer read.
    """

    def __init__(self, folder: Path, files: list[Path] | None = None):
        """Every `*.safetensors` file of `folder`, or just `files` (in that order) when given."""
        from safetensors import safe_open

        self.folder = Path(folder)
        self._where: dict[str, Path] = {}
        self._layout: dict[str, tuple[str, tuple[int, ...]]] = {}  # key -> (safetensors dtype code, shape)
        for f in files if files is not None else sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    self._where[k] = f
                    self._layout[k] = (sl.get_dtype(), tuple(sl.get_shape()))

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def layout(self, key: str) -> tuple[str, tuple[int, ...]]:
        self._check(key)
        return self._layout[key]

    def _check(self, key: str) -> None:
        if key not in self._where:
            raise KeyError(f"{self.folder}: tensor {key!r} not found in the safetensors files")

    def get(self, key: str) -> torch.Tensor:
        return self.get_many([key])[key]

    def get_many(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Several tensors, each file opened once and closed again."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for k in keys:
            self._check(k)
            by_file.setdefault(self._where[k], []).append(k)
        out = {}
        for f, ks in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                for k in ks:
                    out[k] = h.get_tensor(k)
        return out


def build_skeleton(folder: Path, dtype: str, trust_remote_code: bool = False):
    """Module tree with parameters on the meta device (buffers such as rotary tables are real)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code)
    model.eval()
    return model


def materialize(module: nn.Module, prefix: str, ckpt: LazyCheckpoint, dtype: torch.dtype,
                device: torch.device | str = "cpu", fallback: dict[str, str] | None = None) -> None:
    """Load `module`'s parameters from the checkpoint (names = prefix + local name), in `dtype`."""
    keys = {}
    for name, _ in module.named_parameters():
        key = prefix + name
        if key not in ckpt and fallback and key in fallback:
            key = fallback[key]
        keys[name] = key
    stored = ckpt.get_many(list(keys.values()))
    # a copy even when the dtype matches: the stored tensors are backed by the file's memory map
    state = {name: stored[key].to(device=device, dtype=dtype, copy=True) for name, key in keys.items()}
    del stored
    module.load_state_dict(state, strict=False, assign=True)


def release(module: nn.Module) -> None:
    """Drop a module's parameter storage (back to meta) so peak memory stays one layer wide."""
    module.to("meta")
