"""The streaming safetensors writer and the lazy checkpoint reader: exact round trips, bounded memory."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantkit.export.shards import TensorRef, ref_from_tensor, refs_from_checkpoint, write_file, write_shards
from quantkit.model.checkpoint import LazyCheckpoint, materialize


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 7, generator=g),
        "b.weight": torch.randn(5, 64, generator=g).to(torch.bfloat16),
        "c.weight_packed": torch.randint(-2**31, 2**31 - 1, (12, 8), generator=g, dtype=torch.int32),
        "d.codes": torch.randint(-128, 127, (3, 5), generator=g, dtype=torch.int8),
        "e.fp8": torch.randn(4, 16, generator=g).to(torch.float8_e4m3fn),
        "f.flag": torch.tensor([True, False, True]),
        "g.scalar": torch.tensor(3.5, dtype=torch.float16),
        "h.empty": torch.zeros(0, 4),
        "i.long": torch.arange(7, dtype=torch.int64),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_single_file_reads_back_exactly(tmp_path: Path):
    ts = _tensors()
    files = write_shards(tmp_path, [ref_from_tensor(k, v) for k, v in ts.items()], 1 << 30)
    assert files == ["model.safetensors"]
    back = load_file(str(tmp_path / "model.safetensors"))
    assert set(back) == set(ts)
    for k in ts:
        assert _same(back[k], ts[k]), k
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert not list(tmp_path.glob(".*"))  # no temp file left


def test_same_tensors_as_the_library_writes(tmp_path: Path):
    """Whatever the header spelling, the library's own file and ours hold the same tensors at the same size."""
    ts = _tensors()
    save_file(ts, str(tmp_path / "lib.safetensors"))
    write_file(tmp_path / "ours.safetensors", [ref_from_tensor(k, v) for k, v in ts.items()])
    lib, ours = load_file(str(tmp_path / "lib.safetensors")), load_file(str(tmp_path / "ours.safetensors"))
    assert all(_same(lib[k], ours[k]) for k in ts)
    data = sum(t.numel() * t.element_size() for t in ts.values())
    for name in ("lib", "ours"):
        raw = (tmp_path / f"{name}.safetensors").read_bytes()
        header_len = int.from_bytes(raw[:8], "little")
        assert header_len % 8 == 0 and len(raw) == 8 + header_len + data


def test_sharding_and_index(tmp_path: Path):
    ts = {f"layer.{i}.weight": torch.full((256,), float(i)) for i in range(10)}  # 1 KiB each
    files = write_shards(tmp_path, [ref_from_tensor(k, v) for k, v in ts.items()], 3 * 1024)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) == 4 and shards[0] == "model-00001-of-00004.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 10 * 1024
    assert set(index["weight_map"]) == set(ts)
    for k, f in index["weight_map"].items():
        assert torch.equal(load_file(str(tmp_path / f))[k], ts[k])


def test_one_tensor_in_memory_at_a_time(tmp_path: Path):
    """The writer reads each tensor when it writes it and keeps no reference: at most one is alive."""
    alive: set[int] = set()
    most = [0]

    def reader(i: int):
        def read() -> torch.Tensor:
            t = torch.full((1024,), float(i))
            alive.add(i)
            weakref.finalize(t, alive.discard, i)
            most[0] = max(most[0], len(alive))
            return t
        return read

    refs = [TensorRef(f"t{i}", "F32", (1024,), reader(i)) for i in range(20)]
    write_shards(tmp_path, refs, 1 << 30)  # one shard holding all 20
    assert most[0] == 1
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["t7"], torch.full((1024,), 7.0))


def test_layout_mismatch_is_an_error(tmp_path: Path):
    ref = TensorRef("x", "F32", (4,), lambda: torch.zeros(5))
    with pytest.raises(ValueError, match="x: read F32 \\(5,\\), expected F32 \\(4,\\)"):
        write_file(tmp_path / "bad.safetensors", [ref])


def test_refs_from_checkpoint_read_lazily(tmp_path: Path):
    ts = _tensors()
    save_file(ts, str(tmp_path / "src.safetensors"))
    refs = {r.name: r for r in refs_from_checkpoint(LazyCheckpoint(tmp_path, [tmp_path / "src.safetensors"]))}
    assert {k: (r.dtype, r.shape) for k, r in refs.items()} == \
        {k: ({torch.float32: "F32", torch.bfloat16: "BF16", torch.int32: "I32", torch.int8: "I8",
              torch.float8_e4m3fn: "F8_E4M3", torch.bool: "BOOL", torch.float16: "F16", torch.int64: "I64"}[v.dtype],
             tuple(v.shape)) for k, v in ts.items()}
    assert _same(refs["b.weight"].read(), ts["b.weight"])
    assert refs["a.weight"].nbytes == 33 * 7 * 4


