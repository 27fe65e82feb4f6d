"""Where a conversion's time goes, phase by phase (the manifest's `conversion.phases_s`; benchmarks/roofline.py
sets each phase's seconds against its FLOPs and this machine's matmul peak).

Phases measured directly, summed over layers: `load` (a layer's tensors from the checkpoint into the compute
dtype), `capture` (the embedding and the first layer's inputs), `hessian` (X^T X of every group input that a
GPTQ-family stage needs, and H made whole once its chunks are in), `solve` (the quantizers), `diagnostics` (each
weight's SQNR), `transforms` (AWQ / SmoothQuant searches), `refine` (autoround's learned rounding), `save` (the
layer's results to the work folder, and each group's results made typed, codes and all, as it is solved).
`layer` is each layer's whole visit; `forward` is what is left of it once the phases inside are taken out: the
calibration forward through the layer (with the chunks' scheduling). On CUDA the clock is read after a
synchronize, so a phase is charged with the kernels it launched.

Memory the same way: at every phase boundary the process's peak RSS (VmHWM) is read, and what it grew since the
last boundary is charged to the innermost phase open in between (`layer`'s own share under `forward`), so
`peak_raised_mb` says which phase set each MB of the conversion's peak, above `peak_at_start_mb` (the imports,
the model skeleton and the calibration set, read when the first phase began).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable

from quantkit.io import peak_rss_bytes

INSIDE_LAYER = ("hessian", "solve", "diagnostics", "transforms", "refine", "save")


class PhaseTimes:
    """Seconds per phase, summed; `measure(name)` times a block (nesting is fine: `layer` holds the others)."""

    def __init__(self, sync: Callable[[], None] | None = None, peak: Callable[[], int | None] = peak_rss_bytes):
        self.seconds: dict[str, float] = defaultdict(float)
        self.raised: dict[str, int] = defaultdict(int)  # bytes of peak RSS growth charged to each phase
        self._sync, self._peak = sync, peak
        self._open: list[str] = []
        self._start: int | None = None
        self._last: int | None = None

    def _boundary(self) -> None:
        now = self._peak()
        if now is None:
            return
        if self._start is None:
            self._start = now
        elif self._open and now > self._last:
            self.raised["forward" if self._open[-1] == "layer" else self._open[-1]] += now - self._last
        self._last = now

    @contextlib.contextmanager
    def measure(self, phase: str):
        if self._sync is not None:
            self._sync()
        self._boundary()
        self._open.append(phase)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.seconds[phase] += time.perf_counter() - t0
            self._boundary()
            self._open.pop()

    def summary(self) -> dict[str, float]:
        """The phases in seconds (3 decimals), with `forward` derived from `layer` as the module docstring says."""
        out = {k: round(v, 3) for k, v in self.seconds.items()}
        if "layer" in self.seconds:
            inside = sum(self.seconds.get(k, 0.0) for k in INSIDE_LAYER)
            out["forward"] = round(max(self.seconds["layer"] - inside, 0.0), 3)
        return out

    def memory(self) -> dict:
        """Where the peak RSS grew: MB at the first phase, and MB of growth charged to each phase (1 decimal)."""
        if self._start is None:
            return {}
        return {"peak_at_start_mb": round(self._start / 1e6, 1),
                "peak_raised_mb": {k: round(v / 1e6, 1) for k, v in sorted(self.raised.items()) if v}}


def for_device(device) -> PhaseTimes:
    """A timer whose clock waits for the device's queued work (CUDA); plain wall time elsewhere."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return PhaseTimes(lambda: torch.cuda.synchronize(device))
    return PhaseTimes()
