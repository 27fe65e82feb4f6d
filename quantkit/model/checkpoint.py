"""Lazy, layer-at-a-time loading from safetensors: the model tree on the meta device, one decoder layer
materialized at a time and dropped again, so the pipeline never holds the whole model in memory.
"""

from __future__ import annotations

import math

from pathlib import Path

import torch
from torch import nn


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

    # what a view of the stored model changed (quantkit/model/rotated.py): the config.json fields the model read
    # through it differs in, and a summary for the manifest (None: the stored model as it is)
    config_overrides: dict = {}
    summary: dict | None = None

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def layout(self, key: str) -> tuple[str, tuple[int, ...]]:
        self._check(key)
        return self._layout[key]

    def numel(self, key: str) -> int:
        """Elements of a tensor, from its header."""
        return math.prod(self.layout(key)[1])

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


    def get_rows(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (sorted, unique indices into dim 0) of a tensor, read without the rest: each run of
        consecutive rows is one slice of the file, so only their pages are touched (an embedding table's
        rows for the calibration tokens: 2 MB of Llama-3.1-8B's 1 GB for a 256-token vocabulary in use)."""
        from safetensors import safe_open

        self._check(key)
        idx = rows.tolist()
        runs, start = [], 0
        for i in range(1, len(idx) + 1):
            if i == len(idx) or idx[i] != idx[i - 1] + 1:
                runs.append((idx[start], idx[i - 1] + 1))
                start = i
        with safe_open(str(self._where[key]), framework="pt") as h:
            sl = h.get_slice(key)
            parts = [sl[a:b] for a, b in runs] or [sl[0:0]]
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def build_skeleton(folder: Path, dtype: str, trust_remote_code: bool = False):
    """Module tree with parameters on the meta device (buffers such as rotary tables are real), its
    sparse blocks (mixture of experts) unfused into one Linear per expert as the checkpoint stores them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.model.arch import ARCHS
    from quantkit.model.moe import unfuse_experts

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code)
    model.eval()
    arch = ARCHS.get(getattr(config, "model_type", None))
    if arch is not None and arch.moe is not None:
        unfuse_experts(model, arch, LazyCheckpoint(folder).keys())
    return model


def materialize(module: nn.Module, prefix: str, ckpt: LazyCheckpoint, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> None:
    """Load `module`'s parameters from the checkpoint (names = prefix + local name), in `dtype`."""
    keys = {name: prefix + name for name, _ in module.named_parameters()}
    stored = ckpt.get_many(list(keys.values()))
    # a copy even when the dtype matches: the stored tensors are backed by the file's memory map
    state = {name: stored[key].to(device=device, dtype=dtype, copy=True) for name, key in keys.items()}
    del stored
    module.load_state_dict(state, strict=False, assign=True)


def release(module: nn.Module) -> None:
    """Drop a module's parameter storage (back to meta) so peak memory stays one layer wide."""
    module.to("meta")


def to_layer_device(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """A calibration chunk on the device `layer` computes on: a no-op unless the activations live in host
    memory while the layer is on a GPU (quantkit.quantize.layers.activation_placement)."""
    device = next(layer.parameters()).device
    return x if x.device == device else x.to(device, non_blocking=True)