def _mapped(path: Path) -> bool:
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc to see memory maps")
def test_lazy_checkpoint_keeps_no_file_mapped(tmp_path: Path):
    """A mapped file's read pages count in RSS: the reader reads each tensor's bytes into its own memory, so
    no mapping exists even while the tensors it returned are alive (safetensors' own tensors are backed by
    one, which held every tensor twice while it was copied out)."""
    ts = {"x.weight": torch.randn(64, 64), "y.weight": torch.randn(8)}
    save_file(ts, str(tmp_path / "model.safetensors"))
    ckpt = LazyCheckpoint(tmp_path)
    assert ckpt.layout("x.weight") == ("F32", (64, 64))
    got = ckpt.get_many(["x.weight", "y.weight"])
    assert torch.equal(got["x.weight"], ts["x.weight"]) and torch.equal(ckpt.get("y.weight"), ts["y.weight"])
    assert not _mapped(tmp_path / "model.safetensors")
    got["x.weight"].add_(1.0)  # its own memory: writable, and the file is untouched
    assert torch.equal(ckpt.get("x.weight"), ts["x.weight"])
    del got
    layer = torch.nn.Linear(64, 64, bias=False, device="meta")
    materialize(layer, "x.", ckpt, torch.float32)  # same dtype as stored: the tensor read, no second copy
    assert torch.equal(layer.weight, ts["x.weight"]) and not _mapped(tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt"):  # the check can see a mapping
        assert _mapped(tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="'z.weight' not found"):
        ckpt.get("z.weight")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for VmHWM")
def test_peak_rss_is_the_process_own(tmp_path: Path):
    """A conversion started from a big parent must not report the parent's size (ru_maxrss would)."""
    import subprocess
    import sys

    ballast = bytearray(400 * 1024 * 1024)  # touched: resident in this (parent) process
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    out = subprocess.run([sys.executable, "-c", "from quantkit.io import peak_rss_bytes; print(peak_rss_bytes())"],
                         capture_output=True, text=True, check=True)
    child = int(out.stdout)
    assert 0 < child < 200 * 1024 * 1024, child  # a bare interpreter: tens of MB, not the parent's 400+
    del ballast


def test_every_dtype_reads_back_exactly_and_rows_alone(tmp_path: Path):
    """The reader against the safetensors library on every dtype the writer knows (empty and 0-d tensors
    included), and a tensor's rows read run by run against the whole tensor's."""
    ts = _tensors()
    save_file(ts, str(tmp_path / "model.safetensors"))
    ckpt = LazyCheckpoint(tmp_path)
    got = ckpt.get_many(list(ts))
    assert all(_same(got[k], ts[k]) for k in ts)
    rows = torch.tensor([0, 1, 2, 7, 9, 10, 32])
    assert _same(ckpt.get_rows("a.weight", rows), ts["a.weight"][rows])
    assert _same(ckpt.get_rows("a.weight", rows[:0]), ts["a.weight"][:0])


@pytest.mark.parametrize("kernel", ["copy_file_range", "fails after its first piece", "absent"])
def test_stored_tensors_are_copied_from_their_file_without_being_read_whole(tmp_path: Path, monkeypatch, kernel):
    """A ref that says where its bytes lie is copied from there: the export file is byte for byte the one
    written from the tensors, and the tensor itself is never made (its reader would fail). By the kernel's
    copy, by the buffered fallback where it fails part way (pieces of 40 bytes, so it does), or where there
    is none."""
    import os

    if kernel == "absent":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    elif kernel == "fails after its first piece":
        real, calls = os.copy_file_range, []

        def flaky(src, dst, count, offset_src=None):
            calls.append(count)
            if len(calls) > 1:
                raise OSError(18, "Invalid cross-device link")
            return real(src, dst, min(count, 40), offset_src)

        monkeypatch.setattr(os, "copy_file_range", flaky)
    ts = _tensors()
    save_file(ts, str(tmp_path / "src.safetensors"))
    ckpt = LazyCheckpoint(tmp_path, [tmp_path / "src.safetensors"])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_shards(tmp_path / "a", [ref_from_tensor(k, v) for k, v in ts.items()], 1 << 30)

    def never() -> torch.Tensor:
        raise AssertionError("read whole")

    spanned = [TensorRef(r.name, r.dtype, r.shape, never, r.span) for r in refs_from_checkpoint(ckpt)]
    assert all(r.span is not None for r in spanned)
    write_shards(tmp_path / "b", spanned, 1 << 30)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    if kernel == "fails after its first piece":
        assert len(calls) >= 2
    bad = TensorRef("a.weight", "F32", (33, 8), never, ckpt.stored_span("a.weight"))  # a layout the bytes do not fit
    with pytest.raises(ValueError, match="a.weight: 924 bytes stored in src.safetensors, 1056 expected"):
        write_file(tmp_path / "bad.safetensors", [bad])


def test_a_short_write_is_continued():
    """An unbuffered write() may take less than it is given: the writer goes on from where it stopped."""
    from quantkit.export.shards import _write_all

    class Trickle:
        def __init__(self):
            self.got = bytearray()

        def write(self, b):
            self.got += bytes(b[:7])
            return min(7, len(b))

    f, data = Trickle(), bytes(range(256)) * 3
    _write_all(f, data)
    assert bytes(f.got) == data
