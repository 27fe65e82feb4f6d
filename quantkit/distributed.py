"""Calibration across processes, on torch.distributed: torchrun starts the ranks (gloo on the CPU, NCCL on
GPUs); quantkit only decides who does what and folds what they learn.

- **Split.** The calibration batch is cut into chunks of `calibration.batch_size` samples exactly as one
  process cuts it; chunk c belongs to rank c % world. Each rank runs only its chunks through each layer.
- **Fold in one order.** Everything the quantizers learn from the chunks (a group's Hessian, AWQ and
  SmoothQuant's |x| sums, maxima and sampled rows, the SQNR rows) is computed per chunk by its owner and
  folded on every rank in global chunk order: the same additions in the same order as one process makes.
  So the result does not depend on the world size (byte-identical to one process, given kernels that
  return the same bits for the same inputs, see docs/distributed.md).
  Hessian partials ([in, in] each) are exchanged as their chunks arrive (`ChunkFold(eager=True)`), small
  statistics are kept and exchanged after the forward.
- **Spread the solves.** The modules of a sequential group are dealt to ranks (largest first, to the least
  loaded); each solves its own and broadcasts the result, and every rank goes on with all of them.
- **Rank 0 writes.** The next layer's input is gathered to rank 0, which writes the work folder (the
  resume point, whole-batch, so a rerun may use any world size) and the export.

Tensors are exchanged as raw bytes with a small header (shapes, dtypes), never pickled.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

log = logging.getLogger("quantkit")

# the dtypes a header can name (codes are their index)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn]


@dataclass(frozen=True)
class Ranks:
    """This process's place in the conversion: rank, world size, and the device collectives use."""

    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def root(self) -> bool:
        return self.rank == 0

    def owner(self, chunk: int) -> int:
        return chunk % self.world


SINGLE = Ranks()


def launched_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the environment torchrun sets; (0, 1, 0) outside torchrun."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def join(device: torch.device) -> Ranks:
    """Join the process group torchrun set up (once per process): NCCL when this rank converts on a GPU,
    gloo on the CPU. Outside torchrun: the single-process Ranks."""
    import torch.distributed as dist

    rank, world, _ = launched_world()
    if world == 1:
        return SINGLE
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # a layer's work between two collectives can take long at 70B; a dead peer is noticed at once anyway
        dist.init_process_group(backend, timeout=timedelta(hours=2),
                                device_id=device if device.type == "cuda" else None)
        log.info("rank %d of %d joined (%s)", rank, world, backend)
    return Ranks(dist.get_rank(), dist.get_world_size(), device if device.type == "cuda" else torch.device("cpu"))


def leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ the chunk layout
@dataclass(frozen=True)
class ChunkLayout:
    """How the calibration batch is cut into chunks (as one process cuts it) and which are this rank's."""

    samples: tuple[int, ...]  # samples per chunk, in global order
    seq_len: int
    ranks: Ranks = SINGLE

    @classmethod
    def of(cls, n_samples: int, batch_size: int, seq_len: int, ranks: Ranks = SINGLE) -> "ChunkLayout":
        sizes = tuple(min(batch_size, n_samples - s) for s in range(0, n_samples, batch_size))
        return cls(sizes, seq_len, ranks)

    @property
    def n(self) -> int:
        return len(self.samples)

    def mine(self) -> list[int]:
        return list(range(self.ranks.rank, self.n, self.ranks.world))

    def tokens(self, chunk: int) -> int:
        return self.samples[chunk] * self.seq_len

    def token_offset(self, chunk: int) -> int:
        return sum(self.samples[:chunk]) * self.seq_len

    def local(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of a whole-batch tensor ([samples, ...]), concatenated in order."""
        if self.ranks.world == 1:
            return batch
        starts = [sum(self.samples[:c]) for c in range(self.n)]
        return torch.cat([batch[starts[c]:starts[c] + self.samples[c]] for c in self.mine()])

    def gather(self, local: torch.Tensor) -> torch.Tensor | None:
        """The whole batch on rank 0 from every rank's chunks (None elsewhere); `local` is this rank's chunks
        concatenated ([my samples, ...])."""
        if self.ranks.world == 1:
            return local
        import torch.distributed as dist

        r = self.ranks
        rows = iter(local.split([self.samples[c] for c in self.mine()]))
        out: list[torch.Tensor] = []
        for c in range(self.n):
            src = r.owner(c)
            if src == r.rank:
                piece = next(rows)
                if r.root:
                    out.append(piece)
                else:
                    dist.send(_bytes(piece.to(r.device).contiguous()), dst=0)
            elif r.root:
                buf = torch.empty((self.samples[c], *local.shape[1:]), dtype=local.dtype, device=r.device)
                dist.recv(_bytes(buf), src=src)
                out.append(buf.to(local.device))
        return torch.cat(out) if r.root else None

    def check(self, where: str) -> None:
        """Refuse a layout that leaves a rank without calibration chunks."""
        from quantkit.errors import QuantkitError

        if self.n < self.ranks.world:
            total = sum(self.samples)
            raise QuantkitError(
                f"{where}: {total} calibration samples in chunks of calibration.batch_size make {self.n} "
                f"chunk(s), fewer than the {self.ranks.world} ranks; set calibration.batch_size to at most "
                f"{max(1, total // self.ranks.world)} (--set calibration.batch_size=N) or use fewer processes")


# ---------------------------------------------------------------------------------------- exchanging
def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (any dtype travels through any backend)."""
    return t.reshape(-1).view(torch.uint8)


def share(tensors: list[torch.Tensor | None] | None, src: int, ranks: Ranks) -> list[torch.Tensor | None]:
    """Broadcast rank `src`'s tensors (None entries allowed) to every rank; others pass None. Returns the
    tensors (on `src`: its own, moved to the collective device only for the transfer)."""
    if ranks.world == 1:
        return list(tensors or [])
    import torch.distributed as dist

    dev = ranks.device
    if ranks.rank == src:
        send = [t.detach().to(dev).contiguous() if t is not None else None for t in tensors or []]
        head = [len(send)]
        for t in send:
            head += [-1] if t is None else [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        header = torch.tensor(head, dtype=torch.int64, device=dev)
        size = torch.tensor([header.numel()], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    if ranks.rank != src:
        header = torch.empty(int(size.item()), dtype=torch.int64, device=dev)
    dist.broadcast(header, src)
    if ranks.rank != src:
        h = header.tolist()
        send, k = [], 1
        for _ in range(h[0]):
            if h[k] == -1:
                send.append(None)
                k += 1
                continue
            dtype, ndim = _DTYPES[h[k]], h[k + 1]
            send.append(torch.empty(h[k + 2:k + 2 + ndim], dtype=dtype, device=dev))
            k += 2 + ndim
    for t in send:
        if t is not None and t.numel():
            dist.broadcast(_bytes(t), src)
    if ranks.rank == src:  # hand back the caller's own tensors, not the transfer copies
        return list(tensors or [])
    return send


def sum_across(tensors: list[torch.Tensor], ranks: Ranks) -> None:
    """Sum each tensor over every rank, in place (every rank then holds the same sums)."""
    if ranks.world == 1:
        return
    import torch.distributed as dist

    for t in tensors:
        moved = t.detach().to(ranks.device)
        dist.all_reduce(moved)
        if moved is not t:
            t.copy_(moved)


def encode_json(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def decode_json(t: torch.Tensor):
    return json.loads(bytes(t.cpu().tolist()).decode())


class ChunkFold:
    """Fold per-chunk contributions in global chunk order, identically on every rank.

    Call `add(payload)` once for each of this rank's chunks, in order (`index()` names the global chunk the
    next `add` is for), then `finish()` once. `fold(payload)` is called on every rank for every chunk, in
    global order, with that chunk's payload (a list of tensors) as its owner computed it.

    eager=True: the chunks of one round (one per rank) are exchanged as soon as this rank's chunk of that
    round arrives, so only one payload is held at a time (Hessian partials); callers must not interleave
    two eager folds. eager=False: payloads are kept until `finish()` (small statistics), so only the order
    of the `finish()` calls must agree between ranks.
    """

    def __init__(self, layout: ChunkLayout, fold: Callable[[list[torch.Tensor | None]], None], eager: bool):
        self.layout, self.fold, self.eager = layout, fold, eager
        self._mine = layout.mine()
        self._done = 0  # this rank's chunks added so far
        self._round = 0  # rounds exchanged so far
        self._kept: list[list[torch.Tensor | None]] = []

    def index(self) -> int:
        return self._mine[self._done]

    def add(self, payload: list[torch.Tensor | None]) -> None:
        self._done += 1
        r = self.layout.ranks
        if r.world == 1:
            self.fold(payload)
        elif self.eager:
            self._exchange_round(payload)
        else:
            self._kept.append(payload)

    def finish(self) -> None:
        r = self.layout.ranks
        if r.world == 1:
            return
        rounds = -(-self.layout.n // r.world)
        if self.eager:
            while self._round < rounds:  # the rounds this rank has no chunk in
                self._exchange_round(None)
            return
        kept = iter(self._kept)
        for c in range(self.layout.n):
            src = r.owner(c)
            self.fold(share(next(kept) if src == r.rank else None, src, r))
        self._kept = []

    def _exchange_round(self, payload) -> None:
        r = self.layout.ranks
        for src in range(r.world):
            c = self._round * r.world + src
            if c >= self.layout.n:
                break
            self.fold(share(payload if src == r.rank else None, src, r))
        self._round += 1


def deal(sizes: list[int], world: int) -> list[int]:
    """Owner rank per item: largest first, each to the least loaded rank (ties: the lower rank)."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += sizes[i]
    return owner


# ---------------------------------------------------------------------------------------- launching
def launch(nproc: int, args: list[str]) -> None:
    """`quantkit <args>` in `nproc` processes on this machine, as `torchrun --standalone --nproc-per-node
    nproc -m quantkit <args>` would start them (torch's elastic launcher, no restarts: a rerun resumes).
    On the CPU each rank gets cores / nproc threads unless OMP_NUM_THREADS says otherwise.
    Raises RankFailed when a rank fails (its own message is already on stderr)."""
    import signal
    import sys
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"quantkit-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.5,
                          local_addr="127.0.0.1")
    try:
        elastic_launch(config, sys.executable)("-m", "quantkit", *args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            raise RankFailed(f"rank {rank} of {nproc} was killed ({name}{'; out of memory?' if -code == 9 else ''}); "
                             "the others were stopped. Rerunning the same command resumes after the last finished "
                             "layer", 3) from None
        raise RankFailed(f"rank {rank} of {nproc} stopped with exit code {code} (its message is above); the others "
                         "were stopped", code) from None


class RankFailed(Exception):
    """One rank of a multi-process conversion failed; `exit_code` is the one to leave with."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
