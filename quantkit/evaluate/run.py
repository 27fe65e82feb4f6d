"""`run_eval`: baseline and candidate through the same engine, the same prompts and the same load.

Order (one engine in memory at a time): baseline engine starts (meanwhile, in this process, the
engine-free reference perplexity of the same windows) -> quality, tasks, chat checks (tool calls,
safety), speed -> stop; candidate engine (and its reference while it starts) -> the same, plus divergence
against the baseline's log-probabilities and the checks' agreement with the baseline's answers -> stop;
then each
serving variant (candidate only, speed only, one engine start each). Every phase writes its raw
result to <output>/raw/<side>.json as it finishes, so an interrupted run keeps what it measured.

Output folder: `--output`, else `<artifact>/eval` (where `quantkit gate ARTIFACT` looks; the
manifest's checksums cover only the artifact's top-level files, so the subfolder does not disturb
`quantkit inspect`). Inside: report.json, report.md, plots/*.png, logs/ (engine logs), raw/ (per-side
figures and per-request records), tasks/ (lm-eval samples and rendered task files). vLLM and inductor
caches live in cache/ during the run and are removed at the end (scratch, not evidence).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

import httpx

from quantkit.engine import ENGINES, EngineError
from quantkit.engine.client import ServerError, prompt_logprobs
from quantkit.engine.prom import kv_capacity_tokens
from quantkit.engine.vllm_server import stop_stale_engines
from quantkit.errors import EXIT_ENVIRONMENT, QuantkitError
from quantkit.evaluate import baseline_cache as BC
from quantkit.evaluate import chat_checks as CC
from quantkit.evaluate import quality as Q
from quantkit.evaluate.memory import memory_figures
from quantkit.evaluate.phases import failed_phases
from quantkit.export.coverage import export_coverage
from quantkit.export.manifest import MANIFEST
from quantkit.evaluate.reference import reference_perplexity
from quantkit.evaluate.speed import build_workload, run_speed
from quantkit.evaluate.suite import load_suite, resolve_file
from quantkit.evaluate.tasks import TaskError, run_tasks
from quantkit.hardware import hardware
from quantkit.io import atomic_write_json, sha256_file
from quantkit.locks import exclusive, lock_beside
from quantkit.model.sources import load_tokenizer, model_description
from quantkit.recipe import EvalSpec, parallelism


class _Side:
    """One model's measurements (baseline, candidate or a variant)."""

    def __init__(self, role: str, model_dir: Path | None, url: str | None) -> None:
        self.role, self.model_dir, self.url = role, model_dir, url
        self.data: dict = {"role": role, "model_dir": str(model_dir) if model_dir else None, "url": url}
        self.quality: Q.QualityRun | None = None


def run_eval(artifact: Path | None, baseline: Path | None = None, suite: str | Path | None = None,
             output: Path | None = None, *, candidate_url: str | None = None, baseline_url: str | None = None,
             served_model: str | None = None, skip_baseline: bool = False, overwrite: bool = False,
             fresh_baseline: bool = False, progress: Callable[[str], None] = print) -> Path:
    """Evaluate an artifact against its baseline; returns the report folder (see the module docstring)."""
    from quantkit.evaluate.report import default_output
    from quantkit.export.manifest import read_manifest

    t_start = time.perf_counter()
    # the API boundary: every path below (engine command, report, raw files) is absolute
    artifact, baseline, output = (Path(p).expanduser().resolve() if p is not None else None
                                  for p in (artifact, baseline, output))
    manifest = read_manifest(artifact) if artifact is not None else None
    spec: EvalSpec = load_suite(suite, manifest)
    if baseline is None and manifest is not None and not skip_baseline and baseline_url is None:
        baseline = Path(manifest["base_model"]["resolved_dir"])
        if not (baseline / "config.json").is_file():
            raise FileNotFoundError(f"the artifact's base model {baseline} is missing; pass --baseline MODEL_DIR")
    if artifact is None and candidate_url is None:
        raise QuantkitError("give an artifact folder, or --candidate-url for an already-running server")
    name = manifest["name"] if manifest else "external"
    output = output or (default_output(artifact) if artifact else Path("runs").resolve() / f"{name}-eval")
    output.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(lock_beside(output), f"an eval into {output}"):
        return _run_eval_locked(artifact, baseline, output, manifest, spec, name, candidate_url, baseline_url,
                                served_model, skip_baseline, overwrite, fresh_baseline, progress, t_start)


