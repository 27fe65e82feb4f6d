"""MLflow runs for every conversion, eval, gate and study, linked into one lineage (issue 35).

A command opens its run before any weight loads (a bad store fails in a second, naming the URI and the fix),
logs what it produced from the files it wrote (manifest.json, report.json, gate.json: the same evidence the
registry checks), and ends FINISHED, FAILED (with the error line and crash-log path) or KILLED. The links
are searched by content hash, never written into an artifact, so tracking cannot change an export's bytes:

    convert run   tags quantkit.manifest_sha256
    eval run      tags quantkit.manifest_sha256, quantkit.report_sha256, quantkit.convert_run
    gate run      tags quantkit.report_sha256, quantkit.gate_sha256, quantkit.eval_run
    registry version tags quantkit.convert_run, quantkit.eval_run, quantkit.gate_run (publish adds them)

The store is the registry's: the embedded sqlite under $QUANTKIT_HOME/registry by default, or
QUANTKIT_TRACKING_URI (sqlite:///path.db or http(s)://host:port). QUANTKIT_NO_TRACK=1 or `--no-track`
turns tracking off. One experiment per base model: `quantkit/<model folder name>`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import EXIT_ENVIRONMENT, QuantkitError
from quantkit.io import sha256_file

KINDS = ("convert", "eval", "gate", "tune", "tune-cell", "sensitivity", "compare")
TAG = "quantkit."
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


class TrackingError(QuantkitError):
    exit_code = EXIT_ENVIRONMENT


def enabled(flag: bool | None = None) -> bool:
    """Tracking is on unless `--no-track` (flag False) or QUANTKIT_NO_TRACK is set to anything but 0."""
    if flag is not None:
        return flag
    return os.environ.get("QUANTKIT_NO_TRACK", "") in ("", "0")


def unavailable() -> str | None:
    """Why the default store cannot be used here (MLflow not installed: a GPU image or a slim install), or None.
    Only the default store is skipped this way: a store asked for by QUANTKIT_TRACKING_URI still fails closed."""
    if os.environ.get("QUANTKIT_TRACKING_URI"):
        return None
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        return ("tracking is off: MLflow is not installed (pip install 'mlflow>=3.1,<4' to record runs; "
                "QUANTKIT_NO_TRACK=1 silences this line)")
    return None


def store_uri() -> str:
    """The tracking store: QUANTKIT_TRACKING_URI, else the embedded registry's sqlite file."""
    return _store()[0]


def _store() -> tuple[str, str | None]:
    """(store URI, artifact root for a new experiment: beside a sqlite file, as the registry keeps its artifacts;
    None for a server, which decides), resolved as the registry resolves its own."""
    from quantkit.registry.base import RegistryError
    from quantkit.registry.mlflow_backend import resolve_uri

    uri = os.environ.get("QUANTKIT_TRACKING_URI") or None
    try:
        return resolve_uri(uri)
    except RegistryError as exc:
        raise TrackingError(f"QUANTKIT_TRACKING_URI={uri!r}: {exc}") from None


def experiment_name(model: str) -> str:
    """`quantkit/<name>`: the last component of the model's path or id, so a recipe's `smollm2-135m`, the resolved
    folder an eval reports and a hub id's cache all land in one experiment."""
    return f"quantkit/{Path(str(model).rstrip('/')).name or 'unknown'}"


