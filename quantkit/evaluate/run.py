"""`run_eval`: baseline and candidate through the same engine, the same prompts and the same load.

One engine in memory at a time: the baseline (or its cached measurement), the candidate, then each serving
variant: the candidate under other engine settings, the same run with the serving probes only
(quantkit/evaluate/probes). Each side's raw figures go to <output>/raw/<side>.json as they finish, so an
interrupted run keeps what it measured. Order, folder layout and caches: docs/evaluation.md.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import quantkit.evaluate.baseline_cache as BC
import quantkit.evaluate.quality as Q
from quantkit.engine import ENGINES, EngineError
from quantkit.engine.vllm_server import stop_stale_engines
from quantkit.errors import EXIT_ENVIRONMENT, QuantkitError
from quantkit.evaluate.phases import failed_phases
from quantkit.evaluate.probes import ARTIFACT, FULL, SERVING, RunContext, Served, Side
from quantkit.evaluate.speed import build_workload
from quantkit.evaluate.suite import load_suite, resolve_file
from quantkit.export.manifest import MANIFEST
from quantkit.hardware import hardware
from quantkit.io import atomic_write_json, sha256_file
from quantkit.locks import exclusive, lock_beside
from quantkit.model.sources import load_tokenizer, model_description
from quantkit.recipe import EvalSpec, parallelism



@dataclass
class EvalOptions:
    """run_eval's keyword arguments (the CLI's options)."""

    candidate_url: str | None = None  # measure an already-running server as the candidate
    baseline_url: str | None = None
    served_model: str | None = None  # the model name on an external server
    skip_baseline: bool = False
    overwrite: bool = False
    fresh_baseline: bool = False  # measure the baseline even when a cached measurement matches
    progress: Callable[[str], None] = print


@dataclass
class EvalJob:
    """One eval, resolved: absolute paths, the artifact's manifest, the suite and the report folder."""

    artifact: Path | None
    baseline: Path | None
    output: Path
    manifest: dict | None
    spec: EvalSpec
    name: str
    opts: EvalOptions
    t_start: float


def run_eval(artifact: Path | None, baseline: Path | None = None, suite: str | Path | None = None,
             output: Path | None = None, *, options: EvalOptions | None = None, **kwargs) -> Path:
    """Evaluate an artifact against its baseline; returns the report folder (<artifact>/eval by default).
    Keyword arguments are EvalOptions' fields (or pass `options`)."""
    job = _resolve(artifact, baseline, suite, output, options or EvalOptions(**kwargs))
    job.output.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(lock_beside(job.output), f"an eval into {job.output}"):
        return _run_eval_locked(job)


def _resolve(artifact, baseline, suite, output, opts: EvalOptions) -> EvalJob:
    from quantkit.evaluate.report import default_output
    from quantkit.export.manifest import read_manifest

    t_start = time.perf_counter()
    # the API boundary: every path below (engine command, report, raw files) is absolute
    artifact, baseline, output = (Path(p).expanduser().resolve() if p is not None else None
                                  for p in (artifact, baseline, output))
    manifest = read_manifest(artifact) if artifact is not None else None
    spec: EvalSpec = load_suite(suite, manifest)
    if baseline is None and manifest is not None and not opts.skip_baseline and opts.baseline_url is None:
        baseline = Path(manifest["base_model"]["resolved_dir"])
        if not (baseline / "config.json").is_file():
            raise FileNotFoundError(f"the artifact's base model {baseline} is missing; pass --baseline MODEL_DIR")
    if artifact is None and opts.candidate_url is None:
        raise QuantkitError("give an artifact folder, or --candidate-url for an already-running server")
    name = manifest["name"] if manifest else "external"
    output = output or (default_output(artifact) if artifact else Path("runs").resolve() / f"{name}-eval")
    return EvalJob(artifact, baseline, output, manifest, spec, name, opts, t_start)


