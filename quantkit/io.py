"""Small file helpers: atomic writes, checksums, peak memory."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def quantkit_home() -> Path:
    """Where quantkit keeps demo models, the embedded registry and caches (QUANTKIT_HOME)."""
    return Path(os.environ.get("QUANTKIT_HOME") or Path.home() / ".cache" / "quantkit").expanduser().resolve()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | Path, data: Any) -> None:
    """JSON written atomically (temp + rename); values JSON has no type for (paths) are written as str."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name beside `final`; rename it into place only on success.

    A crash leaves at most `.<name>.tmp-*` behind, never a half-written folder under the final name.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists (choose another output, or remove it first)")
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    tmp.chmod(0o755)
    try:
        yield tmp
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src: Path, final: Path) -> None:
    """Move a finished folder to `final`, replacing an old one with two renames (never a gap of junk)."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(src, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, final)
    fsync_dir(final.parent)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process.

    Linux's VmHWM, not `ru_maxrss`: a process started by fork + exec inherits its parent's
    `ru_maxrss` (the forked copy's size is kept across exec), so a small conversion started from a
    big parent would report the parent's size.
    """
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_large_allocations_off_the_heap(threshold: int = 1 << 20) -> None:
    """Serve every allocation of `threshold` bytes or more with its own mmap (glibc; a no-op elsewhere).

    glibc raises its mmap threshold each time a large block is freed (up to 32 MB), so as layers go by
    more and more tensors land in the heap, where freed space fragments and the peak creeps up: on a
    16-layer model the per-layer peak grew by ~30 MB a layer. A fixed threshold keeps each tensor's
    memory returned to the OS the moment it is freed (measured: 16 vs 4 layers, +10 MB instead of +116 MB).
    The price is a page fault per fresh page of each large tensor: measured on SmolLM2 GPTQ with chunks of
    8 samples, 1 MB gave 146 s / 1064 MB, 32 MB 119 s / 1310 MB, glibc's default 127 s / 1339 MB.
    The trim threshold (free space at the heap's top above which free() gives it back) is set to twice
    that, glibc's own rule while its thresholds are dynamic: fixed, so what a freed block does no longer
    depends on what ran before (a trim threshold left high by the model's loading, or glibc's 128 KB).
    """
    global _heap_threshold
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 2 * threshold)  # M_TRIM_THRESHOLD
        _heap_threshold = threshold


_heap_threshold: int | None = None  # what keep_large_allocations_off_the_heap last set (None: glibc's own)


@contextlib.contextmanager
def reusing_freed_memory(threshold: int = 32 << 20):
    """For work that allocates the same large tensors again and again (a layer's chunks, autoround's steps):
    glibc keeps freed blocks under `threshold` (32 MB, the most its own dynamic threshold reaches) and hands
    them out again, instead of a fresh mmap and a page fault per 4 KB page each time. On exit the threshold
    set before by keep_large_allocations_off_the_heap is back (none set: this one stays) and the freed heap
    goes back to the OS. The layer walk runs each layer inside it (the chunks of a layer repeat their
    allocations; the heap is trimmed after every layer, so nothing creeps up across layers).
    Measured on 2 AMX cores: SmolLM2 autoround layer 0 (20 steps of 8 x 512 tokens, bf16) 2.7 M page faults and
    5.0 s under the 1 MB threshold, 0.2 M and 3.4 s inside this; with the walk's layers inside it (and the trim
    threshold fixed), SmolLM2 GPTQ W4A16 (32 x 512, bf16) 61.8 -> 48.6 s, peak RSS 1,107 -> 1,300 MB; one
    Llama-3.1-8B-shape layer (GPTQ W4A16 g128, 8 x 512) 64.2 -> 47.7 s (solve 34.8 -> 28.6 s), 5,494 -> 5,648 MB."""
    before = _heap_threshold
    keep_large_allocations_off_the_heap(threshold)
    try:
        yield
    finally:
        if before is not None:
            keep_large_allocations_off_the_heap(before)
        release_free_memory()


@contextlib.contextmanager
def giving_back_freed_memory():
    """Inside reusing_freed_memory, a stretch of loops whose freed heap goes back to the OS between their blocks
    (`give_back_free_memory`, a no-op outside), the heap trimmed on entry and exit. For a large group's solve and
    its output-SQNR signal: glibc serves small requests by splitting a large free chunk from where its last split
    ended, so the loops' short-lived allocations walk forward through the free heap and touch page after page
    of it; on an 8B layer the heap's resident pages grew by 140 MB over down_proj's signal and solve while
    what it held grew by 6 MB, beside the 822 MB factor."""
    global _giving_back
    was, _giving_back = _giving_back, True
    release_free_memory()
    try:
        yield
    finally:
        _giving_back = was
        release_free_memory()


_giving_back = False  # inside giving_back_freed_memory


def give_back_free_memory() -> None:
    """Inside giving_back_freed_memory, the heap's free pages back to the OS now (~3 ms on 2 cores beside an 8B
    layer's heap); a no-op outside."""
    if _giving_back:
        release_free_memory()


def release_free_memory() -> None:
    """Give freed heap memory back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    Each layer allocates and frees tensors of many sizes; glibc keeps the freed chunks in its arenas,
    so without this the resident set creeps up layer after layer although nothing is alive.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def cached_sha256(path: Path) -> str:
    """sha256 of a file, cached in QUANTKIT_HOME/hash-cache.json by (resolved path, size, mtime)."""
    return cached_sha256_many([path])[0]


def cached_sha256_many(paths: list[Path]) -> list[str]:
    cache_file = quantkit_home() / "hash-cache.json"
    try:
        cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    except (OSError, ValueError):  # a damaged cache is only a cache
        cache = {}
    out, changed = [], False
    for p in paths:
        st = Path(p).stat()
        key = f"{Path(p).resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            cache[key] = sha256_file(p)
            changed = True
        out.append(cache[key])
    if changed:
        with contextlib.suppress(OSError):
            atomic_write_json(cache_file, cache)
    return out


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over the model's weight/config files (each file's hash cached by path, size and mtime)."""
    files = [p for p in sorted(model_dir.iterdir())
             if p.is_file() and p.suffix in (".safetensors", ".json") and p.name != "quantkit_source.json"]
    return hashlib.sha256("\n".join(f"{p.name}:{h}" for p, h in zip(files, cached_sha256_many(files))).encode()).hexdigest()
