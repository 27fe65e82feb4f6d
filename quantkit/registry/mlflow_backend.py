"""MLflow Model Registry backend: embedded (sqlite + local artifacts, no server) or a team tracking server.

URIs: None -> embedded, `sqlite:///$QUANTKIT_HOME/registry/mlflow.db` with artifacts in
`$QUANTKIT_HOME/registry/artifacts`; `sqlite:///path/x.db` -> the same layout beside that file;
`http(s)://host:port` -> a tracking server, which stores the artifacts itself (run it with
`--serve-artifacts`, or give it an artifact root its clients can reach). Each MlflowClient gets its
tracking and registry URI explicitly; nothing is set globally.

Atomic publish, as MLflow allows it. A registered model version is the only thing readers see, so it is
created last: (1) create a run in the `quantkit-publish` experiment, (2) upload every file of the bundle
to the run, (3) list the run's artifacts and check every file arrived with its size, (4) create the
registered model if needed, (5) create the model version (source = the run's artifact root), wait for
READY, (6) mark the run FINISHED. Any failure or interrupt (BaseException) undoes what was done, newest
first: delete the version, the registered model if this publish created it and it has no versions, the
run's artifacts and the run. What cannot be undone: a crash of the process itself between (5) and the
undo; the run is then left RUNNING with its version, and the version is complete (every file was checked
before it was created), so it is consistent, merely unfinished-looking. Deleted runs are soft-deleted
in MLflow (`mlflow gc` purges them); their artifacts are deleted right away.

Alias history for rollback is a registered-model tag `quantkit.alias_history.<alias>` (JSON list).
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import sys
from datetime import datetime, timezone
from pathlib import Path

from quantkit.registry.base import NAME_RE, Bundle, RegistryClient, RegistryError, VersionInfo

log = logging.getLogger("quantkit.registry")
EXPERIMENT = "quantkit-publish"
HISTORY_TAG = "quantkit.alias_history.{alias}"
HISTORY_MAX = 50


def embedded_root() -> Path:
    from quantkit.io import quantkit_home

    return quantkit_home() / "registry"


def resolve_uri(uri: str | None) -> tuple[str, str | None]:
    """(tracking/registry URI, artifact root for new experiments or None to let the server decide)."""
    if uri is None:
        root = embedded_root()
        root.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///")).expanduser().resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{db}", (db.parent / "artifacts").as_uri()
    if uri.startswith(("http://", "https://")):
        return uri.rstrip("/"), None
    raise RegistryError(f"registry {uri!r}: not a known registry URI (use http(s)://host:port for an MLflow "
                        "server, sqlite:///path.db, hf://org/name, or nothing for the embedded registry)")


class MlflowRegistry(RegistryClient):
    def __init__(self, uri: str | None = None, client=None):
        from mlflow import MlflowClient

        self.uri, self.artifact_root = resolve_uri(uri)
        self.explicit_uri = self.uri if uri else None  # absolute, as the card and tags record it
        self.client = client if client is not None else MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    # ------------------------------------------------------------------------------------ helpers
    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(EXPERIMENT)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(EXPERIMENT, artifact_location=self.artifact_root)
        except MlflowException:  # created concurrently by another publish
            exp = self.client.get_experiment_by_name(EXPERIMENT)
            if exp is None:
                raise
            return exp.experiment_id

    def _uploaded(self, run_id: str, path: str | None = None) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for f in self.client.list_artifacts(run_id, path):
            if f.is_dir:
                out.update(self._uploaded(run_id, f.path))
            else:
                out[f.path] = f.file_size
        return out

    def _ensure_model(self, name: str) -> bool:
        """Create the registered model; True when this call created it."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
            return False
        except MlflowException:
            pass
        try:
            self.client.create_registered_model(name, tags={"quantkit": "1"},
                                                description="Quantized by quantkit; versions carry a model card.")
            return True
        except MlflowException:  # created concurrently
            self.client.get_registered_model(name)
            return False

    def _info(self, mv) -> VersionInfo:
        created = datetime.fromtimestamp((mv.creation_timestamp or 0) / 1000, timezone.utc).isoformat(timespec="seconds")
        return VersionInfo(mv.name, str(mv.version), sorted(getattr(mv, "aliases", []) or []), dict(mv.tags or {}),
                           mv.source, created)

    # ------------------------------------------------------------------------------------ publish
    def publish(self, bundle: Bundle, staging: Path) -> VersionInfo:
        run, version, created_model = None, None, False
        try:
            run = self.client.create_run(self._experiment_id(), run_name=f"{bundle.name}-publish",
                                         tags={**bundle.tags, "quantkit.registered_model": bundle.name})
            run_id = run.info.run_id
            for local, rel in bundle.files:
                if local.name != posixpath.basename(rel):
                    raise RegistryError(f"internal: {local} must be staged as {posixpath.basename(rel)}")
                self.client.log_artifact(run_id, str(local), posixpath.dirname(rel) or None)
            got, want = self._uploaded(run_id), bundle.expected()
            bad = [f"{rel} (expected {size} bytes, found {got.get(rel)})" for rel, size in want.items()
                   if got.get(rel) not in (size, None) or rel not in got]
            if bad:
                raise RegistryError(f"{self.uri}: upload incomplete for run {run_id}: " + ", ".join(bad))
            created_model = self._ensure_model(bundle.name)
            mv = self.client.create_model_version(
                bundle.name, source=run.info.artifact_uri, run_id=run_id, tags=bundle.tags,
                description=f"{bundle.tags.get('quantkit.scheme')} of {bundle.tags.get('quantkit.base_model')}: "
                            f"{bundle.tags.get('quantkit.gate')}")
            version = str(mv.version)
            if mv.status != "READY":
                raise RegistryError(f"{self.uri}: version {version} of {bundle.name} is {mv.status}, not READY")
            with contextlib.redirect_stdout(sys.stderr):  # mlflow prints "View run at <url>" to stdout
                self.client.set_terminated(run_id, "FINISHED")
            return self._info(self.client.get_model_version(bundle.name, version))
        except BaseException as exc:
            self._undo(bundle.name, run, version, created_model, exc)
            raise

    def _undo(self, name: str, run, version: str | None, created_model: bool, exc: BaseException) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        steps = []

        def drop_versions():
            # the version this publish created, also when its create call failed after the server made it
            found = {version} if version is not None else set()
            if run is not None:
                found |= {str(mv.version) for mv in self.client.search_model_versions(
                    f"name='{name}' and run_id='{run.info.run_id}'")}
            for v in sorted(found - {None}, key=int):
                self.client.delete_model_version(name, v)
        steps.append(("delete the version(s) this publish created", drop_versions))
        if created_model:
            def drop_model():
                if not self.versions(name):
                    self.client.delete_registered_model(name)
            steps.append((f"delete registered model {name}", drop_model))
        if run is not None:
            repo_uri = run.info.artifact_uri
            steps.append(("delete the run's artifacts",
                          lambda: get_artifact_repository(repo_uri, tracking_uri=self.uri).delete_artifacts()))
            steps.append((f"delete run {run.info.run_id}", lambda: self.client.delete_run(run.info.run_id)))
        for what, fn in steps:
            try:
                fn()
            except (MlflowException, OSError, NotImplementedError) as err:
                exc.add_note(f"cleanup after the failed publish could not {what}: {err}")
                log.warning("publish cleanup: could not %s: %s", what, err)

    # ------------------------------------------------------------------------------------ reading
    def list_models(self) -> list[dict]:
        out, token = [], None
        while True:
            page = self.client.search_registered_models(max_results=100, page_token=token)
            for rm in page:
                vs = self.versions(rm.name)
                out.append({"name": rm.name, "latest_version": vs[-1].version if vs else None,
                            "versions": len(vs), "aliases": dict(getattr(rm, "aliases", {}) or {})})
            token = page.token
            if not token:
                return sorted(out, key=lambda m: m["name"])

    def versions(self, name: str) -> list[VersionInfo]:
        if not NAME_RE.match(name):  # also keeps the search filter below well-formed
            raise RegistryError(f"{name!r} is not a valid model name (letters, digits, '.', '_', '-')")
        mvs = self.client.search_model_versions(f"name='{name}'")
        if not mvs:
            return []
        # search results do not carry aliases; the registered model does (alias -> version)
        by_version: dict[str, list[str]] = {}
        for alias, version in (getattr(self.client.get_registered_model(name), "aliases", {}) or {}).items():
            by_version.setdefault(str(version), []).append(alias)
        out = []
        for mv in mvs:
            info = self._info(mv)
            info.aliases = sorted(by_version.get(info.version, []))
            out.append(info)
        return sorted(out, key=lambda v: int(v.version))

    def get_alias(self, name: str, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self.client.get_model_version_by_alias(name, alias).version)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                return None
            raise

    def alias_history(self, name: str, alias: str) -> list[str]:
        raw = (self.client.get_registered_model(name).tags or {}).get(HISTORY_TAG.format(alias=alias))
        try:
            hist = json.loads(raw) if raw else []
        except json.JSONDecodeError:
            log.warning("%s: tag %s is not JSON; ignoring the alias history", name, HISTORY_TAG.format(alias=alias))
            return []
        return [str(v) for v in hist] if isinstance(hist, list) else []

    def set_alias(self, name: str, alias: str, version: str, history: list[str]) -> None:
        self.client.set_registered_model_alias(name, alias, version)
        self.client.set_registered_model_tag(name, HISTORY_TAG.format(alias=alias), json.dumps(history[-HISTORY_MAX:]))

    def download(self, info: VersionInfo, dest: Path) -> None:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        repo = get_artifact_repository(info.source, tracking_uri=self.uri)
        repo.download_artifacts("", dst_path=str(dest))