def _run_eval_locked(job: EvalJob) -> Path:
    from quantkit.evaluate.report import write_report

    _prepare_output(job)
    ctx = _run_context(job)
    sides, reused = _measure_sides(job, ctx)
    cand = sides[-1]
    variants = _variants(ctx, cand)
    if ARTIFACT.wanted(ctx, cand):  # the export itself: is everything the plan meant to quantize quantized, and finite?
        cand.data["artifact"] = ARTIFACT.run(ctx, cand, None).figures
        atomic_write_json(job.output / "raw" / "candidate.json", cand.data)
    by_role = {s.role: s.data for s in sides}
    report = write_report(job.output, _report_context(job, ctx, reused), by_role.get("baseline"), by_role["candidate"],
                          variants)
    shutil.rmtree(job.output / "cache", ignore_errors=True)
    job.opts.progress(f"report written to {job.output} ({time.perf_counter() - job.t_start:.0f} s)")
    refuse_incomplete(report, job.output)
    return job.output


def _prepare_output(job: EvalJob) -> None:
    """Stop an engine a killed eval left in the folder, check both models' files, and empty the folder."""
    from quantkit.model.integrity import verify_model_folder

    stop_stale_engines(job.output)  # an engine a killed eval left behind in this folder (its record is in it)
    for folder, what in ((job.artifact, "artifact"), (job.baseline, "baseline model")):
        if folder is not None:
            verify_model_folder(folder, what)
    if job.output.exists() and any(job.output.iterdir()):
        if not job.opts.overwrite:
            raise FileExistsError(f"{job.output} already exists; pass --overwrite or choose --output")
        shutil.rmtree(job.output)
    job.output.mkdir(parents=True, exist_ok=True)


def _run_context(job: EvalJob) -> RunContext:
    tok_dir = Path(job.artifact or job.baseline) if (job.artifact or job.baseline) else None
    if tok_dir is None:
        raise QuantkitError("a local tokenizer is needed: pass the artifact folder or --baseline")
    tokenizer = load_tokenizer(tok_dir)
    _, items, warmup = _workload(job.spec, tokenizer)
    return RunContext(job.spec, job.output, tokenizer, tok_dir, items, warmup, job.opts.served_model, job.manifest,
                      job.opts.progress)


def _measure_sides(job: EvalJob, ctx: RunContext) -> tuple[list[Side], dict | None]:
    """Baseline (measured or reused from the cache) then candidate; returns them and the reuse record."""
    opts, sides = job.opts, []
    if not opts.skip_baseline and (job.baseline is not None or opts.baseline_url):
        sides.append(Side("baseline", job.baseline, opts.baseline_url, FULL))
    sides.append(Side("candidate", job.artifact, opts.candidate_url, FULL))
    reused = None
    for side in sides:
        reused = _measure_or_reuse(job, ctx, side) or reused
        if side.role == "baseline":
            ctx.baseline = side
        atomic_write_json(job.output / "raw" / f"{side.role}.json", side.data)
    return sides, reused


def _measure_or_reuse(job: EvalJob, ctx: RunContext, side: Side) -> dict | None:
    """Measure a side, or take a locally served baseline from the baseline cache; the reuse record if taken."""
    spec = ctx.spec
    cache = _baseline_cache_key(side, spec, _ppl_files(spec)) if side.role == "baseline" and not side.url else None
    entry = BC.lookup(cache[0]) if cache and not job.opts.fresh_baseline else None
    if entry is not None:
        side.data, side.quality, meta = BC.load(entry, job.output)
        _restore_cached_windows(side, spec, _ppl_files(spec), ctx.tokenizer)
        ctx.progress(f"[baseline] reusing the measurement of {meta['created']} ({entry}); --fresh-baseline measures anew")
        return {"from": meta["created"], "key": meta["key"], "entry": str(entry), "source_eval": meta.get("source_eval")}
    ctx.progress(f"[{side.role}] starting engine for {side.url or side.model_dir}")
    _measure(ctx, side)
    if cache is not None and not failed_phases(side.data, side.role, spec.model_dump(mode="json")):
        BC.store(cache[0], cache[1], side.data, side.quality, job.output)  # never an incomplete side
    return None


def _variants(ctx: RunContext, cand: Side) -> list[dict]:
    """Each serving variant of the suite: the candidate under other engine settings, serving probes only."""
    variants = []
    for v in ctx.spec.variants:
        if cand.url:
            ctx.progress(f"variant {v.name}: skipped (an external server's settings cannot be changed from here)")
            continue
        vs = Side(f"variant-{v.name}", cand.model_dir, None, SERVING, v.engine_args)
        ctx.progress(f"[variant {v.name}] engine args {v.engine_args}")
        _measure(ctx, vs)
        vs.data["variant"] = {"name": v.name, "engine_args": v.engine_args}
        atomic_write_json(ctx.output / "raw" / f"{vs.role}.json", vs.data)
        variants.append(vs.data)
    return variants


