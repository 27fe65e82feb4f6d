"""Transform stages (AWQ, SmoothQuant, any registered TransformMethod) inside the layer pipeline: per
decoder layer, one float forward captures the inputs of every planned smoothing mapping, the method
chooses the scales (quantkit/algorithms/registry.py -> algorithms/<method>.py), and the scales are folded
into the preceding norm or Linear (algorithms/smoothing.py), which leaves the float output unchanged.

The quantizing forward of the pipeline then runs on the transformed layer. The folded float tensors
that are not quantized afterwards (norm weights, biases) are returned so that the export writes them
in place of the stored ones; the diagnostics go into the stats of the Linears each mapping feeds
(manifest.json "layers" -> <module> -> "smoothing").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.distributed import ChunkFold, ChunkLayout
from quantkit.algorithms.smoothing import channel_index, fold_into_linear_rows, fold_into_norm, scale_columns
from quantkit.model import ModelError
from quantkit.model.checkpoint import to_layer_device
from quantkit.plan import Smoothing
from quantkit.algorithms.contract import ChannelStats, MappingTargets


class _Capture:
    """Per-channel |x| sum and max over all tokens, and an evenly spaced sample of tokens, folded chunk by
    chunk in global order (across processes too: quantkit/distributed.py)."""

    def __init__(self, max_tokens: int, layout: ChunkLayout):
        total = sum(layout.tokens(c) for c in range(layout.n))
        # the sample's positions in the whole batch, which arrives chunk by chunk
        self.pick = torch.linspace(0, total - 1, min(max_tokens, total)).round().long()
        self.layout = layout
        self.abs_sum = self.abs_max = None
        self.rows: list[torch.Tensor] = []
        self.tokens = 0
        self._fold = ChunkFold(layout, self._merge, eager=False)  # small: exchanged after the forward

    def add(self, x: torch.Tensor) -> None:
        """One of this rank's chunks (in order)."""
        x2 = x.detach().reshape(-1, x.shape[-1]).float()  # [tokens, features]
        a = x2.abs()
        at = self.layout.token_offset(self._fold.index())
        here = self.pick[(self.pick >= at) & (self.pick < at + x2.shape[0])] - at
        self._fold.add([a.sum(0), a.amax(0), x2[here].clone()])

    def _merge(self, payload) -> None:
        s, m, rows = payload
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        self.abs_max = m if self.abs_max is None else torch.maximum(self.abs_max, m)
        self.rows.append(rows)
        self.tokens += self.layout.tokens(len(self.rows) - 1)

    def finish(self) -> None:
        self._fold.finish()

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)

    def stats(self) -> ChannelStats:
        return ChannelStats(self.sample, self.abs_sum / self.tokens, self.abs_max)


@dataclass
class Transformed:
    """What transforming one layer changed for one target Linear: the mapping's diagnostics, and the float
    tensors the fold rewrote (carried by the first target of each mapping)."""

    smoothing: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def apply_transforms(layer: nn.Module, prefix: str, smoothings: list[Smoothing], job,
                     pieces: list[tuple[torch.Tensor, dict]], quantized_names: set[str],
                     layout: ChunkLayout | None = None) -> dict[str, Transformed]:
    """Transform one float layer in place. Returns {target module: Transformed}.

    `pieces` are this rank's calibration chunks of `layout`, each with the layer's keyword arguments for
    its batch size (default: they are the whole batch); `job` is the conversion's
    quantkit.quantize.layers.Job (plan, scale dtype, hook).
    """
    layout = layout or ChunkLayout(tuple(h.shape[0] for h, _ in pieces), pieces[0][0].shape[1])
    caps: dict[int, _Capture] = {}
    prev_out: dict[int, _Capture] = {}
    handles = []
    for k, sm in enumerate(smoothings):
        st = sm.stage.config
        caps[k] = _Capture(st.max_tokens, layout)
        first = layer.get_submodule(sm.targets[0].name[len(prefix):])
        handles.append(first.register_forward_pre_hook(lambda _m, args, c=caps[k]: c.add(args[0])))
        prev = layer.get_submodule(sm.prev)
        if not isinstance(prev, nn.Linear):  # a norm: its output must be exactly what the targets read
            prev_out[k] = _Capture(st.max_tokens, layout)
            handles.append(prev.register_forward_hook(lambda _m, _a, out, c=prev_out[k]: c.add(
                out[0] if isinstance(out, tuple) else out)))
    try:
        with torch.no_grad():
            for hidden, layer_kwargs in pieces:
                layer(to_layer_device(hidden, layer), **layer_kwargs)
    finally:
        for h in handles:
            h.remove()
    for k in range(len(smoothings)):  # the same order on every rank
        caps[k].finish()
        if k in prev_out:
            prev_out[k].finish()

    results: dict[str, Transformed] = {}
    with torch.no_grad():
        for k, sm in enumerate(smoothings):
            stats, tensors = _apply_one(layer, prefix, sm, job, caps[k], prev_out.get(k), quantized_names)
            for i, t in enumerate(sm.targets):
                entry = results.setdefault(t.name, Transformed(stats))
                entry.smoothing = stats
                if i == 0:
                    entry.tensors.update(tensors)
    return results


