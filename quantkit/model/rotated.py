"""A rotated model as a checkpoint: the source's safetensors read through the rotations of a `rotate` stage
(quantkit/algorithms/rotate.py), one tensor at a time.

The layer walk materializes layers from it, the embedding's forward reads it and the export copies the float
tensors it leaves unquantized (embedding, norms, lm_head) from it, so the conversion quantizes the rotated
model and the artifact stores exactly the float tensors the calibration saw. Each tensor comes back in its
stored dtype (the rotation is computed in float32 and rounded once, like the export rounds it). A model with
tied embeddings gets its own `lm_head.weight` (W diag(g_final) Q is no longer the embedding E Q), and
`config_overrides` unties them in the export's config.json.
"""

from __future__ import annotations

import torch

from quantkit.algorithms.hadamard import rotation
from quantkit.algorithms.rotate import (fold_norm_into_readers, rotate_heads_columns, rotate_heads_rows,
                                        rotate_writer)
from quantkit.model import ModelError
from quantkit.model.arch import ArchSpec
from quantkit.model.checkpoint import LazyCheckpoint

class RotatedCheckpoint(LazyCheckpoint):
    """The tensors of `source` as the rotated model stores them; see the module docstring."""

    def __init__(self, source: LazyCheckpoint, config, arch: ArchSpec, stage):
        self.folder = source.folder
        self._where, self._layout = dict(source._where), dict(source._layout)  # the same files and headers
        self._span = dict(source._span)
        self.arch = arch
        refuse_rotation(arch, stage)
        self.offset = float(arch.extra.get("norm_offset", 0.0))
        hidden = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.q = self.r = None
        self.summary = {"residual": stage.residual, "attention": stage.attention, "seed": stage.seed}
        if stage.residual:
            q, kind = rotation(hidden, stage.seed, stage.randomize)
            self.q = q.float()
            self.summary["residual_rotation"] = f"{kind} {hidden}"
        if stage.attention:
            r, kind = rotation(head_dim, stage.seed + 1, stage.randomize)
            self.r = r.float()
            self.summary["attention_rotation"] = f"{kind} {head_dim} per head"
        self.lm_head = "lm_head.weight"
        self.untied = stage.residual and self.lm_head not in self._where
        if self.untied:  # tied: lm_head reads the embedding's storage, rotated its own way here
            embed = arch.embed + ".weight"
            self._where[self.lm_head] = self._where[embed]
            self._layout[self.lm_head] = self._layout[embed]
            self.summary["untied_lm_head"] = True
        self._rules = self._build_rules(config.num_hidden_layers)

    @property
    def config_overrides(self) -> dict:
        return {"tie_word_embeddings": False} if self.untied else {}

    def _build_rules(self, n_layers: int) -> dict[str, tuple]:
        """Stored tensor name -> (what to do, the norm it folds), for every tensor the rotation changes."""
        a = self.arch
        rules: dict[str, tuple] = {}
        if self.q is not None:
            rules[a.embed + ".weight"] = ("embed", None)
            rules[a.final_norm + ".weight"] = ("norm", None)
            rules[self.lm_head] = ("reader", a.final_norm + ".weight")
        for i in range(n_layers):
            p = f"{a.layers}.{i}."
            if self.q is not None:
                for norm, readers in a.residual_readers:
                    rules[p + norm + ".weight"] = ("norm", None)
                    for r in readers:
                        rules[p + r + ".weight"] = ("reader", p + norm + ".weight")
                for w in a.residual_writers:
                    rules[p + w + ".weight"] = ("writer", None)
                    rules[p + w + ".bias"] = ("writer", None)
            if self.r is not None:
                v, o = a.value_path
                for suffix in (".weight", ".bias"):
                    kind, norm = rules.get(p + v + suffix, ("", None))
                    rules[p + v + suffix] = (kind + "+heads_rows", norm)
                o_kind = rules.get(p + o + ".weight", ("", None))[0]
                rules[p + o + ".weight"] = (o_kind + "+heads_columns", None)
        return rules

    def get_many(self, keys: list[str]) -> dict[str, torch.Tensor]:
        changed = [k for k in keys if k in self._rules]
        needed = set(keys) | {self._rules[k][1] for k in changed if self._rules[k][1]}
        stored_keys = sorted({self._stored_name(k) for k in needed})
        stored = super().get_many(stored_keys)
        out = {}
        for k in keys:
            t = stored[self._stored_name(k)]
            out[k] = self._rotate(k, t, stored) if k in self._rules else t
        return out

    def get_rows(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """A rotated tensor's rows are those of the whole tensor as `get` rotates it (computed whole, so they
        carry exactly the bits the export stores); an unrotated one's are read alone."""
        if key in self._rules or key == self.lm_head:
            return self.get(key).index_select(0, rows)
        return super().get_rows(key, rows)

    def stored_span(self, key: str):
        """None for a tensor this view computes (rotated, or the embedding read as an untied head)."""
        if key in self._rules or key == self.lm_head or self._stored_name(key) != key:
            return None
        return super().stored_span(key)

    def _stored_name(self, key: str) -> str:
        return self.arch.embed + ".weight" if (key == self.lm_head and self.untied) else key

    def _rotate(self, key: str, t: torch.Tensor, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        kind, norm = self._rules[key]
        w = t.float()
        for step in filter(None, kind.split("+")):
            if step == "norm":
                w = torch.full_like(w, 1.0 - self.offset)
            elif step == "embed":
                w = w @ self.q
            elif step == "reader":
                w = fold_norm_into_readers(w, stored[norm].float() + self.offset, self.q)
            elif step == "writer":
                w = rotate_writer(w, self.q)
            elif step == "heads_rows":
                w = rotate_heads_rows(w, self.r)
            elif step == "heads_columns":
                w = rotate_heads_columns(w, self.r)
        return w.to(t.dtype)


def refuse_rotation(arch: ArchSpec, stage) -> None:
    """A rotation this architecture cannot fold into its weights is refused, with the reason."""
    if arch.moe is not None:
        raise ModelError(f"rotate: {arch.name} is a mixture-of-experts family; rotating its experts and router is "
                         "not built yet. Remove the rotate stage")
    if stage.residual and arch.rotation_refusal:
        raise ModelError(f"rotate: residual: {arch.rotation_refusal}. Set residual: false (the attention rotation "
                         "still applies) or remove the stage")