def _report_context(job: EvalJob, ctx: RunContext, reused: dict | None) -> dict:
    """What the report says about the eval itself: artifact, baseline, suite, machine, workload."""
    artifact, baseline, manifest = job.artifact, job.baseline, job.manifest or {}
    return {"artifact": {"path": str(artifact) if artifact else None, "name": job.name,
                         "quantization": manifest.get("quantization"), "size_bytes": manifest.get("size_bytes"),
                         "manifest_sha256": sha256_file(artifact / MANIFEST) if artifact else None},
            "baseline": {"path": str(baseline) if baseline else None, "url": job.opts.baseline_url, "reused": reused,
                         "description": model_description(baseline) if baseline else None},
            "suite": job.spec.model_dump(mode="json"), "hardware": hardware(),
            "wall_s": time.perf_counter() - job.t_start,
            "workload_items": [{"prompt_tokens": len(i.prompt_ids), "output_tokens": i.output_tokens}
                               for i in ctx.items]}


class IncompleteEval(QuantkitError):
    """A phase of the eval failed: the report is written (it records what failed), but it is not evidence."""

    exit_code = EXIT_ENVIRONMENT


def refuse_incomplete(report: dict, output: Path) -> None:
    if report.get("incomplete"):
        raise IncompleteEval(f"the eval is incomplete: {'; '.join(report['incomplete'])}. {output / 'report.json'} "
                             "records it and the gates refuse it; fix the cause and re-run `quantkit eval`")


def _ppl_files(spec: EvalSpec) -> list[Path]:
    return [resolve_file(f) for f in spec.perplexity_files]


def _workload(spec: EvalSpec, tokenizer) -> tuple[list[Path], list, list]:
    """(perplexity files, measured speed requests, warm-up requests): the seeded workload is cut from the
    perplexity texts, so every eval of the same suite sends the same prompts."""
    ppl_files = _ppl_files(spec)
    stream = [t for f in ppl_files for t in tokenizer(f.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]]
    w = spec.workload
    items = build_workload(stream, w.num_requests, w.prompt_tokens, w.output_tokens, w.seed)
    half = len(stream) // 2  # warm-up prompts from another part of the text than the measured ones
    warmup = build_workload(stream[half:] + stream[:half], w.warmup_requests, w.prompt_tokens, w.output_tokens, w.seed + 7)
    return ppl_files, items, warmup


def run_serving_variant(artifact: Path, spec: EvalSpec, engine_args: dict, quality_report: Path, output: Path,
                        progress: Callable[[str], None] = print) -> Path:
    """The artifact served with other engine settings, as a full report in `output`; returns its report.json.

    The serving probes are measured anew with `engine_args` added to the suite's (the candidate only: one
    engine start); quality, tasks and chat checks are carried over from `quality_report`, an eval of the
    same artifact with the same suite (engine settings decide scheduling and caching, not what the model
    computes); the report names where its quality figures came from ("carried_over")."""
    from quantkit.evaluate.report import write_report

    t_start = time.perf_counter()
    artifact, quality_report, output = (Path(p).expanduser().resolve() for p in (artifact, quality_report, output))
    base = _carried_over_report(artifact, spec, quality_report)
    output.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(lock_beside(output), f"an eval into {output}"):
        stop_stale_engines(output)
        if output.exists():
            shutil.rmtree(output)
        output.mkdir(parents=True)
        tokenizer = load_tokenizer(artifact)
        _, items, warmup = _workload(spec, tokenizer)
        ctx = RunContext(spec, output, tokenizer, artifact, items, warmup, progress=progress)
        side = Side("candidate", artifact, None, SERVING, engine_args)
        progress(f"[candidate] engine args {engine_args}: speed and memory (quality from {quality_report})")
        _measure(ctx, side)
        details = base["details"]
        cand = {**details["candidate"], **{k: side.data[k] for k in ("engine", "speed", "memory", "timings")}}
        suite = {**base["suite"], "engine_args": {**(base["suite"].get("engine_args") or {}), **engine_args}}
        context = {"artifact": base["artifact"], "baseline": base["baseline"], "suite": suite, "hardware": hardware(),
                   "wall_s": time.perf_counter() - t_start, "workload_items": (base.get("workload") or {}).get("items"),
                   "carried_over": {"from": str(quality_report),
                                    "what": "quality, tasks, chat checks and the reference column (candidate); "
                                            "the whole baseline"}}
        report = write_report(output, context, details.get("baseline"), cand, [])
        shutil.rmtree(output / "cache", ignore_errors=True)
    progress(f"report written to {output} ({time.perf_counter() - t_start:.0f} s)")
    refuse_incomplete(report, output)
    return output / "report.json"