def _run_eval_locked(artifact, baseline, output: Path, manifest, spec: EvalSpec, name: str, candidate_url,
                     baseline_url, served_model, skip_baseline: bool, overwrite: bool, fresh_baseline: bool, progress,
                     t_start: float) -> Path:
    from quantkit.evaluate.report import write_report
    from quantkit.model.integrity import verify_model_folder

    stop_stale_engines(output)  # an engine a killed eval left behind in this folder (its record is in it)
    for folder, what in ((artifact, "artifact"), (baseline, "baseline model")):
        if folder is not None:
            verify_model_folder(folder, what)
    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{output} already exists; pass --overwrite or choose --output")
        shutil.rmtree(output)
    output.mkdir(parents=True, exist_ok=True)

    tok_dir = Path(artifact or baseline) if (artifact or baseline) else None
    if tok_dir is None:
        raise QuantkitError("a local tokenizer is needed: pass the artifact folder or --baseline")
    tokenizer = load_tokenizer(tok_dir)
    ppl_files, items, warmup = _workload(spec, tokenizer)

    sides = []
    if not skip_baseline and (baseline is not None or baseline_url):
        sides.append(_Side("baseline", Path(baseline) if baseline else None, baseline_url))
    sides.append(_Side("candidate", Path(artifact) if artifact else None, candidate_url))
    base_quality = base_checks = None
    reused = None
    for side in sides:
        cache = _baseline_cache_key(side, spec, ppl_files) if side.role == "baseline" and not side.url else None
        entry = BC.lookup(cache[0]) if cache and not fresh_baseline else None
        if entry is not None:
            side.data, side.quality, meta = BC.load(entry, output)
            _restore_cached_windows(side, spec, ppl_files, tokenizer)
            reused = {"from": meta["created"], "key": meta["key"], "entry": str(entry),
                      "source_eval": meta.get("source_eval")}
            progress(f"[baseline] reusing the measurement of {meta['created']} ({entry}); --fresh-baseline measures anew")
        else:
            progress(f"[{side.role}] starting engine for {side.url or side.model_dir}")
            _measure(side, spec, output, tokenizer, tok_dir, items, warmup, base_quality, served_model, progress,
                     base_checks=base_checks)
            if cache is not None and not failed_phases(side.data, side.role, spec.model_dump(mode="json")):
                BC.store(cache[0], cache[1], side.data, side.quality, output)  # never an incomplete side
        if side.role == "baseline":
            base_quality = side.quality
            base_checks = side.data.get("checks")
        atomic_write_json(output / "raw" / f"{side.role}.json", side.data)

    cand = sides[-1]
    variants = _variants(cand, spec, output, progress, lambda vs, args: _measure(
        vs, spec, output, tokenizer, tok_dir, items, warmup, None, served_model, progress, extra_args=args,
        speed_only=True))
    if artifact is not None:  # the export itself: is everything the plan meant to quantize quantized, and finite?
        cand.data["artifact"] = export_coverage(artifact, manifest)
        atomic_write_json(output / "raw" / "candidate.json", cand.data)
    context = {"artifact": {"path": str(artifact) if artifact else None, "name": name,
                            "quantization": (manifest or {}).get("quantization"),
                            "size_bytes": (manifest or {}).get("size_bytes"),
                            "manifest_sha256": sha256_file(artifact / MANIFEST) if artifact else None},
               "baseline": {"path": str(baseline) if baseline else None, "url": baseline_url, "reused": reused,
                            "description": model_description(baseline) if baseline else None},
               "suite": spec.model_dump(mode="json"), "hardware": hardware(), "wall_s": time.perf_counter() - t_start,
               "workload_items": [{"prompt_tokens": len(i.prompt_ids), "output_tokens": i.output_tokens} for i in items]}
    by_role = {s.role: s.data for s in sides}
    report = write_report(output, context, by_role.get("baseline"), by_role["candidate"], variants)
    shutil.rmtree(output / "cache", ignore_errors=True)
    progress(f"report written to {output} ({time.perf_counter() - t_start:.0f} s)")
    refuse_incomplete(report, output)
    return output


