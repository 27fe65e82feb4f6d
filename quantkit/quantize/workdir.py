"""The resume folder of a conversion (`.<output>.partial/work/`): per layer, the modules' typed results
(safetensors) and stats (JSON), the next layer's input, and state.json naming the next layer; on the
model-free path (quantkit/quantize/streamed.py) instead one file per finished module in `tensors/`.

A layer file holds, per quantized module, its codes (`<module>.codes`: int8 for integer schemes, e4m3 for
fp8), `<module>.scale` (fp32, holding values exact in the storage dtype), `<module>.zero_point` (int8,
asymmetric only) and `<module>.g_idx` (int32, only when the export carries it), plus the float tensors a
transform rewrote under their parameter names and, with a recipe `kv_cache`, the layer's fp32 k/v-cache
scales under their export names (`...self_attn.k_scale`), which the export passes through. This is the internal form every later step reads (QAT
starts from it and writes it back); only the export compresses it, once, into compressed-tensors.

Every file is written under a temporary name and renamed, and state.json moves on only after a layer's
files are in place, so `kill -9` at any point leaves a state a rerun continues from byte-identically.
A changed recipe, model or calibration set is refused (or discarded with --restart).
"""

from __future__ import annotations

import json
import shutil
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantkit.algorithms.rtn import dequantize_codes, quantize_codes, rows_per_block
from quantkit.io import atomic_write_json
from quantkit.plan import ConvertError, LayerPlan
from quantkit.algorithms.contract import ModuleResult, QuantizedWeight
from quantkit.schemes import WeightSpec

TYPED_FIELDS = ("codes", "scale", "zero_point", "g_idx", "global_scale")


def encode_weight(name: str, q: QuantizedWeight, spec: WeightSpec) -> dict[str, torch.Tensor]:
    """One module's typed quantization as tensors of their own (its codes, not the dequantized weight: 1 byte
    per weight), a block of rows at a time (the fp32 temporaries stay ~16 MB whatever the weight's size); each
    block is checked to dequantize back to exactly the weight."""
    cols = q.columns()  # [in] column -> group
    out_f, in_f = q.weight.shape
    codes = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn if spec.type == "float" else torch.int8)
    step = rows_per_block(in_f)
    for r in range(0, out_f, step):
        w = q.weight[r:r + step].float()
        s = q.scale[r:r + step].float()[:, cols]  # [rows, in]
        z = q.zero_point[r:r + step].float()[:, cols] if q.zero_point is not None else None
        c = quantize_codes(w, s, z, spec)  # fp32 code values
        if not torch.equal(dequantize_codes(c, s, z, spec), w):
            raise ConvertError(f"{name}: the quantized weight is not on its own grid (internal error)")
        codes[r:r + step] = c.cpu()
    out = {f"{name}.codes": codes, f"{name}.scale": q.scale.float()}
    if q.zero_point is not None:
        out[f"{name}.zero_point"] = q.zero_point.to(torch.int8)
    if q.g_idx is not None:
        out[f"{name}.g_idx"] = q.g_idx.to(torch.int32)
    if q.global_scale is not None:
        out[f"{name}.global_scale"] = q.global_scale.float().reshape(1)
    return {k: v.detach().cpu().contiguous().clone() if k != f"{name}.codes" else v for k, v in out.items()}


def compact(r: ModuleResult, spill: Path | None = None) -> None:
    """Hold a module's result in its typed form from now on (the dequantized fp32 weight is dropped): for a
    Llama-3.1-8B-shape layer 218 MB instead of 872 MB while the later groups are solved. With `spill` (a
    folder), the typed tensors wait there on disk instead (`SpilledTyped`) until the layer is saved."""
    if r.typed is None:
        r.typed, r.weight = encode_weight(r.name, r.weight, r.spec), None
    if spill is not None and not isinstance(r.typed, SpilledTyped):
        r.typed = SpilledTyped(spill / f"{r.name}.safetensors", r.typed)


class SpilledTyped(Mapping):
    """A module's typed tensors kept in a file of their own until the layer is saved, read back (each into its
    own memory, not through a memory map) when asked for; the file goes when this object does.

    What it is for: a layer's earlier groups' codes are held while its later groups are solved, and on an
    8B-shape layer the last solve (down_proj: its 822 MB factor beside the weight's fp32 copy) is where the
    conversion's peak sits; q/k/v/o and gate/up's codes are 151 MB of it. Written ones sit in the page cache,
    which the kernel may drop, not in the process's resident set."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]):
        from quantkit.model.checkpoint import LazyCheckpoint

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(dict(tensors), str(tmp))
        tmp.replace(path)
        self.path, self._file = path, LazyCheckpoint(path.parent, files=[path])
        weakref.finalize(self, path.unlink, missing_ok=True)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._file.get(key)  # (KeyError, naming the file, for a key it does not hold)

    def __iter__(self):
        return iter(self._file.keys())

    def __len__(self) -> int:
        return len(self._file.keys())


def encode_result(r: ModuleResult) -> dict[str, torch.Tensor]:
    """One module's typed result and the float tensors it carries (`rewritten`), as tensors of their own."""
    out = dict(r.typed) if r.typed is not None else encode_weight(r.name, r.weight, r.spec)
    out.update({k: v.detach().cpu().contiguous().clone() for k, v in r.rewritten.items()})
    return out


