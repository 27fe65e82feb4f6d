"""The recipe: one YAML file that says everything about a conversion, its evaluation, gates and publish.

Validated with pydantic (every model forbids unknown keys) before any weight loads. Every error names
the file, the field path, the bad value and what is allowed, e.g.
`recipes/x.yaml: stages[0].scheme: 'W4A61' is not a known scheme (known: W4A16, W8A8, ...)`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_serializer, model_validator

from quantkit.evaluate.catalogue import is_metric_name
from quantkit.algorithms.registry import QUANTIZERS, STAGE_CLASSES, method_of
from quantkit.resources import BUILTIN_CORPORA, corpus_glob, shipped_recipe
from quantkit.schemes import SCHEMES
from quantkit.strict import Strict


class RecipeError(ValueError):
    """A recipe problem, already phrased for the user (file: field: problem)."""


# ---------------------------------------------------------------------------------------------- model
class ModelSpec(Strict):
    path: str = Field(description="local HF folder, a .gguf file, a hub id, or a demo name (smollm2-135m)")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    compute_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="dtype of the calibration forward (weights and activations of the layer being "
                            "quantized): auto = bfloat16 where the hardware has native bf16 (CUDA, AMX / "
                            "AVX512-BF16 CPUs), else float32. Hessians and solves are fp32 regardless. On the demo's "
                            "4-bit recipe bf16 cost 0.1% perplexity (1.1339 vs 1.1325 of float; README, Accuracy)")
    trust_remote_code: bool = False
    revision: str | None = None


# -------------------------------------------------------------------------------------- calibration
LOCAL_SOURCES = ("text", "jsonl", "parquet", "disk", "chat")  # source types whose `path` is on this machine


class DataSource(Strict):
    type: Literal["text", "jsonl", "parquet", "disk", "hub", "chat", "builtin"]
    path: str | None = Field(None, description="file, glob, folder, or hub dataset name (type: hub)")
    name: str | None = Field(None, description="type: builtin: a part of quantkit's shipped calibration corpus "
                                               f"({', '.join(BUILTIN_CORPORA)})")
    field: str = "text"  # jsonl / parquet / disk / hub: the text column; chat: the messages column
    split: str = "train"  # disk / hub
    weight: float = Field(1.0, gt=0, description="share of the packed tokens drawn from this source")
    encoding: Literal["replace", "strict"] = Field(
        "replace", description="text / jsonl / chat files with invalid UTF-8: replace (U+FFFD, with a warning "
                               "naming the file, byte offset and count) or strict (refuse the file)")

    @model_validator(mode="after")
    def _path_or_name(self) -> "DataSource":
        if self.type == "builtin":
            if self.name not in BUILTIN_CORPORA:
                raise ValueError(f"name: {self.name!r} is not a builtin corpus (known: {', '.join(BUILTIN_CORPORA)}); "
                                 "`quantkit recipes corpora` lists them")
            if self.path is not None:
                raise ValueError("path: a builtin source is chosen by `name`, not `path`; remove path")
        elif self.path is None:
            raise ValueError(f"path: required for type {self.type!r} (a file, glob or folder)")
        elif self.name is not None:
            raise ValueError(f"name: only type builtin takes a name; type {self.type!r} reads `path`")
        return self

    def reader(self) -> "DataSource":
        """The source to read: a builtin corpus becomes the text/jsonl/chat source of its shipped files."""
        if self.type != "builtin":
            return self
        c = BUILTIN_CORPORA[self.name]
        return DataSource(type=c.reader, path=corpus_glob(self.name), field=c.field, weight=self.weight,
                          encoding=self.encoding)


class MoECalibrationSpec(Strict):
    """How experts of mixture-of-experts layers are calibrated (quantkit/model/moe.py)."""

    min_tokens: int = Field(128, ge=1, description="an expert the router sends fewer calibration tokens than "
                            "this takes the fallback")
    fallback: Literal["all_tokens", "rtn"] = Field("all_tokens", description="all_tokens: calibrate that "
                                                   "expert on every token of the batch; rtn: round-to-nearest")


class CalibrationSpec(Strict):
    sources: list[DataSource] = Field(min_length=1)
    num_samples: int = Field(32, ge=1)
    seq_len: int = Field(512, ge=8)
    seed: int = 0
    batch_size: int = Field(8, ge=1, description="samples per forward chunk in the layer pipeline: peak "
                            "memory follows this, not num_samples; `--nproc N` needs at least N chunks "
                            "(the default makes 4 of the shipped recipes' 32 samples)")
    moe: MoECalibrationSpec = MoECalibrationSpec()


# ------------------------------------------------------------------------------------------- stages
Stage = Annotated[Union[tuple(STAGE_CLASSES.values())], Field(discriminator="method")]
METHODS = tuple(STAGE_CLASSES)


# ----------------------------------------------------------------------------------------- kv cache
class KVCacheSpec(Strict):
    """Quantize the engine's KV cache: static k/v scales calibrated in the layer-wise pass, exported as
    compressed-tensors' `kv_cache_scheme` and per-layer `self_attn.k_scale` / `v_scale` tensors."""

    scheme: Literal["FP8"] = Field(description="FP8: e4m3 cache entries, scale = amax / 448 (the only one for now)")
    strategy: Literal["tensor", "head"] = Field(
        "tensor", description="tensor: one k and one v scale per layer; head: one per KV head (compressed-tensors "
                              "strategy attn_head)")