def _variants(cand: _Side, spec: EvalSpec, output: Path, progress, measure: Callable[[_Side, dict], None]) -> list[dict]:
    """Each serving variant of the suite: the candidate under other engine settings, speed and memory only."""
    variants = []
    for v in spec.variants:
        if cand.url:
            progress(f"variant {v.name}: skipped (an external server's settings cannot be changed from here)")
            continue
        vs = _Side(f"variant-{v.name}", cand.model_dir, None)
        progress(f"[variant {v.name}] engine args {v.engine_args}")
        measure(vs, v.engine_args)
        vs.data["variant"] = {"name": v.name, "engine_args": v.engine_args}
        atomic_write_json(output / "raw" / f"{vs.role}.json", vs.data)
        variants.append(vs.data)
    return variants


class IncompleteEval(QuantkitError):
    """A phase of the eval failed: the report is written (it records what failed), but it is not evidence."""

    exit_code = EXIT_ENVIRONMENT


def refuse_incomplete(report: dict, output: Path) -> None:
    if report.get("incomplete"):
        raise IncompleteEval(f"the eval is incomplete: {'; '.join(report['incomplete'])}. {output / 'report.json'} "
                             "records it and the gates refuse it; fix the cause and re-run `quantkit eval`")


def _workload(spec: EvalSpec, tokenizer) -> tuple[list[Path], list, list]:
    """(perplexity files, measured speed requests, warm-up requests): the seeded workload is cut from the
    perplexity texts, so every eval of the same suite sends the same prompts."""
    ppl_files = [resolve_file(f) for f in spec.perplexity_files]
    stream = [t for f in ppl_files for t in tokenizer(f.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]]
    w = spec.workload
    items = build_workload(stream, w.num_requests, w.prompt_tokens, w.output_tokens, w.seed)
    half = len(stream) // 2  # warm-up prompts from another part of the text than the measured ones
    warmup = build_workload(stream[half:] + stream[:half], w.warmup_requests, w.prompt_tokens, w.output_tokens, w.seed + 7)
    return ppl_files, items, warmup


def run_serving_variant(artifact: Path, spec: EvalSpec, engine_args: dict, quality_report: Path, output: Path,
                        progress: Callable[[str], None] = print) -> Path:
    """The artifact served with other engine settings, as a full report in `output`; returns its report.json.

    Speed and memory are measured anew with `engine_args` added to the suite's (the candidate only: one
    engine start); quality, tasks and chat checks are carried over from `quality_report`, an eval of the
    same artifact with the same suite. Engine settings (prefix caching, batch limits, KV-cache size) decide
    how requests are scheduled and cached, not what the model computes; the report names where its quality
    figures came from ("carried_over")."""
    import json

    from quantkit.evaluate.report import write_report

    t_start = time.perf_counter()
    artifact, quality_report, output = (Path(p).expanduser().resolve() for p in (artifact, quality_report, output))
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
    output.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(lock_beside(output), f"an eval into {output}"):
        stop_stale_engines(output)
        if output.exists():
            shutil.rmtree(output)
        output.mkdir(parents=True)
        tokenizer = load_tokenizer(artifact)
        _, items, warmup = _workload(spec, tokenizer)
        side = _Side("candidate", artifact, None)
        progress(f"[candidate] engine args {engine_args}: speed and memory (quality from {quality_report})")
        _measure(side, spec, output, tokenizer, artifact, items, warmup, None, None, progress,
                 extra_args=engine_args, speed_only=True)
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


def _restore_cached_windows(side: _Side, spec: EvalSpec, ppl_files: list[Path], tokenizer) -> None:
    """A cache entry from before per-window data was recorded: recompute its window layout from the same
    files and settings (only if the scored tokens match), so the baseline gets bootstrap intervals too."""
    q = side.data.get("quality")
    if side.quality is None or not isinstance(q, dict) or "error" in q or "windows" in q:
        return
    if Q.restore_windows(side.quality, ppl_files, tokenizer, spec.perplexity_window, spec.perplexity_max_tokens):
        q["windows"] = side.quality.window_sums()
        if isinstance(q.get("divergence"), dict):  # against itself, as measured, now with its windows
            q["divergence"] = Q.divergence(side.quality, side.quality, spec.logprobs_top_k)