@dataclass
class Run:
    """One open MLflow run; every call goes to that run only (nothing is set process-wide)."""

    client: object
    run_id: str
    uri: str
    experiment_id: str

    def params(self, values: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], _short(v)) for k, v in flatten(values).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def metrics(self, values: dict[str, float], step: int = 0) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_metric_key(k), float(v), now, step) for k, v in values.items() if _number(v)]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i:i + 500])

    def tags(self, values: dict[str, object]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, _short(v, 5000)) for k, v in values.items() if v is not None]
        if items:
            self.client.log_batch(self.run_id, tags=items)

    def artifact(self, path: Path, folder: str | None = None) -> None:
        if Path(path).is_file():
            self.client.log_artifact(self.run_id, str(path), folder)

    def text(self, content: str, name: str) -> None:
        self.client.log_text(self.run_id, content, name)

    def child(self, name: str, kind: str, tags: dict | None = None) -> "Run":
        """A nested run (a tune cell): same experiment, linked to this one as its parent."""
        run = self.client.create_run(self.experiment_id, run_name=name, tags={
            "mlflow.parentRunId": self.run_id, TAG + "kind": kind, **{k: str(v) for k, v in (tags or {}).items()}})
        return Run(self.client, run.info.run_id, self.uri, self.experiment_id)

    def end(self, status: str = "FINISHED", error: str | None = None, crash_log: str | None = None) -> None:
        self.tags({TAG + "error": error, TAG + "crash_log": crash_log})
        self.client.set_terminated(self.run_id, status)


def open_run(kind: str, model: str, name: str, tags: dict | None = None) -> Run:
    """Open a run in the model's experiment now, before any work, so a bad store fails fast and clearly."""
    if kind not in KINDS:
        raise ValueError(f"tracking kind {kind!r}: one of {KINDS}")
    uri, artifact_root = _store()
    with _fast_failing_http():
        try:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            exp = _experiment(client, experiment_name(model), artifact_root)
            reap_dead_runs(client, exp)
            run = client.create_run(exp, run_name=name, tags={
                TAG + "kind": kind, TAG + "model": str(model), TAG + "host": socket.gethostname(),
                TAG + "pid": str(os.getpid()), **{k: str(v) for k, v in (tags or {}).items()}})
        except Exception as exc:  # noqa: BLE001 - any failure to reach the store is the same refusal
            raise TrackingError(f"tracking store {uri}: {_one_line(exc)}. Fix QUANTKIT_TRACKING_URI (sqlite:///path.db "
                                "or http(s)://host:port), or turn tracking off with --no-track / "
                                "QUANTKIT_NO_TRACK=1") from None
    return Run(client, run.info.run_id, uri, exp)


