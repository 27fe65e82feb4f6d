"""The model-free path (quantkit/quantize/streamed.py) against this disk: its throughput (source bytes / the
conversion's wall time) as a fraction of the disk's sequential read speed, and its peak memory against the
largest tensor. Prints one JSON document.

    python benchmarks/modelfree.py                          # toy shape, W8A8 RTN (seconds)
    python benchmarks/modelfree.py --run llama8b-2 --scheme W4A16 --nproc 2

A run is `<shape>-<layers>` of benchmarks/scale.py's shapes; its random bf16 checkpoint is written by
scale.py's `write_checkpoint` into --work (reused when there). The disk's sequential write speed (to the fsync)
and read speed are measured on a scratch file of --disk-mb in --work, written, fsynced and dropped from the page
cache with
posix_fadvise(POSIX_FADV_DONTNEED), then read in 16 MB blocks. The checkpoint's shards are dropped from the
cache the same way before the conversion, so both reads start cold (DONTNEED drops clean pages only; a
file system that ignores it reads from memory, which the JSON cannot tell apart: compare with --disk-mb of
more than this machine's free memory to be sure). `io_floor_s` is what the disk alone needs, the source read
once plus the export written once at those speeds; where writes are far slower than reads (a 2-core EPYC VM:
~300-650 MB/s sustained against 3-5 GB/s cold reads) it, not the read speed, bounds the throughput. The conversion runs as `quantkit convert --path streamed`
in its own process; peak RSS is its VmHWM (the manifest's), set against the import baseline scale.py measures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
BLOCK = 16 << 20


def drop_from_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_speed(path: Path) -> dict:
    """Sequential read of `path` from a cold cache, in MB/s."""
    drop_from_cache(path)
    t0, n = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(BLOCK)
        while (got := f.readinto(buf)):
            n += got
    seconds = time.perf_counter() - t0
    return {"bytes": n, "seconds": round(seconds, 3), "mb_per_s": round(n / seconds / 1e6, 1),
            "method": "posix_fadvise(POSIX_FADV_DONTNEED) after fsync, then read() in 16 MB blocks"}


def disk_speed(work: Path, mb: int) -> tuple[dict, dict]:
    """(read, write): the scratch file's write (16 MB blocks, then fsync: what the export's shards cost) and
    its cold read, each in MB/s."""
    scratch = work / "disk-speed.bin"
    block = os.urandom(BLOCK)
    t0, n = time.perf_counter(), 0
    with open(scratch, "wb", buffering=0) as f:
        for _ in range(max(1, mb * (1 << 20) // BLOCK)):
            n += f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    write = {"bytes": n, "seconds": round(seconds, 3), "mb_per_s": round(n / seconds / 1e6, 1),
             "method": "write() in 16 MB blocks, then fsync"}
    try:
        return read_speed(scratch), write
    finally:
        scratch.unlink()


def checkpoint_facts(model: Path) -> dict:
    from quantkit.model.checkpoint import LazyCheckpoint
    from quantkit.export.shards import element_size

    ckpt = LazyCheckpoint(model)
    sizes = {k: ckpt.numel(k) * element_size(ckpt.layout(k)[0]) for k in ckpt.keys()}
    linear = {k: v for k, v in sizes.items() if len(ckpt.layout(k)[1]) == 2 and "embed" not in k
              and not k.startswith("lm_head")}
    return {"source_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors")),
            "largest_tensor": max(sizes, key=sizes.get), "largest_tensor_bytes": max(sizes.values()),
            "largest_quantized_bytes": max(linear.values())}


def convert(model: Path, out: Path, scheme: str, nproc: int) -> tuple[dict, float]:
    import yaml

    stage = {"method": "rtn", "scheme": scheme, **({"group_size": 128} if scheme.startswith("W4A16") else {})}
    recipe = {"name": out.name, "model": {"path": str(model), "dtype": "bfloat16"}, "stages": [stage],
              "export": {"max_shard_size_mb": 4096}}
    rfile = out.with_suffix(".yaml")
    rfile.write_text(yaml.safe_dump(recipe))
    for shard in model.glob("*.safetensors"):
        drop_from_cache(shard)
    env = {**os.environ, "QUANTKIT_NO_TRACK": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "quantkit", "convert", str(rfile), "-o", str(out), "--overwrite", "-q",
           "--preflight", "off", "--path", "streamed", "--nproc", str(nproc)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"conversion failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((out / "manifest.json").read_text()), wall


def run(work: Path, shape_layers: str, scheme: str, nproc: int, disk_mb: int) -> dict:
    from scale import import_baseline_mb, write_checkpoint

    shape, layers = shape_layers.rsplit("-", 1)
    model = write_checkpoint(work / f"{shape}-{layers}", shape, int(layers))
    facts = checkpoint_facts(model)
    disk, disk_write = disk_speed(work, disk_mb)
    man, process_wall = convert(model, work / f"{shape}-{layers}-{scheme.lower()}-streamed", scheme, nproc)
    conv = man["conversion"]
    mb_s = facts["source_bytes"] / conv["wall_time_s"] / 1e6
    # what this disk alone needs: the source read once and the export written once, one after the other
    io_floor_s = facts["source_bytes"] / 1e6 / disk["mb_per_s"] + man["size_bytes"] / 1e6 / disk_write["mb_per_s"]
    imports = import_baseline_mb(work / "import-baseline-mb.txt")
    peak_mb = conv["peak_rss_bytes"] / 1e6
    return {
        "run": shape_layers, "scheme": scheme, "nproc": nproc, "path": conv["path"], "cpu_count": os.cpu_count(),
        "disk_read": disk, "disk_write": disk_write, **facts,
        "conversion": {"wall_time_s": conv["wall_time_s"], "process_wall_s": round(process_wall, 2),
                       "phases_s": conv["phases_s"], "throughput_mb_per_s": round(mb_s, 1),
                       "fraction_of_disk_read": round(mb_s / disk["mb_per_s"], 3), "aim_fraction": 0.70,
                       "io_floor_s": round(io_floor_s, 2), "fraction_of_io_floor": round(io_floor_s / conv["wall_time_s"], 3)},
        "memory": {"peak_rss_mb": round(peak_mb), "imports_mb": round(imports),
                   "above_imports_mb": round(peak_mb - imports),
                   "above_imports_per_largest_tensor": round((peak_mb - imports) * 1e6 / facts["largest_tensor_bytes"], 2),
                   "above_imports_per_largest_quantized": round((peak_mb - imports) * 1e6
                                                                / facts["largest_quantized_bytes"], 2),
                   "note": "rank 0's VmHWM (the manifest's); the import baseline as benchmarks/scale.py measures it"},
        "artifact_bytes": man["size_bytes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="toy-2", help="<shape>-<layers> of benchmarks/scale.py (llama8b-2: the 8B shape)")
    ap.add_argument("--scheme", default="W8A8", help="an RTN scheme: W8A8, W4A16 (g128), W4A16_ASYM, FP8_DYNAMIC, NVFP4A16")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--disk-mb", type=int, default=1024, help="size of the scratch file the read speed is measured on")
    ap.add_argument("--work", type=Path, default=None, help="checkpoints and outputs (default: a temporary folder)")
    args = ap.parse_args()
    if args.work is None:
        with tempfile.TemporaryDirectory(prefix="qk-modelfree-", dir=REPO / "runs" if (REPO / "runs").is_dir() else None) as t:
            out = run(Path(t), args.run, args.scheme, args.nproc, args.disk_mb)
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        out = run(args.work, args.run, args.scheme, args.nproc, args.disk_mb)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