def _baseline_cache_key(side: _Side, spec: EvalSpec, ppl_files: list[Path]) -> tuple[str, dict]:
    """(key, parts) of the baseline cache for a locally served baseline (see quantkit.evaluate.baseline_cache)."""
    from quantkit.engine.vllm_server import resolve_dtype, vllm_version
    from quantkit.resources import shipped

    task_files = [f for sub in ("tasks", "data") for f in sorted(shipped("evals", sub).glob("*")) if f.is_file()]
    parts = BC.key_parts(side.model_dir, spec.model_dump(mode="json"), ppl_files + task_files, "vllm",
                         vllm_version(), resolve_dtype(spec.dtype)[0], hardware())
    return BC.make_key(parts), parts


def _measure(side: _Side, spec: EvalSpec, output: Path, tokenizer, tok_dir: Path, items, warmup,
             base_quality, served_model, progress, extra_args: dict | None = None, speed_only: bool = False,
             base_checks: dict | None = None) -> None:
    d = side.data
    timings: dict = {}
    want_reference = spec.reference and not speed_only and side.model_dir is not None

    def reference() -> None:
        t = time.perf_counter()
        d["reference"] = _reference(side, spec, tokenizer, progress)
        timings["reference_s"] = time.perf_counter() - t

    kv_args = _kv_cache_settings(side, {**spec.engine_args, **(extra_args or {})}, progress, spec.dtype)
    if side.url:
        engine = ENGINES["openai"](side.url, model=served_model, tokenizer_dir=tok_dir)
    else:  # the reference is computed here while the engine boots (its imports leave a core idle)
        engine = ENGINES["vllm"](model_dir=side.model_dir, run_dir=output, served_name=side.role,
                                 tokenizer_dir=side.model_dir,
                                 engine_args={**spec.engine_args, **kv_args, **(extra_args or {})},
                                 dtype=spec.dtype, max_model_len=spec.max_model_len, kv_cache_gib=spec.kv_cache_gib,
                                 ready_timeout_s=spec.ready_timeout_s,
                                 while_loading=(lambda: _leaving_a_core(reference)) if want_reference else None)
    t0 = time.perf_counter()
    with engine as ep:
        timings["engine_start_s"] = time.perf_counter() - t0
        d["engine"] = {"name": ep.engine, "version": ep.version, "model": ep.model, "info": ep.info, "pid": ep.pid,
                       "log": str(ep.log_path) if ep.log_path else None,
                       "parallelism": parallelism({**spec.engine_args, **(extra_args or {})}) if not side.url else None}
        progress(f"[{side.role}] engine ready in {timings['engine_start_s']:.0f} s ({ep.engine} {ep.version or ''})")
        if not speed_only:
            t = time.perf_counter()
            d["quality"] = _quality(side, spec, ep, tokenizer, base_quality, progress)
            timings["quality_s"] = time.perf_counter() - t
            if spec.tasks:
                t = time.perf_counter()
                progress(f"[{side.role}] lm-eval tasks {spec.tasks} (limit {spec.task_limit})")
                try:
                    d["tasks"] = run_tasks(ep, spec.tasks, spec.task_limit, spec.task_concurrency, spec.max_model_len,
                                           output / "tasks" / side.role)
                except TaskError as exc:
                    d["tasks"] = {"error": str(exc)}
                    progress(f"[{side.role}] tasks failed: {exc}")
                timings["tasks_s"] = time.perf_counter() - t
            if spec.checks:
                t = time.perf_counter()
                d["checks"] = _checks(side, spec, ep, tokenizer, base_checks, progress)
                timings["checks_s"] = time.perf_counter() - t
        t = time.perf_counter()
        w = spec.workload
        # an engine that has just served the chat checks (generation at check_concurrency) needs no warm-up
        served = bool(d.get("checks")) and not any("error" in v for v in d["checks"].values())
        d["speed"] = run_speed(ep, items, [] if served else warmup, w.concurrency, w.request_rates, w.temperature,
                               w.seed, progress=lambda m: progress(f"[{side.role}] {m}"))
        timings["speed_s"] = time.perf_counter() - t
        kv_metrics = None
        try:
            kv_metrics = kv_capacity_tokens(httpx.get(f"{ep.base_url}/metrics", timeout=10).text)
        except httpx.HTTPError:
            kv_metrics = None
        proc = engine.monitor.snapshot() if hasattr(engine, "monitor") else None
        d["memory"] = memory_figures(side.model_dir if not side.url else None, ep.info, kv_metrics, proc)
    if want_reference and "reference" not in d:  # not computed during the start (an external server)
        reference()
    d["timings"] = timings
    atomic_write_json(output / "raw" / f"{side.role}.json", d)


