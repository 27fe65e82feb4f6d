"""What the peers' anchors (anchor_llmcompressor.py, anchor_autoround.py, anchor_gptqmodel.py) and accuracy.py share:
the demo model with the calibration tokens they all quantize from, and running a peer's script in its own venv."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RECIPE = "recipes/smollm2-w4a16-gptq.yaml"


def demo_calibration(samples: int, seq_len: int | None = None):
    """(the demo model's folder, the calibration set of RECIPE with `samples` samples of `seq_len` tokens, default
    the recipe's 512): the same token ids for every row and peer."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from quantkit.data import build_calibration_set
    from quantkit.model.sources import ensure_demo_model
    from quantkit.recipe import load_recipe

    overrides = [f"calibration.num_samples={samples}"] + ([f"calibration.seq_len={seq_len}"] if seq_len else [])
    model_dir = ensure_demo_model("smollm2-135m", quiet=True)
    return model_dir, build_calibration_set(load_recipe(REPO / RECIPE, overrides).calibration,
                                            AutoTokenizer.from_pretrained(model_dir))


def first_ids(ids: torch.Tensor, nsamples: int, seqlen: int) -> torch.Tensor:
    """The first `nsamples` x `seqlen` of int64 token ids [samples, seq_len], contiguous (an error if shorter)."""
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] < nsamples or ids.shape[1] < seqlen:
        raise ValueError(f"need int64 ids of at least [{nsamples}, {seqlen}], got {ids.dtype} {list(ids.shape)}")
    return ids[:nsamples, :seqlen].contiguous()


def run_child(python: str, code: str, args: list[str], what: str, cwd: Path | None = None) -> tuple[dict, str, float]:
    """`python -c code *args` (a peer's script in its venv): (the JSON its last stdout line holds, its stderr, wall
    seconds); a RuntimeError naming `what`, with the end of its stderr, if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, cwd=cwd)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, wall