def _carried_over_report(artifact: Path, spec: EvalSpec, quality_report: Path) -> dict:
    """The eval whose quality a serving variant carries over: of the same artifact, with the same suite."""
    import json

    base = json.loads(quality_report.read_text(encoding="utf-8"))
    if Path((base.get("artifact") or {}).get("path") or "").resolve() != artifact:
        raise QuantkitError(f"{quality_report} is the report of {base.get('artifact', {}).get('path')}, not of "
                            f"{artifact}: a serving variant carries over the quality of its own artifact's eval")
    same = {k: v for k, v in spec.model_dump(mode="json").items() if k != "engine_args"}
    theirs = {k: v for k, v in (base.get("suite") or {}).items() if k != "engine_args"}
    if same != theirs:
        diff = sorted(k for k in set(same) | set(theirs) if same.get(k) != theirs.get(k))
        raise QuantkitError(f"{quality_report} was measured with another suite (differs in {', '.join(diff)}); "
                            "re-run its eval with this suite first")
    return base


def _restore_cached_windows(side: Side, spec: EvalSpec, ppl_files: list[Path], tokenizer) -> None:
    """A cache entry from before per-window data was recorded: recompute its window layout from the same
    files and settings (only if the scored tokens match), so the baseline gets bootstrap intervals too."""
    q = side.data.get("quality")
    if side.quality is None or not isinstance(q, dict) or "error" in q or "windows" in q:
        return
    if Q.restore_windows(side.quality, ppl_files, tokenizer, spec.perplexity_window, spec.perplexity_max_tokens):
        q["windows"] = side.quality.window_sums()
        if isinstance(q.get("divergence"), dict):  # against itself, as measured, now with its windows
            q["divergence"] = Q.divergence(side.quality, side.quality, spec.logprobs_top_k)


def _baseline_cache_key(side: Side, spec: EvalSpec, ppl_files: list[Path]) -> tuple[str, dict]:
    """(key, parts) of the baseline cache for a locally served baseline (see quantkit.evaluate.baseline_cache)."""
    from quantkit.engine.vllm_server import resolve_dtype, vllm_version
    from quantkit.resources import shipped

    task_files = [f for sub in ("tasks", "data") for f in sorted(shipped("evals", sub).glob("*")) if f.is_file()]
    parts = BC.key_parts(side.model_dir, spec.model_dump(mode="json"), ppl_files + task_files, "vllm",
                         vllm_version(), resolve_dtype(spec.dtype)[0], hardware())
    return BC.make_key(parts), parts


# ----------------------------------------------------------------------------------------- one side
def _measure(ctx: RunContext, side: Side) -> None:
    """Start the side's engine and run its probes: those off the engine (the reference) while it boots, the
    rest against it; the figures go to side.data and raw/<role>.json."""
    timings: dict = {}
    off = [p for p in side.probes if not p.on_engine and p.wanted(ctx, side)]
    boot = (lambda: _leaving_a_core(lambda: _run_probes(ctx, side, off, None, timings))) if off else None
    engine = _engine(ctx, side, boot)
    t0 = time.perf_counter()
    with engine as ep:
        timings["engine_start_s"] = time.perf_counter() - t0
        side.data["engine"] = {"name": ep.engine, "version": ep.version, "model": ep.model, "info": ep.info,
                               "pid": ep.pid, "log": str(ep.log_path) if ep.log_path else None,
                               "parallelism": (parallelism({**ctx.spec.engine_args, **side.extra_args})
                                               if not side.url else None)}
        ctx.say(side, f"engine ready in {timings['engine_start_s']:.0f} s ({ep.engine} {ep.version or ''})")
        on = [p for p in side.probes if p.on_engine and p.wanted(ctx, side)]
        _run_probes(ctx, side, on, Served(ep, engine), timings)
    _run_probes(ctx, side, [p for p in off if p.name not in side.data], None, timings)  # an external server
    side.data["timings"] = timings
    atomic_write_json(ctx.output / "raw" / f"{side.role}.json", side.data)


