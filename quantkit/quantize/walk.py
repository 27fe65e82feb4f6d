"""The layer walk: one decoder layer at a time, the calibration batch carried from each layer to the next.

This is the one place that captures the first layer's input (and every layer's keyword arguments), decides
where the activations live (GPU or pinned host memory), materializes each layer from the checkpoint and
releases it, and cuts the batch into chunks. What happens inside a layer is a visitor's (the conversion's:
quantkit/quantize/layers.py). Inside a layer the chunks run as coroutines under a `ChunkScheduler`: every
chunk's forward stops where an observer pauses it (a sequential group's input), so the visitor can act on
what all chunks showed (quantize the group) before they go on, with one chunk's intermediates in memory at
a time. Observers (group inputs, the KV-cache observer, expert routing, activation fake quantization)
follow one protocol: installed on the layer before its forward, removed after.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Protocol

import greenlet
import torch
from torch import nn
from tqdm.auto import tqdm

from quantkit.distributed import SINGLE, ChunkLayout, Ranks
from quantkit.errors import human_bytes
from quantkit.io import keep_large_allocations_off_the_heap, reusing_freed_memory
from quantkit.model.arch import ArchSpec
from quantkit.model.checkpoint import LazyCheckpoint, materialize, release, to_layer_device
from quantkit.plan import ConvertError, LayerPlan, Plan
from quantkit.quantize.timing import PhaseTimes

log = logging.getLogger("quantkit")


# ------------------------------------------------------------------------------------------ the chunks
class _Chunk(greenlet.greenlet):
    """One calibration chunk's forward through a layer, as a coroutine (a greenlet). Coroutines rather than
    threads: everything stays on the caller's thread, so torch's thread-local state (grad mode, thread count)
    is the scheduler's and no thread is left behind when a layer fails."""

    def __init__(self, layer: nn.Module, hidden: torch.Tensor, kwargs: dict):
        super().__init__()
        self.layer, self.hidden, self.kwargs = layer, hidden, kwargs
        self.output: torch.Tensor | None = None

    def run(self) -> None:
        out = self.layer(to_layer_device(self.hidden, self.layer), **self.kwargs)
        self.output = out[0] if isinstance(out, tuple) else out

    def step(self) -> None:
        """Run this chunk until its next pause or its end; what its forward raises is raised here."""
        if not self.dead:
            self.switch()

    def abort(self) -> None:
        if self and not self.dead:  # started and paused: unwind its forward
            self.throw(greenlet.GreenletExit)


def pause_chunk() -> None:
    """Called from a hook inside a chunk's forward: hand control back to the scheduler until the next step."""
    current = greenlet.getcurrent()
    if isinstance(current, _Chunk):
        current.parent.switch()


class ChunkScheduler:
    """A layer's calibration chunks, stepped together: `advance()` runs every chunk to its next pause, in
    chunk order; `finish(out)` runs them to the end of the layer and writes their outputs into `out`;
    `close()` unwinds any chunk left paused (a failed layer)."""

    def __init__(self, layer: nn.Module, pieces: list[tuple[torch.Tensor, dict]]):
        self.chunks = [_Chunk(layer, h, kw) for h, kw in pieces]

    def advance(self) -> None:
        for c in self.chunks:
            c.step()

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        row = 0
        for c in self.chunks:
            c.step()  # to the end of the layer
            out[row:row + c.hidden.shape[0]] = c.output
            row += c.hidden.shape[0]
            c.output = None
        return out

    def close(self) -> None:
        for c in self.chunks:
            c.abort()


class Observer(Protocol):
    """Something that watches a layer's calibration forward: installed before it, removed after (always)."""

    def install(self, layer: nn.Module) -> None: ...

    def remove(self) -> None: ...


@contextlib.contextmanager
def observing(layer: nn.Module, observers: list[Observer]):
    """The observers installed on `layer` for the block, with grad off (for the chunks too: same thread)."""
    installed: list[Observer] = []
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        for o in observers:
            o.install(layer)
            installed.append(o)
        yield
    finally:
        for o in installed:
            o.remove()
        torch.set_grad_enabled(grad)