@contextlib.contextmanager
def _fast_failing_http():
    """An unreachable tracking server fails in seconds, not after MLflow's default minutes of retries."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)


def reap_dead_runs(client, experiment_id: str) -> int:
    """Mark KILLED the RUNNING runs this host started whose process is gone (kill -9, power loss): nothing in
    the process could end them. Returns how many were marked."""
    host, n = socket.gethostname(), 0
    for r in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=200):
        tags = r.data.tags
        if tags.get(TAG + "host") != host or not tags.get(TAG + "pid", "").isdigit() or _alive(int(tags[TAG + "pid"])):
            continue
        client.set_tag(r.info.run_id, TAG + "error", f"process {tags[TAG + 'pid']} on {host} ended without ending its "
                                                     "run (killed, e.g. kill -9 or out of memory)")
        client.set_terminated(r.info.run_id, "KILLED")
        n += 1
    return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _experiment(client, name: str, artifact_root: str | None) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    from mlflow.exceptions import MlflowException

    try:  # a model-development experiment: MLflow's UI then shows runs, metrics and comparisons, not GenAI pages
        return client.create_experiment(name, artifact_location=artifact_root,
                                        tags={"mlflow.experimentKind": "custom_model_development"})
    except MlflowException:  # created concurrently
        return client.get_experiment_by_name(name).experiment_id


# ------------------------------------------------------------------------------ what each command logs
def log_convert(run: Run, artifact: Path) -> None:
    """The resolved recipe (params and YAML), calibration fingerprint, per-layer SQNR / GPTQ loss (step = layer),
    wall time per phase, peak memory, the manifest and the log."""
    import yaml

    man = json.loads((artifact / "manifest.json").read_text())
    conv = man.get("conversion") or {}
    cal = man.get("calibration") or {}
    run.params({"recipe": man.get("recipe") or {}})
    run.text(yaml.safe_dump(man.get("recipe") or {}, sort_keys=False), "recipe.yaml")
    run.tags({TAG + "manifest_sha256": sha256_file(artifact / "manifest.json"), TAG + "artifact": str(artifact),
              TAG + "recipe_sha256": man.get("recipe_sha256"), TAG + "calibration_fingerprint": cal.get("fingerprint")})
    pre = conv.get("preflight") or {}
    layer_s = sum(float(v.get("seconds") or 0) for v in (man.get("layers") or {}).values())
    run.metrics({"time.wall_s": conv.get("wall_time_s"), "time.preflight_s": pre.get("seconds"),
                 "time.layers_s": layer_s, "memory.peak_rss_bytes": conv.get("peak_rss_bytes"),
                 "memory.peak_gpu_bytes": conv.get("peak_gpu_bytes"), "size_bytes": man.get("size_bytes"),
                 "modules_quantized": (man.get("quantization") or {}).get("modules_quantized")})
    for step, values in sorted(layer_metrics(man.get("layers") or {}).items()):
        run.metrics(values, step=step)
    for name in ("manifest.json", "convert.log"):
        run.artifact(artifact / name)
    sq = [v["output_sqnr_db"] for v in (man.get("layers") or {}).values() if _number(v.get("output_sqnr_db"))]
    q = man.get("quantization") or {}
    run.tags({"mlflow.note.content": (
        f"{' + '.join(str(st.get('method')) for st in q.get('stages') or [])} "
        f"{' + '.join(str(st.get('scheme')) for st in q.get('stages') or [] if st.get('scheme'))} of "
        f"{(man.get('base_model') or {}).get('path')}: {q.get('modules_quantized')} modules, "
        f"{(man.get('size_bytes') or 0) / 1e6:.1f} MB, {conv.get('wall_time_s')} s"
        + (f", output SQNR mean {sum(sq) / len(sq):.1f} dB (min {min(sq):.1f})" if sq else ""))})


def layer_metrics(layers: dict[str, dict]) -> dict[int, dict[str, float]]:
    """Per decoder layer: `<stat>.<module>` (e.g. output_sqnr_db.mlp.down_proj) for step = the layer index."""
    out: dict[int, dict[str, float]] = {}
    for name, stats in layers.items():
        m = _LAYER.search(name)
        if not m:
            continue
        for stat in ("output_sqnr_db", "weight_sqnr_db", "gptq_loss", "seconds"):
            if _number(stats.get(stat)):
                out.setdefault(int(m.group(1)), {})[f"{stat}.{m.group(2)}"] = stats[stat]
    return out


def log_eval(run: Run, report_path: Path) -> None:
    """Every report metric for both sides (with interval bounds), the suite/engine/dtype/hardware, the files."""
    rep = json.loads(report_path.read_text())
    run.metrics(report_metrics(rep))
    suite, hw = rep.get("suite") or {}, rep.get("hardware") or {}
    manifest_sha = (rep.get("artifact") or {}).get("manifest_sha256")
    run.tags({TAG + "report_sha256": sha256_file(report_path), TAG + "manifest_sha256": manifest_sha,
              TAG + "convert_run": find_run("convert", "manifest_sha256", manifest_sha),
              TAG + "baseline_key": ((rep.get("baseline") or {}).get("reused") or {}).get("key"),
              TAG + "complete": rep.get("complete"), TAG + "suite": suite.get("name"), TAG + "dtype": suite.get("dtype"),
              TAG + "engine": _engine_version(rep), TAG + "hardware": f"{hw.get('cpu')} ({hw.get('cpu_kind')})"
              + (f", {hw['gpu']}" if hw.get("gpu") else "")})
    for name in ["report.md", "report.json", *(rep.get("plots") or [])]:
        folder = str(Path(name).parent)
        run.artifact(report_path.parent / name, None if folder == "." else folder)
    run.tags({"mlflow.note.content": eval_note(rep)})


def eval_note(rep: dict) -> str:
    """The run's description in MLflow's UI: what a person choosing what to serve reads first."""
    ms = rep.get("metrics") or {}

    def ratio(name: str) -> str:
        m = ms.get(name) or {}
        b, c = m.get("baseline"), m.get("candidate")
        return f"{c / b:.3f}" if _number(b) and _number(c) and b else "-"

    def value(v) -> str:
        return f"{v:.3f}" if _number(v) else "-"

    state = "complete" if rep.get("complete") else f"INCOMPLETE ({', '.join(rep.get('incomplete') or [])})"
    base = (rep.get("baseline") or {}).get("description") or "the baseline"
    return (f"{(rep.get('artifact') or {}).get('name')} against {base} ({state}): perplexity ratio "
            f"{ratio('quality.perplexity')}, top-1 {value((ms.get('quality.top1_agreement') or {}).get('candidate'))}, "
            f"task recovery {value((rep.get('recovery') or {}).get('tasks.mean_acc'))}, TPOT ratio "
            f"{ratio('speed.decode_tpot_ms_p50')}, peak throughput ratio {ratio('speed.peak_output_tok_s')}, "
            f"cost ratio {ratio('cost.machine_s_per_k_successful_tasks')}")


def report_metrics(rep: dict) -> dict[str, float]:
    """`<metric>.baseline|candidate` and, where measured, `<metric>.ci95_low|high.<side>` and the ratio's."""
    out: dict[str, float] = {}
    for name, m in (rep.get("metrics") or {}).items():
        for side in ("baseline", "candidate"):
            out[f"{name}.{side}"] = m.get(side)
        for side, bounds in ((m.get("ci95") or {}) if isinstance(m.get("ci95"), dict) else {}).items():
            if isinstance(bounds, (list, tuple)) and len(bounds) == 2:
                out[f"{name}.ci95_low.{side}"], out[f"{name}.ci95_high.{side}"] = bounds
    return {k: v for k, v in out.items() if _number(v)}