# ------------------------------------------------------------------------------------------- export
class ExportSpec(Strict):
    format: Literal["compressed-tensors"] = "compressed-tensors"
    output_dir: str | None = Field(None, description="default: runs/<name>")
    max_shard_size_mb: int = Field(2000, ge=1)


# --------------------------------------------------------------------------------- eval/gates/publish
class WorkloadSpec(Strict):
    """The seeded serving workload, identical for baseline and candidate (lengths in tokens)."""

    num_requests: int = Field(16, ge=1, description="measured requests per load level")
    prompt_tokens: tuple[int, int] = Field((64, 256), description="uniform [min, max] prompt length")
    output_tokens: tuple[int, int] = Field((16, 64), description="uniform [min, max] output length (ignore_eos)")
    concurrency: list[int] = Field(default_factory=lambda: [1, 4], description="closed-loop levels -> speed.c<N>")
    request_rates: list[float] = Field(default_factory=list, description="open-loop Poisson req/s -> speed.r<R>")
    warmup_requests: int = Field(2, ge=0, description="sent before the first level, not measured (none after the chat checks)")
    temperature: float = Field(0.0, ge=0)
    seed: int = 0

    @field_validator("prompt_tokens", "output_tokens")
    @classmethod
    def _range(cls, v: tuple[int, int]) -> tuple[int, int]:
        if v[0] < 1 or v[1] < v[0]:
            raise ValueError(f"{list(v)!r} is not a valid [min, max] token range (need 1 <= min <= max)")
        return v

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v) or len(set(v)) != len(v):
            raise ValueError(f"{v!r}: concurrency levels must be distinct positive integers")
        return v


PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def check_engine_args(v: dict[str, Any]) -> dict[str, Any]:
    """vLLM flags pass through as they are; the parallel sizes must be whole numbers >= 1."""
    for k in PARALLEL_ARGS:
        if k in v and (isinstance(v[k], bool) or not isinstance(v[k], int) or v[k] < 1):
            raise ValueError(f"{k}: {v[k]!r} must be a whole number >= 1 (the GPUs the engine spreads over)")
    return v