def _run_probes(ctx: RunContext, side: Side, probes: list, served: Served | None, timings: dict) -> None:
    for probe in probes:
        t = time.perf_counter()
        result = probe.run(ctx, side, served)
        result.seconds = time.perf_counter() - t
        side.data[probe.name] = result.figures
        if probe.timed:
            timings[f"{probe.name}_s"] = result.seconds


def _engine(ctx: RunContext, side: Side, while_loading: Callable[[], None] | None):
    """The side's engine, not yet started: an external server by URL, else vLLM with the suite's settings, the
    side's own and the KV-cache settings its export needs; `while_loading` runs while vLLM boots."""
    spec = ctx.spec
    kv_args = _kv_cache_settings(side, {**spec.engine_args, **side.extra_args}, ctx.progress, spec.dtype)
    if side.url:
        return ENGINES["openai"](side.url, model=ctx.served_model, tokenizer_dir=ctx.tok_dir)
    return ENGINES["vllm"](model_dir=side.model_dir, run_dir=ctx.output, served_name=side.role,
                           tokenizer_dir=side.model_dir,
                           engine_args={**spec.engine_args, **kv_args, **side.extra_args},
                           dtype=spec.dtype, max_model_len=spec.max_model_len, kv_cache_gib=spec.kv_cache_gib,
                           ready_timeout_s=spec.ready_timeout_s, while_loading=while_loading)


def _kv_cache_settings(side: Side, engine_args: dict, progress, engine_dtype: str = "auto") -> dict:
    """The engine settings for a model whose export carries an FP8 KV-cache scheme (quantkit/engine/capability.py
    artifact_kv_cache): the fp8 cache where this machine serves it, else the model-dtype cache, said plainly.
    Recorded in side.data["kv_cache"]; a kv_cache_dtype or hf_overrides the suite sets itself wins."""
    from quantkit.engine.capability import artifact_kv_cache
    from quantkit.engine.vllm_server import _device, resolve_dtype

    if side.url or side.model_dir is None:
        return {}
    kv = artifact_kv_cache(side.model_dir, _device(), resolve_dtype(engine_dtype)[0])
    if kv is None:
        return {}
    user = {k: engine_args[k] for k in ("kv_cache_dtype", "hf_overrides") if k in engine_args}
    args = {} if user else kv["engine_args"]
    served: bool | None = kv["servable"]
    if user:
        served = None  # what the suite's settings make of the scheme is theirs to say
        note = f"the suite's engine_args set {user}: quantkit leaves the KV cache as they say"
    elif kv["servable"]:
        note = f"served with kv_cache_dtype fp8: {kv['reason']}"
    elif args is None:
        raise EngineError(f"{side.model_dir}: its FP8 KV cache cannot be served here, nor the export without it: "
                          f"{kv['reason']}")
    else:
        note = (f"NOT served with the FP8 KV cache here: {kv['reason']}. The candidate runs with the model-dtype "
                "cache, so its KV-cache capacity, quality and speed figures do not include the FP8 cache")
    side.data["kv_cache"] = {"scheme": kv["scheme"], "fp8_cache_served": served,
                             "reason": note if user else kv["reason"], "engine_args": args or user}
    progress(f"[{side.role}] KV cache: {note}")
    return args


def _leaving_a_core(fn: Callable[[], None]) -> None:
    """Run `fn` with torch's threads lowered to all cores but one (the booting engine's), then restore them."""
    import os

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(before, (os.cpu_count() or 2) - 1)))
    try:
        fn()
    finally:
        torch.set_num_threads(before)


__all__ = ["EvalOptions", "run_eval", "run_serving_variant", "EngineError"]
