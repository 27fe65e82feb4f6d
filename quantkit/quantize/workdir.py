"""The resume folder of a conversion (`.<output>.partial/work/`): per layer, the modules' compressed
tensors (safetensors) and stats (JSON), the next layer's input, and state.json naming the next layer.

Every file is written under a temporary name and renamed, and state.json moves on only after a layer's
files are in place, so `kill -9` at any point leaves a state a rerun continues from byte-identically.
A changed recipe, model or calibration set is refused (or discarded with --restart).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantkit.io import atomic_write_json
from quantkit.plan import ConvertError
from quantkit.quantize.contract import ModuleResult


class WorkDir:
    """Resume state: per-layer compressed tensors + stats, the next layer's input, and a state file."""

    def __init__(self, root: Path):
        self.root = root
        self.layers = root / "layers"

    def state(self) -> dict | None:
        p = self.root / "state.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def start(self, fingerprint: dict, restart: bool) -> int:
        st = self.state()
        if st is not None and st["fingerprint"] != fingerprint:
            if not restart:
                changed = [k for k in fingerprint if st["fingerprint"].get(k) != fingerprint[k]]
                raise ConvertError(
                    f"{self.root}: an unfinished conversion with a different {', '.join(changed)} is here; "
                    "run again with --restart to discard it, or choose another --output")
            st = None
        if st is None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.layers.mkdir(parents=True)
            atomic_write_json(self.root / "state.json", {"fingerprint": fingerprint, "next_layer": 0})
            return 0
        return int(st["next_layer"])

    def save_layer(self, index: int, results: list[ModuleResult], hidden: torch.Tensor | None) -> None:
        tensors = {k: v for r in results for k, v in r.tensors.items()}
        tmp = self.layers / f".{index:05d}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(self.layers / f"{index:05d}.safetensors")
        atomic_write_json(self.layers / f"{index:05d}.json", {r.name: r.stats for r in results})
        if hidden is not None:
            tmp = self.root / f".hidden-{index + 1:05d}.tmp"
            save_file({"hidden": hidden.contiguous()}, str(tmp))
            tmp.replace(self.root / f"hidden-{index + 1:05d}.safetensors")
        st = self.state()
        st["next_layer"] = index + 1
        atomic_write_json(self.root / "state.json", st)
        old = self.root / f"hidden-{index:05d}.safetensors"
        old.unlink(missing_ok=True)

    def hidden(self, index: int) -> torch.Tensor:
        return load_file(str(self.root / f"hidden-{index:05d}.safetensors"))["hidden"]

    def layer_files(self, n: int) -> list[Path]:
        return [self.layers / f"{i:05d}.safetensors" for i in range(n)]

    def layer_stats(self, n: int) -> dict[str, dict]:
        stats: dict[str, dict] = {}
        for i in range(n):
            stats.update(json.loads((self.layers / f"{i:05d}.json").read_text()))
        return stats