def parallelism(engine_args: dict[str, Any]) -> dict[str, int]:
    """{tensor_parallel_size, pipeline_parallel_size, data_parallel_size, gpus}: what the engine is asked to
    spread over (1 each unless set), and the GPUs that takes."""
    sizes = {k: int(engine_args.get(k, 1)) for k in PARALLEL_ARGS}
    return {**sizes, "gpus": sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"] * sizes["data_parallel_size"]}


class VariantSpec(Strict):
    """A serving variant: the candidate's speed workload rerun with these engine settings changed."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
    engine_args: dict[str, Any] = Field(min_length=1, description="vLLM server flags, e.g. enable_prefix_caching: true")

    @field_validator("engine_args")
    @classmethod
    def _parallel_sizes(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_engine_args(v)


class EvalSpec(Strict):
    """What `quantkit eval` measures (a "suite"). Named suites live in evals/suites/<name>.yaml."""

    suite: str = Field("default", description="label recorded in the report")
    perplexity_files: list[str] = Field(default_factory=lambda: ["calibration/heldout/technical.txt",
                                                                 "calibration/heldout/general.txt"])
    perplexity_window: int = Field(512, ge=16, description="tokens per scored window")
    perplexity_max_tokens: int | None = Field(3072, ge=16, description="per file; None = all")
    logprobs_top_k: int = Field(20, ge=1, le=20, description="top-k for KL/agreement (vLLM max_logprobs=20)")
    reference: bool = Field(True, description="also score the perplexity windows engine-free (transformers, "
                                              "float32) for both models: the report's reference column")
    tasks: list[str] = Field(default_factory=lambda: ["qk_suite"])
    task_limit: int | None = Field(50, ge=1, description="items per task (the first); None = all")
    task_concurrency: int = Field(8, ge=1, description="parallel lm-eval requests")
    checks: list[Literal["tools", "safety", "generation"]] = Field(
        default_factory=lambda: ["tools", "safety", "generation"],
        description="chat checks through the server (evals/data/qk_tools.jsonl, qk_safety.jsonl, "
                    "qk_generation.jsonl); [] = none")
    check_limit: int | None = Field(40, ge=1, description="items per check (a prefix keeps the mix); None = all")
    check_concurrency: int = Field(16, ge=1, description="parallel chat requests of the checks")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    engine_args: dict[str, Any] = Field(default_factory=dict, description="extra vLLM server flags, e.g. "
                                        "tensor_parallel_size: 2 (also pipeline_parallel_size, data_parallel_size)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="engine compute dtype for both models; auto = the checkpoint's, but float32 on a CPU "
                            "without native bf16 (no avx512_bf16/AMX), where bf16 matmuls are several times slower")
    max_model_len: int = Field(2048, ge=64)
    kv_cache_gib: int = Field(1, ge=1, description="KV-cache GiB (VLLM_CPU_KVCACHE_SPACE, whole GiB) on the CPU")
    ready_timeout_s: float = Field(600.0, gt=0, description="engine start limit")
    variants: list[VariantSpec] = Field(default_factory=list)
    price_per_hour: float | None = Field(None, ge=0, description="USD per hour of the serving machine")

    @field_validator("engine_args")
    @classmethod
    def _parallel_sizes(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_engine_args(v)


class GateSpec(Strict):
    """One gate: `metric op threshold`, on the candidate value or on candidate / baseline (relative)."""

    metric: str = Field(description="a metric name from report.json, e.g. quality.perplexity")
    op: Literal["<=", ">=", "<", ">"]
    threshold: float
    relative: bool = Field(False, description="compare candidate / baseline instead of the candidate value")
    name: str | None = Field(None, description="label shown in the gate table and JUnit (default: derived)")
    confidence: float | None = Field(None, description="0.95: the whole 95% interval must pass (the upper bound for "
                                                       "<, <=; the lower for >, >=; the ratio interval when relative), "
                                                       "not only the point value")
    bound: Literal["lower", "upper"] | None = Field(None, description="compare this end of the 95% interval instead "
                                                    "of the point value (the ratio interval when relative)")

    @field_validator("confidence", mode="before")
    @classmethod
    def _supported_confidence(cls, v):
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != 0.95:
            raise ValueError(f"gate confidence {v!r} is not supported: reports carry 95% intervals only, so write "
                             "`confidence: 0.95` (or leave it out to gate on the point value)")
        return 0.95

    @model_serializer(mode="wrap")
    def _omit_unset_confidence(self, handler):
        # a gate without `confidence` dumps as before, so recipe hashes (and resumable work folders) stay valid
        data = handler(self)
        for key in ("confidence", "bound"):
            if isinstance(data, dict) and data.get(key) is None:
                data.pop(key, None)
        return data

    @field_validator("threshold", mode="before")
    @classmethod
    def _a_number(cls, v):
        if isinstance(v, bool):  # YAML `true` would pass as 1.0
            raise ValueError("a boolean is not a number; write the threshold as a number, e.g. 1.05")
        return v

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        if not is_metric_name(v):
            raise ValueError(f"{v!r} is not a metric name report.json uses (families: quality.<name>, "
                             "tasks.<task>.acc, tasks.mean_acc, speed.c<N>.<name>, speed.r<rate>.<name>, speed.<name>, "
                             "memory.<name>, cost.<name>, tools.<name>, safety.<name>, generation.<name>, "
                             "artifact.<name>; '*' matches every name of a part, e.g. tasks.*.acc)")
        return v


class PublishSpec(Strict):
    registry: str | None = Field(None, description="MLflow tracking URI (http://..., sqlite:///...) or hf://org/name; "
                                                   "default: the embedded MLflow registry in QUANTKIT_HOME")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                             description="registered model name (default: the recipe name)")
    alias: str = Field("production", pattern=r"^[A-Za-z][A-Za-z0-9_-]*$",
                       description="the serving alias that promote and rollback move by default")


# ------------------------------------------------------------------------------------------- recipe
class Recipe(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    description: str = ""
    model: ModelSpec
    calibration: CalibrationSpec | None = None
    stages: list[Stage] = Field(min_length=1)
    kv_cache: KVCacheSpec | None = Field(None, description="quantize the KV cache (absent: the engine's default)")
    export: ExportSpec = Field(default_factory=ExportSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    gates: list[GateSpec] = Field(default_factory=list)
    accept_anomalies: bool = Field(False, description="publish a candidate whose perplexity beats its baseline beyond "
                                                      "the 95% interval (refused by default: usually a broken measurement)")
    publish: PublishSpec = Field(default_factory=PublishSpec)


    @model_validator(mode="after")
    def _calibration_present(self) -> "Recipe":
        for i, st in enumerate(self.stages):
            if st.needs_calibration and self.calibration is None:
                raise ValueError(f"stages[{i}] ({st.method}) needs calibration data: add a `calibration:` "
                                 "section with at least one source")
        return self

    @model_validator(mode="after")
    def _transforms_then_quantizers(self) -> "Recipe":
        quant = [i for i, st in enumerate(self.stages) if not st.is_transform]
        for i, st in enumerate(self.stages):
            if not st.is_transform:
                continue
            if not quant or quant[0] < i:
                where = f"move it above stages[{quant[0]}]" if quant else \
                    f"add a quantizer stage after it ({', '.join(QUANTIZERS)})"
                raise ValueError(f"stages[{i}].method: {st.method!r} is a transform and must be followed by the "
                                 f"quantizer stages it prepares: {where}")
            if method_of(st).needs_quantized_activations and \
                    not any(get_scheme_acts(self.stages[q].scheme) for q in quant):
                raise ValueError(f"stages[{i}].method: {st.method!r} prepares activation quantization, but no "
                                 "quantizer stage quantizes activations (use W8A8 or FP8_DYNAMIC, or 'awq' for "
                                 "weight-only schemes)")
        return self

    @model_validator(mode="after")
    def _rotation_first(self) -> "Recipe":
        rot = [i for i, st in enumerate(self.stages) if method_of(st).role == "rotation"]
        if rot and rot != [0]:
            raise ValueError(f"stages[{rot[-1]}].method: {self.stages[rot[-1]].method!r} rewrites the whole model "
                             "before anything else: make it stages[0], and keep one")
        tuned = [i for i, st in enumerate(self.stages) if method_of(st).role == "finetune"]
        if rot and tuned:
            raise ValueError(f"stages[{tuned[0]}].method: {self.stages[tuned[0]].method!r} trains the model as "
                             f"transformers loads it, unrotated, so it cannot follow stages[0] "
                             f"({self.stages[0].method!r}); remove one of them")
        return self

    @model_validator(mode="after")
    def _last_stages_last(self) -> "Recipe":
        last = [i for i, st in enumerate(self.stages) if method_of(st).must_come_last]
        if last and last[-1] != len(self.stages) - 1:
            raise ValueError(f"stages[{last[-1]}].method: {self.stages[last[-1]].method!r} must be the last stage (it "
                             f"fine-tunes what the stages before it produced): move it after "
                             f"stages[{len(self.stages) - 1}]")
        if len(last) > 1:
            raise ValueError(f"stages[{last[0]}].method: only one {self.stages[last[0]].method!r} stage is allowed "
                             f"(found {len(last)}); keep the last one")
        return self

    @model_validator(mode="after")
    def _stage_problems(self) -> "Recipe":
        for i, st in enumerate(self.stages):
            for field_name, problem in st.problems():
                raise ValueError(f"stages[{i}].{field_name}: {problem}")
        return self

    @model_validator(mode="after")
    def _kv_cache_needs_data(self) -> "Recipe":
        if self.kv_cache is None:
            return self
        if self.calibration is None:
            raise ValueError("kv_cache: FP8 k/v scales are calibrated from the keys and values the attention sees, "
                             "so the recipe needs calibration data: add a `calibration:` section (e.g. sources: "
                             "[{type: builtin, name: prose}]), or remove kv_cache")
        changes_kv = [st.method for st in self.stages if not method_of(st).keeps_kv_scales]
        if changes_kv:
            raise ValueError(f"kv_cache: the k/v scales are calibrated in the quantizing pass, and a {changes_kv[0]} "
                             "stage changes k_proj / v_proj after it (the scales would not fit the trained weights); "
                             f"remove the {changes_kv[0]} stage or kv_cache")
        return self

    @model_serializer(mode="wrap")
    def _omit_defaults_added_later(self, handler):
        # a recipe without kv_cache or accept_anomalies dumps as before, so recipe hashes (and resumable work
        # folders) stay valid
        data = handler(self)
        if isinstance(data, dict) and data.get("kv_cache", ...) is None:
            data.pop("kv_cache")
        if isinstance(data, dict) and data.get("accept_anomalies", ...) is False:
            data.pop("accept_anomalies")
        return data

    def with_absolute_paths(self, base: Path | None = None) -> "Recipe":
        """A copy whose local paths are absolute, relative ones taken against `base` (default: the working
        directory). Called once where a recipe enters (load_recipe, api.convert): nothing downstream,
        subprocesses and the manifest included, ever sees a path that depends on the working directory.
        A model.path that names no local file (a demo name, a hub id) is left as written."""
        base = Path(base or Path.cwd()).resolve()

        def absolute(p: str) -> str:
            q = Path(p).expanduser()
            return p if q.is_absolute() else str(base / q)

        mp = Path(self.model.path).expanduser()
        model = self.model
        if not mp.is_absolute() and (mp.exists() or mp.suffix == ".gguf"):
            model = model.model_copy(update={"path": str((base / mp).resolve())})
        calib = self.calibration
        if calib is not None:
            srcs = [s.model_copy(update={"path": absolute(s.path)}) if s.type in LOCAL_SOURCES else s
                    for s in calib.sources]
            calib = calib.model_copy(update={"sources": srcs})
        export = self.export
        if export.output_dir:
            export = export.model_copy(update={"output_dir": absolute(export.output_dir)})
        return self.model_copy(update={"model": model, "calibration": calib, "export": export})

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


def get_scheme_acts(name: str) -> bool:
    return SCHEMES[name].activations is not None


# ------------------------------------------------------------------------------------ error handling
def _loc_to_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in METHODS and out.endswith("]"):
            continue  # the discriminated-union tag pydantic inserts
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def _allowed_fields(loc: tuple) -> list[str]:
    model: Any = Recipe
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        if part in METHODS:
            model = STAGE_CLASSES[part]
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        model = None
        for cand in _candidates(ann):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                model = cand
                break
    return sorted(getattr(model, "model_fields", {})) if model else []


def _candidates(ann: Any) -> list[Any]:
    args = getattr(ann, "__args__", None)
    if not args:
        return [ann]
    out = []
    for a in args:
        out.extend(_candidates(a))
    return out


def format_errors(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        path = _loc_to_path(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            allowed = _allowed_fields(err["loc"])
            msg = f"unknown key {err['loc'][-1]!r}" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
        elif err["type"] == "union_tag_invalid":
            msg = f"{err['ctx']['tag']!r} is not a known method (known: {', '.join(METHODS)})"
        elif err["type"] == "union_tag_not_found":
            msg = f"missing 'method' (known: {', '.join(METHODS)})"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "literal_error":
            msg = f"{value!r} is not allowed ({err['ctx']['expected']})"
        elif not isinstance(value, (dict, list)) and "is not" not in msg:
            msg = f"{value!r}: {msg}"
        # recipe-level checks (model validators) already name the field they are about
        lines.append(f"{source}: {path}: {msg}" if path != "<root>" else f"{source}: {msg}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- overrides
_INDEX = re.compile(r"\[(\d+)\]")


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `--set a.b[0].c=value` (value parsed as YAML) to the raw recipe dict in place."""
    if "=" not in assignment:
        raise RecipeError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set calibration.num_samples=64")
    key, raw = assignment.split("=", 1)
    parts = [p for p in _INDEX.sub(r".\1", key.strip()).split(".") if p]
    if not parts:
        raise RecipeError(f"--set {assignment!r}: empty key")
    value = yaml.safe_load(raw) if raw.strip() else ""
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt_is_index = parts[i + 1].isdigit()
        if isinstance(node, list):
            idx = int(part)
            if idx >= len(node):
                raise RecipeError(f"--set {key}: index {idx} out of range (the list has {len(node)} items)")
            node = node[idx]
        else:
            if part not in node or node[part] is None:
                node[part] = [] if nxt_is_index else {}
            node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        idx = int(last)
        if idx >= len(node):
            raise RecipeError(f"--set {key}: index {idx} out of range (the list has {len(node)} items)")
        node[idx] = value
    else:
        node[last] = value


def parse_recipe(data: Any, source: str = "<recipe>") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: the recipe must be a YAML mapping with at least name, model and stages")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_errors(exc, source)) from None


def find_recipe(path: str | Path) -> Path:
    """A recipe file as given, else a shipped recipe by name (`smollm2-w8a8-rtn`); absolute."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.resolve()
    named = shipped_recipe(str(path))
    if named is not None:
        return named
    raise RecipeError(f"{path}: no such recipe file, and not the name of a shipped recipe "
                      "(`quantkit recipes list` shows them)")


def load_recipe(path: str | Path, overrides: list[str] | None = None, base: Path | None = None) -> Recipe:
    """Read, override and validate a recipe; its relative paths become absolute against `base` (default: the
    working directory, where the user typed them)."""
    path = find_recipe(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    if isinstance(data, dict):
        for ov in overrides or []:
            apply_override(data, ov)
    source = str(path) + (" (with --set overrides)" if overrides else "")
    return parse_recipe(data, source).with_absolute_paths(base)
