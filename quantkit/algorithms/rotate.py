"""Offline rotations (QuaRot, Ashkboos et al. 2024; SpinQuant, Liu et al. 2024: their R1 and R2), folded into
the weights before quantization so that the export is a plain checkpoint vLLM loads with no runtime change.
Pure tensor math; the checkpoint view that applies it tensor by tensor is quantkit/model/rotated.py.

R1, the residual stream. With an orthogonal Q [d, d] and every residual vector h replaced by h Q:
- an RMSNorm's normalisation commutes with Q (it divides by the vector's norm, which Q keeps), but its
  per-channel weight g does not: g is folded into the Linears the norm feeds (W -> W diag(g)) and the norm's
  weight becomes 1 (0 where the norm applies 1 + weight);
- a Linear reading the normalised residual: W [out, d] -> W diag(g) Q;
- a Linear writing into the residual (o_proj, down_proj): W [d, in] -> Q^T W, bias b -> Q^T b;
- the embedding: E [vocab, d] -> E Q; lm_head: W -> W diag(g_final) Q, so tied embeddings come apart.
R2, the attention value path, per head: with an orthogonal R [head_dim, head_dim], v_proj's rows of every kv
head -> R^T W_h (and its bias), and o_proj's columns of every query head -> W_q R. Attention mixes tokens,
never channels, so o_proj's input is rotated by exactly R and the layer's output is unchanged.

In exact arithmetic the float model computes the same logits. What rotation buys: the residual stream's outlier
channels (a few channels orders of magnitude above the rest) are spread over all channels, so a group's
range is set by typical values, for weights (every Linear that reads or writes the residual) and for the
per-token activations of W8A8.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from quantkit.algorithms.base import RewritesWeights


class RotateStage(RewritesWeights):
    """`method: rotate`: rotate the whole model before any other stage (it must be stages[0])."""

    method: Literal["rotate"]
    residual: bool = Field(True, description="R1: rotate the residual stream (embedding, every Linear that reads "
                                             "or writes it, lm_head; unties tied embeddings)")
    attention: bool = Field(True, description="R2: rotate each attention head's value / output path")
    randomize: bool = Field(True, description="random row signs on the Hadamard matrix (QuaRot); false: plain")
    seed: int = Field(0, ge=0, description="seed of the random signs")

    @property
    def needs_calibration(self) -> bool:  # data-free: the rotation depends on the shapes and the seed alone
        return False

    def problems(self) -> list[tuple[str, str]]:
        if not self.residual and not self.attention:
            return [("residual", "and attention are both false, so the stage rotates nothing; remove it")]
        return []


def fold_norm_into_readers(weight: torch.Tensor, norm_factor: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A Linear reading the normalised residual: W [out, d] -> W diag(g) Q."""
    return (weight.float() * norm_factor.float()[None, :]) @ q


def rotate_writer(weight: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A Linear writing into the residual: W [d, in] -> Q^T W; a bias [d] as a column: Q^T b."""
    return q.t() @ weight.float()


def rotate_heads_rows(weight: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """v_proj: each head's block of rows (head_dim of them) -> R^T W_h; a bias [heads * head_dim] likewise."""
    hd = r.shape[0]
    w = weight.float()
    blocks = w.reshape(-1, hd, *w.shape[1:])  # [heads, head_dim, (in)]
    return torch.einsum("ji,hj...->hi...", r, blocks).reshape(w.shape)


def rotate_heads_columns(weight: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """o_proj: each query head's block of columns -> W_q R."""
    hd = r.shape[0]
    w = weight.float()
    return (w.reshape(w.shape[0], -1, hd) @ r).reshape(w.shape)