# ------------------------------------------------------------------------------------------- the walk
@dataclass
class LayerInput:
    """One layer's calibration input on this rank: its chunks of `layout`, and the layer's keyword arguments
    per chunk batch size. All None for a weights-only conversion."""

    hidden: torch.Tensor | None
    kwargs: dict[int, dict] | None
    layout: ChunkLayout | None
    # the float model's activations at this layer's input (same chunks), where a visitor carries them beside the
    # quantized model's (autoround's float-model reference); None otherwise
    float_hidden: torch.Tensor | None = None

    def pieces(self, batch_size: int, stream: torch.Tensor | None = None) -> list[tuple[torch.Tensor, dict]]:
        """The chunks of `stream` (default: the quantized model's activations) with their keyword arguments."""
        hidden = self.hidden if stream is None else stream
        return [(h, self.kwargs[h.shape[0]]) for h in hidden.split(batch_size)]  # views


class LayerVisitor(Protocol):
    def visit(self, index: int, layer: nn.Module, lp: LayerPlan, inp: LayerInput) -> tuple[torch.Tensor | None, str]:
        """Act on one materialized layer; return the next layer's input (this rank's) and a progress note."""


@dataclass(frozen=True)
class Walk:
    """What a layer walk runs over: the skeleton, its checkpoint, the plan, where to compute, this rank."""

    model: nn.Module
    arch: ArchSpec
    ckpt: LazyCheckpoint
    plan: Plan
    device: torch.device
    compute: torch.dtype
    ranks: Ranks = SINGLE
    timing: PhaseTimes = field(default_factory=PhaseTimes)  # `load` and `capture` (quantkit/quantize/timing.py)

    def run(self, visitor: LayerVisitor, input_ids: torch.Tensor | None, start: int = 0, resume=None,
            quiet: bool = False) -> None:
        """Every layer from `start` on; `resume(start)` gives the saved input of layer `start` (> 0)."""
        keep_large_allocations_off_the_heap()
        layers = self.model.get_submodule(self.arch.layers)
        hidden, kwargs, layout = self._first_input(input_ids, start, resume)
        bar = tqdm(range(start, len(layers)), desc="layers", unit="layer", disable=quiet or not self.ranks.root,
                   initial=start, total=len(layers))
        for i in bar:
            layer, lp = layers[i], self.plan.layers[i]
            with self.timing.measure("load"):
                materialize(layer, lp.prefix, self.ckpt, self.compute, self.device)
            with reusing_freed_memory():  # a layer's chunks allocate the same tensors again and again; trimmed after
                hidden, note = visitor.visit(i, layer, lp, LayerInput(hidden, kwargs[i] if kwargs else None, layout))
                release(layer)
            bar.set_postfix_str(note)

    def _first_input(self, input_ids, start: int, resume):
        if input_ids is None:
            return None, None, None
        bs = self.plan.calibration.batch_size
        layout = ChunkLayout.of(input_ids.shape[0], bs, input_ids.shape[1], self.ranks)
        with self.timing.measure("capture"):
            first, by_size = capture_layer_inputs(self.model, self.arch, self.ckpt, layout.local(input_ids), self.compute, bs)
        hidden = first if start == 0 else layout.local(resume(start))
        del first
        nbytes = hidden.numel() * hidden.element_size()
        place, why = activation_placement(self.device, 2 * nbytes, _largest_layer_bytes(self.plan, self.ckpt, self.compute))
        log.info("calibration activations (%s x 2) on %s: %s", human_bytes(nbytes), place, why)
        if place == "device":
            hidden = hidden.to(self.device)
        elif self.device.type == "cuda":
            hidden = hidden.pin_memory()
        n = len(self.plan.layers)
        kwargs = [{size: to_device(kws[i], self.device, self.compute) for size, kws in by_size.items()} for i in range(n)]
        return hidden, kwargs, layout


class _StopForward(Exception):
    pass


