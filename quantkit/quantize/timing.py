"""Where a conversion's time goes, phase by phase (the manifest's `conversion.phases_s`; benchmarks/roofline.py
sets each phase's seconds against its FLOPs and this machine's matmul peak).

Phases measured directly, summed over layers: `load` (a layer's tensors from the checkpoint into the compute
dtype), `capture` (the embedding and the first layer's inputs), `hessian` (X^T X of every group input that a
GPTQ-family stage needs), `solve` (the quantizers), `diagnostics` (each weight's SQNR), `transforms` (AWQ /
SmoothQuant searches), `refine` (autoround's learned rounding), `save` (the layer's results to the work folder).
`layer` is each layer's whole visit; `forward` is what is left of it once the phases inside are taken out: the
calibration forward through the layer (with the chunks' scheduling). On CUDA the clock is read after a
synchronize, so a phase is charged with the kernels it launched.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable

INSIDE_LAYER = ("hessian", "solve", "diagnostics", "transforms", "refine", "save")


class PhaseTimes:
    """Seconds per phase, summed; `measure(name)` times a block (nesting is fine: `layer` holds the others)."""

    def __init__(self, sync: Callable[[], None] | None = None):
        self.seconds: dict[str, float] = defaultdict(float)
        self._sync = sync

    @contextlib.contextmanager
    def measure(self, phase: str):
        if self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.seconds[phase] += time.perf_counter() - t0

    def summary(self) -> dict[str, float]:
        """The phases in seconds (3 decimals), with `forward` derived from `layer` as the module docstring says."""
        out = {k: round(v, 3) for k, v in self.seconds.items()}
        if "layer" in self.seconds:
            inside = sum(self.seconds.get(k, 0.0) for k in INSIDE_LAYER)
            out["forward"] = round(max(self.seconds["layer"] - inside, 0.0), 3)
        return out


def for_device(device) -> PhaseTimes:
    """A timer whose clock waits for the device's queued work (CUDA); plain wall time elsewhere."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return PhaseTimes(lambda: torch.cuda.synchronize(device))
    return PhaseTimes()
