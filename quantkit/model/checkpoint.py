"""Lazy, layer-at-a-time loading from safetensors: the model tree on the meta device, one decoder layer
materialized at a time and dropped again, so the pipeline never holds the whole model in memory.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from torch import nn

from quantkit.export.shards import DTYPES


class LazyCheckpoint:
    """Read tensors by name from a folder of safetensors files.

    The files' headers are read (and checked) by the safetensors library; a tensor's bytes are then read from
    the file straight into a tensor of its own (`readinto`), not through a memory map: a mapped file's pages
    count in the resident set while it is open, so reading through one held each tensor twice while it was
    copied out (8B shape: a layer's 436 MB load peaked 839 MB higher, the export of its 1 GB embedding 2 GB).
    """

    def __init__(self, folder: Path, files: list[Path] | None = None):
        """Every `*.safetensors` file of `folder`, or just `files` (in that order) when given."""
        from safetensors import safe_open

        self.folder = Path(folder)
        self._where: dict[str, Path] = {}
        self._layout: dict[str, tuple[str, tuple[int, ...]]] = {}  # key -> (safetensors dtype code, shape)
        self._span: dict[str, tuple[int, int]] = {}  # key -> (first byte in its file, bytes)
        for f in files if files is not None else sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt"):  # the library checks the header against the file
                pass
            header = _header(f)
            for k in sorted(header):  # the library's order: by name
                self._where[k], self._layout[k], self._span[k] = f, header[k][:2], header[k][2]

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
        """Several tensors, each its own memory (nothing maps the file), each file opened once."""
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            self._check(k)
            by_file.setdefault(self._where[k], []).append(k)
        out = {}
        for f, ks in by_file.items():
            with open(f, "rb", buffering=0) as h:
                for k in ks:
                    code, shape = self._layout[k]
                    out[k] = _read_into(h, self._span[k][0], torch.empty(shape, dtype=DTYPES[code]))
        return out

    def stored_span(self, key: str) -> tuple[Path, int, int] | None:
        """(file, first byte, bytes) of a tensor exactly as `get` returns it, for a copy of its bytes that never
        holds it whole (quantkit/export/shards.py); None where `get` computes it (a view of the stored model)."""
        self._check(key)
        return (self._where[key], *self._span[key])

    def get_rows(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (sorted, unique indices into dim 0) of a tensor, read without the rest: each run of
        consecutive rows is one read of the file (an embedding table's rows for the calibration tokens: 2 MB of
        Llama-3.1-8B's 1 GB for a 256-token vocabulary in use)."""
        self._check(key)
        code, shape = self._layout[key]
        idx = rows.tolist()
        out = torch.empty((len(idx), *shape[1:]), dtype=DTYPES[code])
        row_bytes = out[:1].numel() * out.element_size()
        with open(self._where[key], "rb", buffering=0) as h:
            start = 0
            for i in range(1, len(idx) + 1):
                if i == len(idx) or idx[i] != idx[i - 1] + 1:  # rows idx[start..i) are one run in the file
                    _read_into(h, self._span[key][0] + idx[start] * row_bytes, out[start:i])
                    start = i
        return out


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]:
    """Each tensor's (dtype code, shape, (first byte, bytes)) in a safetensors file: an
    8-byte little-endian header length, the JSON header, then the data, which `data_offsets` count from."""
    with open(path, "rb") as h:
        n = struct.unpack("<Q", h.read(8))[0]
        header = json.loads(h.read(n))
    return {k: (v["dtype"], tuple(v["shape"]), (8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0]))
            for k, v in header.items() if k != "__metadata__"}


def _read_into(h, offset: int, out: torch.Tensor) -> torch.Tensor:
    """`out` (contiguous) filled with the file's bytes from `offset`: read straight into its memory, in pieces
    (one read() returns at most ~2 GB on Linux)."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    h.seek(offset)
    done = 0
    while done < len(view):
        n = h.readinto(view[done:done + (1 << 30)])
        if not n:
            raise ValueError(f"{h.name}: the file ends before the tensor at byte {offset} does")
        done += n
    return out


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
    # (no copy where the dtype and device match: each tensor `get_many` returns has its own memory)
    state = {name: stored[key].to(device=device, dtype=dtype) for name, key in keys.items()}
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

