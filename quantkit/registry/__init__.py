"""The model registry: publish gated artifacts as versions, move aliases, roll back, pull and verify.

Backends are chosen by URI, through an explicit table (no discovery):
    None / sqlite:///x.db / http(s)://host:port  -> MLflow Model Registry (quantkit.registry.mlflow_backend)
    hf://org[/name]                               -> Hugging Face Hub (quantkit.registry.hf_backend)
Backends are imported lazily, so `quantkit gate` never pays for importing mlflow.

Every check that decides whether something may be published or pulled lives in base.py and runs before
any registry is contacted; the backends only move bytes and names. The defaults for the registry URI and
the model name come from the recipe stored in the artifact's manifest (`publish.registry`,
`publish.name`), then the artifact's name.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from quantkit.export.manifest import read_manifest
from quantkit.io import atomic_dir, quantkit_home
from quantkit.locks import exclusive
from quantkit.tracking import lineage_tags
from quantkit.registry.base import (Bundle, RegistryClient, RegistryError, VersionInfo, prepare_bundle,
                                    resolve_previous, verify_pulled)

__all__ = ["Bundle", "RegistryClient", "RegistryError", "VersionInfo", "open_registry", "publish", "promote",
           "rollback", "pull", "show", "list_versions", "list_models", "DEFAULT_ALIAS"]
DEFAULT_ALIAS = "production"


def _mlflow(uri: str | None) -> RegistryClient:
    from quantkit.registry.mlflow_backend import MlflowRegistry

    return MlflowRegistry(uri)


def _hf(uri: str | None) -> RegistryClient:
    from quantkit.registry.hf_backend import HfRegistry

    return HfRegistry(uri)


# URI prefix -> backend factory; checked in order, "" (None / anything else) last.
BACKENDS = (("hf://", _hf), ("http://", _mlflow), ("https://", _mlflow), ("sqlite:///", _mlflow))


def open_registry(uri: str | None = None) -> RegistryClient:
    """The client for a registry URI; None = the embedded MLflow registry in QUANTKIT_HOME."""
    if not uri:  # None, or an empty QUANTKIT_REGISTRY
        return _mlflow(None)
    for prefix, factory in BACKENDS:
        if uri.startswith(prefix):
            return factory(uri)
    raise RegistryError(f"registry {uri!r}: unknown URI (use http(s)://host:port for an MLflow server, "
                        "sqlite:///path.db, hf://org/name, or nothing for the embedded registry)")


def _client(registry_uri: str | None, client: RegistryClient | None) -> RegistryClient:
    return client if client is not None else open_registry(registry_uri)


def publish(artifact: str | Path, registry_uri: str | None = None, name: str | None = None,
            report: str | Path | None = None, client: RegistryClient | None = None) -> VersionInfo:
    """Publish a gated, checksum-verified artifact as a new version; returns it. Refusals raise RegistryError."""
    artifact = Path(artifact).expanduser().resolve()  # the API boundary: the registry records absolute sources
    report = Path(report).expanduser().resolve() if report is not None else None
    try:
        pub = (read_manifest(Path(artifact)).get("recipe") or {}).get("publish") or {}
    except FileNotFoundError as exc:
        raise RegistryError(f"refusing to publish: {exc}") from None
    registry_uri = registry_uri or pub.get("registry")
    reg = _client(registry_uri, client)  # constructing a client contacts nothing
    name = name or reg.default_name() or pub.get("name") or read_manifest(Path(artifact))["name"]
    with exclusive(publish_lock(registry_uri, name), f"a publish of {name!r}"), \
            tempfile.TemporaryDirectory(prefix="quantkit-publish-") as tmp:
        # every refusal happens here, before the registry is contacted
        bundle = prepare_bundle(artifact, name, Path(tmp), report, registry_hint=reg.explicit_uri)
        bundle.tags.update(lineage_tags(bundle.tags["quantkit.manifest_sha256"], bundle.tags["quantkit.report_sha256"],
                                        bundle.tags["quantkit.gate_sha256"]))  # the runs behind this evidence
        return reg.publish(bundle, Path(tmp))


def publish_lock(registry_uri: str | None, name: str) -> Path:
    """The lock that makes publishes of one model name to one registry one at a time on this machine (two at
    once would both read "latest = n" and race for version n + 1)."""
    import hashlib
    import re

    key = hashlib.sha256(f"{registry_uri or 'embedded'}\n{name}".encode()).hexdigest()[:12]
    return quantkit_home() / "locks" / f"publish-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:60]}-{key}.lock"


def promote(name: str, version: str, alias: str = DEFAULT_ALIAS, registry_uri: str | None = None,
            client: RegistryClient | None = None) -> VersionInfo:
    """Point `alias` at `version` (a number, or another alias), remembering where it pointed before."""
    reg = _client(registry_uri, client)
    info = reg.show(name, str(version))
    current = reg.get_alias(name, alias)
    if current == info.version:
        return info
    history = reg.alias_history(name, alias)
    if current is not None and (not history or history[-1] != current):
        history.append(current)  # an alias set outside quantkit: remember it anyway
    reg.set_alias(name, alias, info.version, history + [info.version])
    return reg.show(name, info.version)


def rollback(name: str, alias: str = DEFAULT_ALIAS, registry_uri: str | None = None,
             client: RegistryClient | None = None) -> VersionInfo:
    """Move `alias` back to the version it pointed at before; returns that version."""
    reg = _client(registry_uri, client)
    current = reg.get_alias(name, alias)
    if current is None:
        raise RegistryError(f"{reg.uri}: {name} has no alias {alias!r} to roll back "
                            f"(set it with `quantkit promote {name} VERSION --alias {alias}`)")
    existing = [v.version for v in reg.versions(name)]
    try:
        target, history = resolve_previous(reg.alias_history(name, alias), current, existing)
    except RegistryError as exc:
        raise RegistryError(f"{reg.uri}: {name}@{alias}: {exc}") from None
    reg.set_alias(name, alias, target, history)
    return reg.show(name, target)


def pull(name: str, version_or_alias: str, dest: str | Path, registry_uri: str | None = None,
         overwrite: bool = False, client: RegistryClient | None = None) -> Path:
    """Download a version into `dest` and verify every sha256; a failed check leaves nothing at `dest`."""
    reg = _client(registry_uri, client)
    info = reg.show(name, str(version_or_alias))
    dest = Path(dest).expanduser().resolve()
    with atomic_dir(dest, overwrite=overwrite) as tmp:
        reg.download(info, tmp)
        problems = verify_pulled(tmp, info)
        if problems:
            raise RegistryError(f"{reg.uri}: {name} version {info.version} failed verification, nothing written to "
                                f"{dest}: " + "; ".join(problems) + ". The stored copy is damaged or was changed: "
                                "republish it, or pull another version")
    return dest


def show(name: str, version_or_alias: str, registry_uri: str | None = None,
         client: RegistryClient | None = None) -> VersionInfo:
    return _client(registry_uri, client).show(name, str(version_or_alias))


def list_versions(name: str, registry_uri: str | None = None, client: RegistryClient | None = None) -> list[VersionInfo]:
    return _client(registry_uri, client).versions(name)


def list_models(registry_uri: str | None = None, client: RegistryClient | None = None) -> list[dict]:
    return _client(registry_uri, client).list_models()
