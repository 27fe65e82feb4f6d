"""The method registry: every quantization method quantkit knows, registered explicitly, with its role.

A method lives in one file, quantkit/algorithms/<method>.py: its recipe stage config (a pydantic model
with `method: Literal["<name>"]`), its math, and the function the contract asks for
(quantkit/algorithms/contract.py). This file adds it to the table; the recipe's `stages` schema, the plan
and the pipeline read the table (never a method's name), so adding a method touches two files: its own
and this one.

- A quantizer owns modules and produces their codes: `quantize(weights, observations, spec, stage,
  scale_dtype) -> [QuantizedWeight]`, and declares what it needs: "hessian" (the pipeline accumulates
  the group inputs' Hessian) or "nothing".
- A quantizer may also refine a whole decoder layer after its groups are quantized (`refine_layer`):
  autoround learns the rounding of every Linear it owns against the float layer's output.
- A transform rescales a smoothing mapping without changing the float output: `choose_scales(...)`, and
  optionally `refine(...)` on the folded weights.
- A rotation rewrites the whole model before any other stage, without changing its float output: `view(source
  checkpoint, config, arch, stage)` gives the rotated model as a checkpoint (quantkit/model/rotated.py).
- A fine-tune stage trains what the stages before it produced; its loop is quantkit/quantize/finetune.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Literal

from quantkit.algorithms import autoround, awq, gptq, qat, rotate, rtn, smoothquant
from quantkit.model.rotated import RotatedCheckpoint


@dataclass(frozen=True, kw_only=True)
class Method:
    """What the recipe, the plan and the pipeline may ask of any method: its name, stage config and role."""

    role: ClassVar[str]
    name: str
    stage: type  # the recipe stage config
    must_come_last: bool = False  # the recipe refuses a stage after it, and a second one
    moe_refusal: str | None = None  # why it cannot run on a mixture-of-experts model (None: it can)
    keeps_kv_scales: bool = True  # k/v-cache scales calibrated in the quantizing pass still fit after it


@dataclass(frozen=True, kw_only=True)
class QuantizerMethod(Method):
    role: ClassVar[str] = "quantizer"
    # (weights, Observations, WeightSpec, stage, scale_dtype) -> list[QuantizedWeight]; the weights come in the
    # layer's compute dtype, and the quantizer takes its fp32 copy of each in turn (one at a time in memory)
    quantize: Callable
    needs: Literal["hessian", "nothing"]
    # its QuantizedWeights carry `output_noise`, and it makes its factor in the Hessian's buffer when the
    # Observations allow (GPTQ): the pipeline then measures the output SQNR's signal before the solve
    reports_output_noise: bool = False
    # what one stage's configuration needs, where it depends on it (autoround from RTN: no Hessian)
    needs_of: Callable[[object], Literal["hessian", "nothing"]] | None = None
    # a second pass over the whole decoder layer after its groups are quantized: (LayerProblem, stage,
    # scale_dtype) -> [QuantizedWeight] (autoround's learned rounding, against the float layer's output)
    refine_layer: Callable | None = None

    def needs_for(self, stage) -> Literal["hessian", "nothing"]:
        """What this stage (its configuration) needs from the calibration inputs."""
        return self.needs_of(stage) if self.needs_of is not None else self.needs


@dataclass(frozen=True, kw_only=True)
class TransformMethod(Method):
    role: ClassVar[str] = "transform"
    choose_scales: Callable  # (ChannelStats, MappingTargets, stage, scale_dtype) -> TransformScales
    refine: Callable | None = None  # (scaled inputs, [(name, weight, spec)], stage, scale_dtype) -> (weights, stats)
    needs_quantized_activations: bool = False  # only useful before a scheme that quantizes activations


@dataclass(frozen=True, kw_only=True)
class RotationMethod(Method):
    role: ClassVar[str] = "rotation"
    view: Callable  # (source LazyCheckpoint, config, ArchSpec, stage) -> the rotated model's checkpoint
    needs_quantized_activations: bool = False  # useful before any scheme


@dataclass(frozen=True, kw_only=True)
class FinetuneMethod(Method):
    role: ClassVar[str] = "finetune"
    starts_from: str  # the quantizer that gives a module only this stage claims its starting point


METHODS: dict[str, Method] = {}  # method name -> entry, in registration order
QUANTIZERS: dict[str, QuantizerMethod] = {}
TRANSFORMS: dict[str, TransformMethod] = {}
ROTATIONS: dict[str, RotationMethod] = {}
FINETUNERS: dict[str, FinetuneMethod] = {}
STAGE_CLASSES: dict[str, type] = {}  # method name -> recipe stage config, in registration order


def register(method: Method) -> None:
    table = {"quantizer": QUANTIZERS, "transform": TRANSFORMS, "rotation": ROTATIONS, "finetune": FINETUNERS}[method.role]
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} registered twice")
    table[method.name] = METHODS[method.name] = method
    STAGE_CLASSES[method.name] = method.stage


def method_of(stage) -> Method:
    """The registry entry of a recipe stage config."""
    return METHODS[stage.method]


register(QuantizerMethod(name="rtn", stage=rtn.RTNStage, quantize=rtn.quantize, needs="nothing"))
register(QuantizerMethod(name="gptq", stage=gptq.GPTQStage, quantize=gptq.quantize, needs="hessian",
                         reports_output_noise=True))
register(QuantizerMethod(name="autoround", stage=autoround.AutoRoundStage, quantize=autoround.quantize, needs="hessian",
                         needs_of=autoround.needs,
                         refine_layer=autoround.refine_layer,
                         moe_refusal="autoround does not refine mixture-of-experts layers yet; use gptq"))
register(RotationMethod(name="rotate", stage=rotate.RotateStage, view=RotatedCheckpoint,
                        moe_refusal="rotate does not rotate mixture-of-experts layers yet"))
register(TransformMethod(name="awq", stage=awq.AWQStage, choose_scales=awq.choose_scales, refine=awq.refine))
register(TransformMethod(name="smoothquant", stage=smoothquant.SmoothQuantStage,
                         choose_scales=smoothquant.choose_scales, needs_quantized_activations=True))
register(FinetuneMethod(name="qat", stage=qat.QATStage, starts_from="rtn", must_come_last=True, keeps_kv_scales=False,
                        moe_refusal="QAT does not run on mixture-of-experts models yet (its student is transformers' "
                                    "model, whose experts are fused)"))