def decode_weight(tensors: dict[str, torch.Tensor], name: str, spec: WeightSpec,
                  rows: slice = slice(None)) -> QuantizedWeight:
    """The QuantizedWeight a layer file holds for module `name` (weight dequantized exactly, fp32), or for the
    block `rows` of its rows (g_idx and the global scale are the whole weight's: they are per column / tensor)."""
    codes, zp, g_idx = tensors[f"{name}.codes"][rows].float(), tensors.get(f"{name}.zero_point"), tensors.get(f"{name}.g_idx")
    zp = zp[rows] if zp is not None else None
    gs = tensors.get(f"{name}.global_scale")
    q = QuantizedWeight(codes, tensors[f"{name}.scale"][rows].float(), zp.float() if zp is not None else None,
                        g_idx.long() if g_idx is not None else None,  # weight holds the codes until dequantized
                        global_scale=gs.float().reshape(()) if gs is not None else None)
    cols = q.columns()  # [in] column -> group
    q.weight = dequantize_codes(codes, q.scale[:, cols], q.zero_point[:, cols] if zp is not None else None, spec)
    return q


def split_layer(tensors: dict[str, torch.Tensor], layer: LayerPlan) -> tuple[dict[str, torch.Tensor],
                                                                              dict[str, torch.Tensor]]:
    """A layer file's tensors: (the modules' typed fields, the float tensors a transform rewrote)."""
    own = {f"{t.name}.{f}" for t in layer.targets for f in TYPED_FIELDS}
    return ({k: v for k, v in tensors.items() if k in own}, {k: v for k, v in tensors.items() if k not in own})


def decode_layer(tensors: dict[str, torch.Tensor], layer: LayerPlan) -> tuple[dict[str, QuantizedWeight],
                                                                               dict[str, torch.Tensor]]:
    """A layer file's typed results by module name, and the float tensors a transform rewrote."""
    typed, rewritten = split_layer(tensors, layer)
    return {t.name: decode_weight(typed, t.name, t.scheme.weights) for t in layer.targets}, rewritten


class WorkDir:
    """Resume state: per-layer compressed tensors + stats, the next layer's input, and a state file."""

    def __init__(self, root: Path):
        self.root = root
        self.layers = root / "layers"

    def state(self) -> dict | None:
        p = self.root / "state.json"
        return json.loads(p.read_text()) if p.is_file() else None

    @property
    def spill(self) -> Path:
        """Where a layer's large typed results wait for the layer's save (`SpilledTyped`): scratch, emptied
        whenever a conversion starts or resumes here."""
        return self.root / "spill"

    def start(self, fingerprint: dict, restart: bool) -> int:
        shutil.rmtree(self.spill, ignore_errors=True)
        st = self.state()
        if st is not None and st["fingerprint"] != fingerprint:
            if not restart:
                changed = [k for k in sorted({*fingerprint, *st["fingerprint"]})
                           if st["fingerprint"].get(k) != fingerprint.get(k)]
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

    def save_layer(self, index: int, results: list[ModuleResult], hidden: torch.Tensor | None,
                   float_hidden: torch.Tensor | None = None) -> None:
        """One layer's results and the next layer's input (and the float model's activations there, where the
        conversion carries them), then the state moved on: the resume point."""
        save_typed(self.layers / f"{index:05d}.safetensors", results)
        atomic_write_json(self.layers / f"{index:05d}.json", {r.name: r.stats for r in results})
        if hidden is not None:
            tmp = self.root / f".hidden-{index + 1:05d}.tmp"
            both = {"hidden": hidden.contiguous()}
            if float_hidden is not None:
                both["float_hidden"] = float_hidden.contiguous()
            save_file(both, str(tmp))
            tmp.replace(self.root / f"hidden-{index + 1:05d}.safetensors")
        st = self.state()
        st["next_layer"] = index + 1
        atomic_write_json(self.root / "state.json", st)
        old = self.root / f"hidden-{index:05d}.safetensors"
        old.unlink(missing_ok=True)

    def hidden(self, index: int) -> torch.Tensor:
        return load_file(str(self.root / f"hidden-{index:05d}.safetensors"))["hidden"]

    def float_hidden(self, index: int) -> torch.Tensor:
        """The float model's activations at layer `index`'s input, saved beside the quantized model's."""
        path = self.root / f"hidden-{index:05d}.safetensors"
        saved = load_file(str(path))
        if "float_hidden" not in saved:
            raise ConvertError(f"{path}: this unfinished conversion did not keep the float model's activations; "
                               "run again with --restart")
        return saved["float_hidden"]

    def layer_files(self, n: int) -> list[Path]:
        return [self.layers / f"{i:05d}.safetensors" for i in range(n)]

    def layer_stats(self, n: int) -> dict[str, dict]:
        stats: dict[str, dict] = {}
        for i in range(n):
            stats.update(json.loads((self.layers / f"{i:05d}.json").read_text()))
        return stats

    # the model-free path (quantkit/quantize/streamed.py): one file per quantized module, its export tensors
    # with its stats in the file's metadata, written under a temporary name and renamed; a file that exists
    # is a finished module, so a rerun skips it (there is no state to move on: the files are the state)
    @property
    def tensors(self) -> Path:
        return self.root / "tensors"

    def tensor_file(self, module: str) -> Path:
        return self.tensors / f"{module}.safetensors"

    def save_tensor(self, module: str, tensors: dict[str, torch.Tensor], stats: dict) -> None:
        self.tensors.mkdir(exist_ok=True)
        path = self.tensor_file(module)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt", "stats": json.dumps(stats)})
        tmp.replace(path)

    def tensor_stats(self, module: str) -> dict:
        from safetensors import safe_open

        with safe_open(str(self.tensor_file(module)), framework="pt") as h:
            return json.loads(h.metadata()["stats"])


def save_typed(path: Path, results: list[ModuleResult]) -> None:
    """One layer's typed results in one safetensors file, written under a temporary name and renamed."""
    tensors: dict[str, torch.Tensor] = {}
    for r in results:
        tensors.update(encode_result(r))
    tmp = path.with_name(f".{path.stem}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