def _apply_one(layer, prefix, sm: Smoothing, job, cap: _Capture, prev_cap: _Capture | None,
               quantized_names) -> tuple[dict, dict[str, torch.Tensor]]:
    st, method = sm.stage.config, sm.stage.method
    scale_dtype = job.scale_dtype
    stats: dict = {"transform": method.name, "stage": sm.stage.index, "from": sm.prev}
    prev = layer.get_submodule(sm.prev)
    mods = [layer.get_submodule(t.name[len(prefix):]) for t in sm.targets]
    channels = prev.out_features if isinstance(prev, nn.Linear) else prev.weight.numel()
    parent = layer.get_submodule(sm.targets[0].name[len(prefix):].rpartition(".")[0] or "")
    idx = channel_index(channels, mods[0].in_features, getattr(parent, "head_dim", None))
    if idx is None:
        return {**stats, "skipped": f"{channels} channels of {sm.prev} do not map onto "
                f"{mods[0].in_features} input columns"}, {}
    x = cap.sample
    if prev_cap is not None:  # the spec says the norm feeds the targets: check it really does
        a, b = prev_cap.sample, x
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()) + 1e-8):
            raise ModelError(f"{prefix}{sm.prev}: the architecture spec says its output feeds "
                             f"{', '.join(t.name for t in sm.targets)}, but their input differs; fix the "
                             "smoothing mappings of this model family in quantkit/model/arch.py")
    targets = MappingTargets([m.weight.detach().float() for m in mods], [t.scheme.weights for t in sm.targets],
                             [t.scheme.activations for t in sm.targets], idx, channels)
    r = method.choose_scales(cap.stats(), targets, st, scale_dtype)
    stats.update(r.stats)
    stats.update(error_before=float(f"{r.error_before:.6g}"), error_after=float(f"{r.error_after:.6g}"))
    tensors: dict[str, torch.Tensor] = {}
    s_eff = torch.ones(channels)
    if r.applied:
        s_eff, tensors = _fold(prefix, sm, prev, mods, r.scales, idx, scale_dtype, quantized_names)
        stats["scale_range"] = [float(f"{float(r.scales.min()):.4g}"), float(f"{float(r.scales.max()):.4g}")]
    if method.refine is not None:
        xs = x / s_eff[idx][None, :]
        named = [(t.name, m.weight.detach().float(), t.scheme.weights) for t, m in zip(sm.targets, mods)]
        new_weights, extra = method.refine(xs, named, st, scale_dtype)
        for t, m in zip(sm.targets, mods):
            if t.name in new_weights:
                m.weight.data = new_weights[t.name].to(m.weight.dtype)
        stats.update(extra)
    if job.on_weight is not None:
        for name, tensor in tensors.items():
            job.on_weight(name, tensor.float().clone())
    return stats, tensors


def _fold(prefix: str, sm: Smoothing, prev: nn.Module, mods: list[nn.Module], s: torch.Tensor, idx: torch.Tensor,
          scale_dtype: torch.dtype, quantized_names) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Fold the scales into the preceding norm or Linear and scale the targets' columns, which leaves the
    float output unchanged; returns the effective scales and the float tensors the export must write."""
    tensors: dict[str, torch.Tensor] = {}
    if isinstance(prev, nn.Linear):
        w, b = fold_into_linear_rows(prev.weight, prev.bias, s)
        prev.weight.data = w.to(prev.weight.dtype)
        if prev.bias is not None:
            prev.bias.data = b.to(scale_dtype).to(prev.bias.dtype)
            tensors[f"{prefix}{sm.prev}.bias"] = prev.bias.detach().to(scale_dtype).cpu().clone()
        if f"{prefix}{sm.prev}" not in quantized_names:  # exported as a float weight
            prev.weight.data = prev.weight.data.to(scale_dtype).to(prev.weight.dtype)
            tensors[f"{prefix}{sm.prev}.weight"] = prev.weight.detach().to(scale_dtype).cpu().clone()
        s_eff = s
    else:
        new, s_eff = fold_into_norm(prev.weight.detach(), s, sm.norm_offset, scale_dtype)
        prev.weight.data = new.to(prev.weight.dtype)
        tensors[f"{prefix}{sm.prev}.weight"] = new.to(scale_dtype).cpu().clone()
    for m in mods:
        m.weight.data = scale_columns(m.weight.detach(), s_eff[idx]).to(m.weight.dtype)
    return s_eff, tensors