def _kv_cache_settings(side: _Side, engine_args: dict, progress, engine_dtype: str = "auto") -> dict:
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


def _reference(side: _Side, spec: EvalSpec, tokenizer, progress) -> dict:
    """The engine-free perplexity of the same windows (quantkit/evaluate/reference.py)."""
    progress(f"[{side.role}] reference perplexity (transformers, float32, the same windows)")
    try:
        out = reference_perplexity(side.model_dir, [resolve_file(f) for f in spec.perplexity_files], tokenizer,
                                   spec.perplexity_window, spec.perplexity_max_tokens)
    except (OSError, ValueError, RuntimeError, ImportError) as exc:  # never lose the engine's figures to it
        progress(f"[{side.role}] reference perplexity unavailable: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if "skipped" in out:
        progress(f"[{side.role}] reference perplexity skipped: {out['skipped']}")
    else:
        progress(f"[{side.role}] reference perplexity {out['perplexity']:.3f} ({out['seconds']:.0f} s)")
    return out


def _checks(side: _Side, spec: EvalSpec, ep, tokenizer, base_checks: dict | None, progress) -> dict:
    """The tool-call and safety checks (quantkit/evaluate/chat_checks.py), compared with the baseline's."""
    progress(f"[{side.role}] chat checks {spec.checks} (limit {spec.check_limit})")
    try:
        out = CC.run_checks(ep, spec.checks, spec.check_limit, spec.check_concurrency, tokenizer,
                            progress=lambda m: progress(f"[{side.role}] {m}"))
    except CC.CheckError as exc:
        progress(f"[{side.role}] checks failed: {exc}")
        return {name: {"error": str(exc)} for name in spec.checks}
    CC.compare_checks(out if side.role == "baseline" else base_checks, out)
    return out


def _quality(side: _Side, spec: EvalSpec, ep, tokenizer, base_quality, progress) -> dict:
    files = [resolve_file(f) for f in spec.perplexity_files]
    progress(f"[{side.role}] perplexity on {', '.join(f.name for f in files)}")
    try:
        with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
            run = Q.score_texts(files, tokenizer, lambda ids: prompt_logprobs(client, ep.base_url, ep.model, ids,
                                                                              spec.logprobs_top_k),
                                spec.perplexity_window, spec.perplexity_max_tokens)
    except (ServerError, httpx.HTTPError, RuntimeError) as exc:
        progress(f"[{side.role}] perplexity unavailable: {exc}")
        return {"error": str(exc)}
    side.quality = run
    out = {"perplexity": Q.perplexity(run.actual_logprobs()), "tokens": len(run.actual), "per_file": run.per_file,
           "window": spec.perplexity_window, "top_k": spec.logprobs_top_k}
    sums = run.window_sums()  # per window, for the bootstrap intervals (quantkit/evaluate/confidence.py)
    if sums is not None:
        out["windows"] = sums
    if side.role == "baseline":
        out["divergence"] = Q.divergence(run, run, spec.logprobs_top_k)  # itself: KL 0, agreement 1
    elif base_quality is not None:
        out["divergence"] = Q.divergence(base_quality, run, spec.logprobs_top_k)
    return out


__all__ = ["run_eval", "run_serving_variant", "EngineError"]