def log_gate(run: Run, record: dict, gate_file: Path | None = None) -> None:
    """One metric per gate row (its value and 1/0 for passed), the verdict, the link to the eval run."""
    values = {"gate.passed": 1.0 if record.get("passed") else 0.0}
    for i, row in enumerate(record.get("gates") or []):
        key = f"gate.{i:02d}.{row.get('metric')}"
        values[f"{key}.value"] = row.get("value")
        values[f"{key}.passed"] = 1.0 if row.get("passed") else 0.0
    run.metrics(values)
    failed = [row.get("name") or row.get("metric") for row in record.get("gates") or [] if not row.get("passed")]
    run.tags({"mlflow.note.content": f"{record.get('summary')}" + (f"; failed: {', '.join(failed)}" if failed else ""),
              TAG + "verdict": record.get("summary"), TAG + "report_sha256": record.get("report_sha256"),
              TAG + "eval_run": find_run("eval", "report_sha256", record.get("report_sha256")),
              TAG + "gate_sha256": sha256_file(gate_file) if gate_file and gate_file.is_file() else None})
    if gate_file is not None:
        run.artifact(gate_file)


# ----------------------------------------------------------------------------------------- lineage
def find_run(kind: str, tag: str, value: str | None, client=None) -> str | None:
    """The newest FINISHED run of `kind` whose tag quantkit.<tag> is `value`, in any experiment of the store."""
    if not value or not enabled():
        return None
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = client or MlflowClient(tracking_uri=store_uri())
    exps = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    if not exps:
        return None
    runs = client.search_runs(exps, filter_string=f"tags.`{TAG}kind` = '{kind}' and tags.`{TAG}{tag}` = '{value}' "
                                                  "and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def lineage_tags(manifest_sha: str, report_sha: str, gate_sha: str) -> dict[str, str]:
    """The registry version's links to the runs that made its evidence (only those found)."""
    if not enabled():
        return {}
    from mlflow import MlflowClient

    uri = store_uri()
    client = MlflowClient(tracking_uri=uri)  # one client for the three searches
    found = {TAG + "convert_run": find_run("convert", "manifest_sha256", manifest_sha, client),
             TAG + "eval_run": find_run("eval", "report_sha256", report_sha, client),
             TAG + "gate_run": find_run("gate", "gate_sha256", gate_sha, client)}
    out = {k: v for k, v in found.items() if v}
    if out:
        out[TAG + "tracking_uri"] = uri
    return out


def lineage(version_tags: dict[str, str]) -> list[tuple[str, str]]:
    """(label, value) rows from recipe to verdict, for `quantkit registry show` and rollback."""
    rows = [("recipe sha256", version_tags.get(TAG + "recipe_sha256", "?")),
            ("calibration", version_tags.get(TAG + "calibration_fingerprint", "?"))]
    uri = version_tags.get(TAG + "tracking_uri")
    client = None
    if uri:
        from mlflow import MlflowClient
        client = MlflowClient(tracking_uri=uri)
    for kind in ("convert", "eval", "gate"):
        run_id = version_tags.get(f"{TAG}{kind}_run")
        rows.append((f"{kind} run", _describe_run(client, run_id) if run_id else "not tracked"))
    rows.append(("gate verdict", version_tags.get(TAG + "gate", "?")))
    return rows


def _describe_run(client, run_id: str) -> str:
    if client is None:
        return run_id
    try:
        r = client.get_run(run_id)
    except Exception as exc:  # noqa: BLE001 - a deleted run or an unreachable store is reported, not raised
        return f"{run_id} (not readable: {_one_line(exc)})"
    return f"{run_id} ({r.info.run_name}, {r.info.status}, experiment {r.info.experiment_id})"


# ------------------------------------------------------------------------------------------ helpers
def flatten(values: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(flatten(x, f"{key}.{i}."))
        else:
            out[key] = v
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _metric_key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", name)[:250]


def _short(v, limit: int = 6000) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _engine_version(rep: dict) -> str | None:
    info = ((rep.get("engine") or {}).get("candidate") or {}).get("info") or {}
    return info.get("version") or info.get("engine")


def subject_of_report(report_path: Path) -> tuple[str, str]:
    """(base model, artifact name) of an eval report, for the gate run's experiment and name."""
    try:
        rep = json.loads(Path(report_path).read_text())
    except (OSError, ValueError):
        return "unknown", Path(report_path).parent.name  # the gate itself reports the unreadable file
    return str((rep.get("baseline") or {}).get("path") or "unknown"), str((rep.get("artifact") or {}).get("name") or "?")


_CELL_STATUS = {"done": "FINISHED", "failed": "FAILED", "skipped": "FINISHED"}


def log_study(run: Run, records: list[dict], data: dict) -> None:
    """A tune study: the parent run holds the recommendation; one child run per cell holds its figures (cost,
    quality, latency, throughput, memory), its gate summary and its timings."""
    rec = data.get("recommended") or {}
    run.tags({TAG + "recommended": rec.get("id"), "mlflow.note.content":
              f"recommended: {rec.get('id')} ({rec.get('reason')})" if rec.get("id") else
              f"no recommendation: {rec.get('reason')}"})
    run.metrics({"cells": len(records), "cells_done": sum(r.get("status") == "done" for r in records)})
    for r in records:
        if r.get("status") is None:
            continue  # not run (yet)
        child = run.child(r["id"], "tune-cell", {TAG + "cell_kind": r.get("kind"), TAG + "cell_status": r.get("status"),
                                                TAG + "gates_passed": (r.get("gates") or {}).get("passed")})
        child.params({"choices": r.get("choices") or {}, "engine_args": r.get("engine_args") or {}})
        child.metrics({**{f"figure.{k}": v for k, v in (r.get("figures") or {}).items()},
                       **{f"time.{k}": v for k, v in (r.get("timings") or {}).items()}})
        child.end(_CELL_STATUS.get(r["status"], "FINISHED"), r.get("reason"))
