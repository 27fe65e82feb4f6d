"""The model-free path: each quantized weight streamed from the source safetensors to the export on its own,
for recipes whose every stage is a quantizer that needs no data (RTN), without a calibration section or a
KV-cache scheme. No decoder layer is materialized and no forward runs; the meta skeleton is built only for
the plan (which Linears the recipe's targets / ignore name), so any architecture the plan can name works.

    per quantized module (dealt to ranks, largest first):  read W -> quantize -> compress -> work/tensors/<module>
    then rank 0:  write_shards(kept source tensors + the modules' compressed tensors) -> config, manifest

Each step is the layer path's own code, in the same order, so the export is byte-identical to it: the weight
is cast to the compute dtype as the layer path materializes it, quantized by the target's registered quantizer
(the same call and arguments as `quantize_group`), its stats computed the same way, and compressed by
`compress_by_rows` (what `compress_results` calls on the decoded typed result, which equals the quantizer's
result exactly: the typed form is checked on its grid when it is written). The compressed tensors are listed
to the shard writer in the order the layer path's compressed layer files give them (layer by layer, sorted
within a layer), so the shards are cut at the same tensors.

Memory is one weight and its quantized forms at a time (the shard writer holds one tensor too). Resumable: a
module's file is written under a temporary name and renamed (quantkit/quantize/workdir.py), and a rerun skips
the modules whose file exists, under any number of processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from quantkit.algorithms.contract import Observations
from quantkit.algorithms.registry import QuantizerMethod
from quantkit.distributed import SINGLE, Ranks, deal, share, sum_across
from quantkit.export.compressed_tensors import compress_by_rows
from quantkit.io import keep_large_allocations_off_the_heap, release_free_memory
from quantkit.model.checkpoint import LazyCheckpoint
from quantkit.plan import Plan, Target
from quantkit.quantize.layers import weight_stats
from quantkit.quantize.timing import PhaseTimes
from quantkit.quantize.workdir import WorkDir

STREAMED, LAYERS = "streamed", "layers"  # the manifest's conversion.path
PATHS = ("auto", LAYERS, STREAMED)  # what a conversion may ask for (auto: streamed whenever it can)
PATH_ENV = "QUANTKIT_CONVERT_PATH"  # where it asks (quantkit convert --path sets it, so every rank sees it)


def why_not_streamed(plan: Plan, source: LazyCheckpoint) -> str | None:
    """None when every quantized module can be converted on its own from the stored checkpoint; else why the
    layer path is needed (for the log, and the error when the streamed path was asked for)."""
    if plan.calibration is not None:
        return "the recipe has a calibration section (the layer path runs it for the output-SQNR diagnostics)"
    if plan.kv_cache is not None:
        return "kv_cache scales are calibrated in the layer forward"
    if source.summary is not None:
        return "the model is read through a rewritten view (a rotation)"
    for ps in plan.stages:
        m = ps.method
        if not isinstance(m, QuantizerMethod) or m.needs != "nothing" or m.refine_layer is not None:
            return f"stages[{ps.index}] ({m.name}) works on whole layers or needs data"
    for t in plan.targets.values():
        key = t.name + ".weight"
        if key not in source or len(source.layout(key)[1]) != 2:
            return f"{key} is not stored as one 2-D tensor in the checkpoint"
    return None


@dataclass(frozen=True)
class TensorJob:
    """What every module of one streamed conversion shares."""

    plan: Plan
    source: LazyCheckpoint
    device: torch.device  # where the quantizer runs (the layer path's device)
    compute: torch.dtype  # the weight is cast to it first, as the layer path materializes a layer
    scale_dtype: torch.dtype  # the model's dtype: scales are stored in it
    ranks: Ranks = SINGLE
    on_weight: Callable[[str, torch.Tensor], None] | None = None  # quantkit.convert.convert's public hook
    timing: PhaseTimes = field(default_factory=PhaseTimes)  # seconds per phase (quantkit/quantize/timing.py)


def quantize_one(job: TensorJob, t: Target) -> tuple[dict[str, torch.Tensor], dict]:
    """One module: its export tensors (compressed-tensors names) and the manifest's stats for it."""
    with job.timing.measure("load"):
        # (a tensor of its own, read from the file: cast to the compute dtype without another copy)
        w = job.source.get(t.name + ".weight").to(device=job.device, dtype=job.compute).float()
    t0 = time.perf_counter()
    with job.timing.measure("solve"):
        q = t.quantizer.quantize([w], Observations(), t.scheme.weights, t.stage.config, job.scale_dtype)[0]
    seconds = time.perf_counter() - t0
    with job.timing.measure("diagnostics"):
        stats = weight_stats(t.stage.index, t.quantizer.name, t.scheme.name, w, q, seconds)
    del w
    if job.on_weight is not None:
        job.on_weight(t.name, q.weight.detach().cpu().clone())
    with job.timing.measure("compress"):  # on the CPU, as the layer path's export compresses
        cpu = [x.cpu() if x is not None else None for x in (q.weight, q.scale, q.zero_point, q.g_idx, q.global_scale)]
        del q
        w, scale, zp = cpu[0], cpu[1], cpu[2]  # a block of rows at a time, as the layer path's export compresses
        tensors = compress_by_rows(t.name, tuple(w.shape), lambda r: (w[r], scale[r], zp[r] if zp is not None else None),
                                   cpu[3], t.ct_scheme, job.scale_dtype, cpu[4])
    return tensors, stats


