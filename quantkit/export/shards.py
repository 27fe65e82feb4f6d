"""Stream tensors into safetensors shards holding at most one tensor in memory.

`safetensors.torch.save_file` needs every tensor of a file in memory at once, so writing a 2 GB shard
that way holds 2 GB. Here each tensor is described up front (name, dtype, shape: enough to lay out the
file's header) and read only when its bytes are written, then dropped. The files are plain
safetensors (8-byte little-endian header length, JSON header padded with spaces to 8 bytes, then the
data, tensors ordered by descending element size and then name so each starts aligned), and are read
back by the `safetensors` library in the tests.

Sources are read through `models.LazyCheckpoint`, which opens a file only while reading from it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

# safetensors dtype codes (the format's spelling) and the torch dtypes they hold
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
CODES = {v: k for k, v in DTYPES.items()}
WIDE_FLOAT_CODES = frozenset(k for k, v in DTYPES.items() if v.is_floating_point and v.itemsize >= 2)  # not fp8


def element_size(code: str) -> int:
    """Bytes per element of a safetensors dtype code."""
    return torch.empty((), dtype=DTYPES[code]).element_size()


def stored_bytes(ckpt, skip: set[str] = frozenset(), float_size: int | None = None) -> int:
    """Bytes of a checkpoint's tensors from their headers (numel x element size), `skip` left out; 16/32/64-bit
    float tensors counted at `float_size` bytes each when given. `ckpt`: a quantkit.model.checkpoint.LazyCheckpoint."""
    total = 0
    for key in ckpt.keys():
        if key in skip:
            continue
        code = ckpt.layout(key)[0]
        total += ckpt.numel(key) * (float_size if (float_size and code in WIDE_FLOAT_CODES) else element_size(code))
    return total


@dataclass(frozen=True)
class TensorRef:
    """A tensor to write: its layout now, its data when `read()` is called."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    # where the exact bytes already lie in a file, (file, first byte, bytes): copied from there a piece at a
    # time, never held whole (a source checkpoint's untouched tensors: Llama-3.1-8B's 1 GB embedding)
    span: tuple[Path, int, int] | None = None

    @property
    def itemsize(self) -> int:
        return element_size(self.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.itemsize


def ref_from_tensor(name: str, t: torch.Tensor) -> TensorRef:
    if t.dtype not in CODES:
        raise TypeError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
    return TensorRef(name, CODES[t.dtype], tuple(t.shape), lambda: t)


def refs_from_checkpoint(ckpt, keys: Iterable[str] | None = None) -> list[TensorRef]:
    """TensorRefs for a `models.LazyCheckpoint`'s tensors (all, or `keys`): layouts from the headers,
    data read when written."""
    return [TensorRef(k, *ckpt.layout(k), lambda k=k: ckpt.get(k), ckpt.stored_span(k))
            for k in (ckpt.keys() if keys is None else keys)]


def write_file(path: Path, refs: list[TensorRef], metadata: dict[str, str] | None = None) -> None:
    """One safetensors file, tensor by tensor. The caller renames it into place."""
    order = sorted(refs, key=lambda r: (-r.itemsize, r.name))  # aligned starts, as the library lays them out
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for r in order:
        if r.name in header:
            raise ValueError(f"{path.name}: tensor {r.name!r} written twice")
        header[r.name] = {"dtype": r.dtype, "shape": list(r.shape), "data_offsets": [offset, offset + r.nbytes]}
        offset += r.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb", buffering=0) as f:  # unbuffered: the kernel's copies and our writes share one offset
        _write_all(f, struct.pack("<Q", len(raw)) + raw)
        for r in order:
            if r.span is not None:
                _copy_span(r, f)
                continue
            t = r.read()
            if CODES.get(t.dtype) != r.dtype or tuple(t.shape) != r.shape:
                raise ValueError(f"{r.name}: read {CODES.get(t.dtype)} {tuple(t.shape)}, expected {r.dtype} {r.shape}")
            _write_all(f, t.contiguous().reshape(-1).view(torch.uint8).numpy().data)  # [nbytes] raw little-endian
            del t
        os.fsync(f.fileno())


def _write_all(f, data) -> None:
    """All of `data` to the unbuffered file `f` (one write() may take less than it is given)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]


def _copy_span(r: TensorRef, dest) -> None:
    """A tensor's bytes from where they lie (`r.span`) to the end of the unbuffered file `dest`: by the kernel
    (copy_file_range: no pass through this process's memory; 3 GB cold in 1.7 s where read + write took 7-13 s
    on a 2-core EPYC VM), or, where it cannot, 64 MB at a time through a buffer."""
    path, offset, nbytes = r.span
    if nbytes != r.nbytes:
        raise ValueError(f"{r.name}: {nbytes} bytes stored in {path.name}, {r.nbytes} expected for {r.dtype} {r.shape}")
    with open(path, "rb", buffering=0) as src:
        left = nbytes
        while left and hasattr(os, "copy_file_range"):
            try:
                n = os.copy_file_range(src.fileno(), dest.fileno(), min(left, 1 << 30), offset + nbytes - left)
            except OSError:  # across file systems on older kernels, or a file system without it
                break
            if not n:
                raise ValueError(f"{path}: the file ends before tensor {r.name!r} does")
            left -= n
        src.seek(offset + nbytes - left)
        while left:
            piece = src.read(min(left, 64 << 20))
            if not piece:
                raise ValueError(f"{path}: the file ends before tensor {r.name!r} does")
            _write_all(dest, piece)
            left -= len(piece)


def write_shards(out_dir: Path, refs: Iterable[TensorRef], max_shard_bytes: int) -> list[str]:
    """Shards of at most `max_shard_bytes` (one tensor may exceed it), plus the index when there are several.

    Shards are planned from the layouts, in the order given, then written one tensor at a time.
    """
    shards: list[list[TensorRef]] = [[]]
    size = 0
    for r in refs:
        if shards[-1] and size + r.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(r)
        size += r.nbytes
    n = len(shards)
    final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    tmp_paths = []
    for i, shard in enumerate(shards):
        tmp = out_dir / f".shard-{i:05d}.tmp"
        write_file(tmp, shard)
        tmp_paths.append(tmp)
    for tmp, name in zip(tmp_paths, final):
        os.replace(tmp, out_dir / name)
    if n > 1:
        index = {"metadata": {"total_size": sum(r.nbytes for shard in shards for r in shard)},
                 "weight_map": {r.name: final[i] for i, shard in enumerate(shards) for r in sorted(shard, key=lambda r: r.name)}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        final.append("model.safetensors.index.json")
    return final
