"""The method registry: every quantization method quantkit knows, one line each, registered explicitly.

A method lives in one file, quantkit/algorithms/<method>.py: its recipe stage config (a pydantic model
with `method: Literal["<name>"]`), its math, and the function the contract asks for
(quantkit/algorithms/contract.py). This file adds it to the table; the recipe's `stages` schema, the plan
and the pipeline read the table, so adding a method touches exactly two files: its own and this one.

- A quantizer owns modules and produces their codes: `quantize(weights, observations, spec, stage,
  scale_dtype) -> [QuantizedWeight]`, and declares what it needs: "hessian" (the pipeline accumulates
  the group inputs' Hessian) or "nothing".
- A transform rescales a smoothing mapping without changing the float output: `choose_scales(...)`, and
  optionally `refine(...)` on the folded weights.
- A fine-tune stage (QAT) trains what the stages before it produced; its loop is quantkit/quantize/qat_loop.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from quantkit.algorithms import awq, gptq, qat, rtn, smoothquant


@dataclass(frozen=True)
class QuantizerMethod:
    name: str
    stage: type  # the recipe stage config
    quantize: Callable  # (weights, Observations, WeightSpec, stage, scale_dtype) -> list[QuantizedWeight]
    needs: Literal["hessian", "nothing"]


@dataclass(frozen=True)
class TransformMethod:
    name: str
    stage: type
    choose_scales: Callable  # (ChannelStats, weights, specs, acts, idx, channels, stage, scale_dtype) -> TransformScales
    refine: Callable | None = None  # (scaled inputs, [(name, weight, spec)], stage, scale_dtype) -> (weights, stats)


@dataclass(frozen=True)
class FinetuneMethod:
    name: str
    stage: type


QUANTIZERS: dict[str, QuantizerMethod] = {}
TRANSFORMS: dict[str, TransformMethod] = {}
FINETUNERS: dict[str, FinetuneMethod] = {}
STAGE_CLASSES: dict[str, type] = {}  # method name -> recipe stage config, in registration order


def register(method: QuantizerMethod | TransformMethod | FinetuneMethod) -> None:
    table = {QuantizerMethod: QUANTIZERS, TransformMethod: TRANSFORMS, FinetuneMethod: FINETUNERS}[type(method)]
    if method.name in STAGE_CLASSES:
        raise ValueError(f"method {method.name!r} registered twice")
    table[method.name] = method
    STAGE_CLASSES[method.name] = method.stage


register(QuantizerMethod("rtn", rtn.RTNStage, rtn.quantize, needs="nothing"))
register(QuantizerMethod("gptq", gptq.GPTQStage, gptq.quantize, needs="hessian"))
register(TransformMethod("awq", awq.AWQStage, awq.choose_scales, awq.refine))
register(TransformMethod("smoothquant", smoothquant.SmoothQuantStage, smoothquant.choose_scales))
register(FinetuneMethod("qat", qat.QATStage))