# ------------------------------------------------------------------------------------- layer inputs
def capture_layer_inputs(model: nn.Module, arch: ArchSpec, ckpt: LazyCheckpoint, input_ids: torch.Tensor,
                         dtype: torch.dtype, batch_size: int) -> tuple[torch.Tensor, dict[int, list[dict]]]:
    """Run the embedding (and whatever precedes the layers) once, in chunks of `batch_size` samples.

    Returns the first layer's input for the whole batch and, for each chunk size that occurs, every
    layer's keyword arguments (position embeddings, masks) as the model builds them for that size.
    """
    layers = model.get_submodule(arch.layers)
    kwargs_by_size: dict[int, list[dict]] = {}
    first_hidden: list[torch.Tensor] = []

    class Recorder(nn.Module):
        def __init__(self, idx: int, inner: nn.Module):
            super().__init__()
            self.idx, self.inner = idx, inner
            self.attention_type = getattr(inner, "attention_type", None)

        def forward(self, hidden_states, *args, **kwargs):
            if args:
                raise ConvertError("decoder layers called with positional arguments are not supported")
            kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}
            kw["use_cache"] = False
            recorded[self.idx] = kw
            if self.idx == 0:
                first_hidden.append(hidden_states.to(dtype))
            if self.idx == len(layers) - 1:
                raise _StopForward
            return hidden_states

    originals = list(layers)
    for i in range(len(layers)):
        layers[i] = Recorder(i, originals[i])
    embed = model.get_submodule(arch.embed)
    try:
        with embedding_rows(embed, arch.embed + ".", ckpt, dtype, input_ids):
            for ids in input_ids.split(batch_size):  # [<= batch_size, seq]
                recorded: list[dict] = [None] * len(layers)  # type: ignore[list-item]
                try:
                    with torch.no_grad():
                        model.get_submodule(arch.layers.rsplit(".", 1)[0])(input_ids=ids, use_cache=False)
                except _StopForward:
                    pass
                kwargs_by_size.setdefault(ids.shape[0], recorded)
    finally:
        for i in range(len(layers)):
            layers[i] = originals[i]
    hidden = torch.cat(first_hidden)
    first_hidden.clear()  # the Recorder class holds the list (a class is a reference cycle): its chunks go now
    return hidden, kwargs_by_size


@contextlib.contextmanager
def embedding_rows(embed: nn.Module, prefix: str, ckpt: LazyCheckpoint, dtype: torch.dtype, input_ids: torch.Tensor):
    """The embedding materialized for the block, released after. A plain table (nn.Embedding and its subclasses,
    a scaled one included) holds only the rows of the tokens in `input_ids`, and a pre-hook maps each id to its
    row: the calibration batch's embedding without the whole table (Llama-3.1-8B's is 128,256 rows, 1 GB in bf16
    and 2.1 GB in fp32, for a few thousand tokens). Anything else is materialized whole."""
    plain = isinstance(embed, nn.Embedding) and [n for n, _ in embed.named_parameters()] == ["weight"]
    if not plain:
        materialize(embed, prefix, ckpt, dtype)
        try:
            yield
        finally:
            release(embed)
        return
    used = torch.unique(input_ids)  # sorted
    table, padding_idx = embed.weight, embed.padding_idx  # the skeleton's (meta) table, shared where tied
    embed.weight = nn.Parameter(ckpt.get_rows(prefix + "weight", used).to(dtype=dtype, copy=True), requires_grad=False)
    embed.padding_idx = None  # an index into the whole table; no gradient flows here

    def to_rows(_m, args, kwargs):
        if args:
            return (torch.searchsorted(used, args[0]), *args[1:]), kwargs
        return args, {**kwargs, "input": torch.searchsorted(used, kwargs["input"])}

    hook = embed.register_forward_pre_hook(to_rows, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
        embed.weight, embed.padding_idx = table, padding_idx


def activation_placement(device: torch.device, need_bytes: int, layer_bytes: int,
                         free_bytes: int | None = None) -> tuple[str, str]:
    """Where the calibration activations (a layer's input and output for the whole batch) live: on the GPU
    when they fit beside the layer being processed (its weights, Hessians and the solves' workspace, taken as
    3x the layer's compute-dtype size) with 10% to spare, else in pinned host memory, moved chunk by chunk."""
    if device.type != "cuda":
        return "device", "the conversion runs on the CPU"
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    room = int(0.9 * free_bytes) - 3 * layer_bytes
    if need_bytes <= room:
        return "device", f"{human_bytes(need_bytes)} fit in {human_bytes(max(room, 0))} of GPU memory left beside the layer"
    return "host", (f"{human_bytes(need_bytes)} do not fit in {human_bytes(max(room, 0))} of GPU memory left beside "
                    "the layer: they stay in pinned host memory and move to the GPU one chunk at a time")


def _largest_layer_bytes(plan: Plan, ckpt: LazyCheckpoint, compute: torch.dtype) -> int:
    """The largest decoder layer's parameters in the compute dtype, from the checkpoint's headers."""
    size = torch.empty((), dtype=compute).element_size()
    return size * max((sum(ckpt.numel(k) for k in ckpt.keys() if k.startswith(lp.prefix)) for lp in plan.layers),
                      default=0)


def to_device(obj, device, dtype):
    """Tensors in nested tuples / dicts moved to `device`, floating ones cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device=device, dtype=dtype) if obj.is_floating_point() else obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device, dtype) for k, v in obj.items()}
    return obj