def quantize_tensors(job: TensorJob, work: WorkDir, quiet: bool = False) -> int:
    """This rank's modules (dealt largest first), each saved in `work` as it finishes; every rank calls it after
    rank 0 has prepared `work`, and returns once every rank's modules are saved. Returns the number of modules
    already finished before this run (meaningful on rank 0)."""
    r = job.ranks
    targets = list(job.plan.targets.values())
    resumed = sum(work.tensor_file(t.name).is_file() for t in targets)
    if r.world > 1:
        share([torch.zeros(1)], 0, r)  # rank 0 has prepared the work folder
    owner = deal([job.source.numel(t.name + ".weight") for t in targets], r.world)
    todo = [t for t, o in zip(targets, owner) if o == r.rank and not work.tensor_file(t.name).is_file()]
    keep_large_allocations_off_the_heap()
    for t in tqdm(todo, desc="tensors", unit="tensor", disable=quiet or not r.root):
        tensors, stats = quantize_one(job, t)
        with job.timing.measure("save"):
            work.save_tensor(t.name, tensors, stats)
        del tensors
        release_free_memory()
    if r.world > 1:
        sum_across([torch.zeros(1)], r)  # every rank's modules are saved
    return resumed


class LayerOrdered(LazyCheckpoint):
    """The per-module work files read as one checkpoint whose keys come in the order the layer path's
    compressed layer files give them: layer by layer, sorted within a layer (as safetensors lists a file's
    keys), so the shard writer cuts the shards at the same tensors."""

    def __init__(self, folder: Path, layers: list[list[Path]]):
        super().__init__(folder, [f for files in layers for f in files])
        layer_of = {f: i for i, files in enumerate(layers) for f in files}
        self._order = sorted(self._where, key=lambda k: (layer_of[self._where[k]], k))

    def keys(self) -> list[str]:
        return list(self._order)


def produced(plan: Plan, work: WorkDir) -> LayerOrdered:
    """Every module's export tensors, from the work folder, in the layer path's order."""
    return LayerOrdered(work.tensors, [[work.tensor_file(t.name) for t in lp.targets] for lp in plan.layers])


def module_stats(plan: Plan, work: WorkDir) -> dict[str, dict]:
    """The manifest's per-module stats, from the work files' metadata."""
    return {t.name: work.tensor_stats(t.name) for t in plan.targets.values()}
