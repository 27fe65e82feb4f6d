"""The registry interface, and everything about a publish that does not depend on the backend.

A backend (MLflow, Hugging Face Hub) implements RegistryClient: upload a prepared Bundle atomically, list
and show versions, read and move aliases, download a version's files. The checks live here, once:

- prepare_bundle() refuses an artifact whose manifest checksums do not verify, whose eval report is
  missing or was measured on another manifest, whose report fails the artifact's own gates re-checked
  (quantkit.gates.redecide: the recipe's gates, the scheme's defaults for what the recipe leaves ungated,
  and the integrity gates), or whose gate.json is missing, stale, lacks one of those gates or disagrees;
  then it renders the model card and the tags. Files are checked when the bundle is prepared and again (by size, and by
  sha256 where the backend reports one) after upload, and by sha256 on every pull.
- Layout of a version (the same on every backend): the export's files at the root (so the pulled folder
  is what vLLM loads), README.md (model card), quantkit/report.json and quantkit/gate.json.
- Rollback moves an alias to the version it pointed at before (the alias history a backend keeps); with
  no history (an alias set outside quantkit, or a backend without history) to the highest version
  number below the current one.
"""

from __future__ import annotations

import re
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.export.card import render_card
from quantkit.export.manifest import MANIFEST, read_manifest, verify
from quantkit.evaluate.report import default_report_path
from quantkit.gates import GateError, gate_path, read_report, redecide
from quantkit.io import atomic_write_text, sha256_file

REPORT_IN_VERSION = "quantkit/report.json"
GATE_IN_VERSION = "quantkit/gate.json"
CARD = "README.md"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Metrics copied into tags (candidate values) besides every metric a gate used.
KEY_METRICS = ("quality.perplexity", "quality.kl_mean", "quality.top1_agreement", "tasks.mean_acc",
               "memory.weight_bytes", "memory.checkpoint_bytes", "cost.usd_per_mtok_output")


class RegistryError(RuntimeError):
    """A registry problem phrased for the user: what was refused or failed, and what to do."""


@dataclass
class VersionInfo:
    name: str
    version: str
    aliases: list[str] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    source: str = ""
    created: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "aliases": self.aliases, "tags": self.tags,
                "source": self.source, "created": self.created}


@dataclass
class Bundle:
    """What one publish uploads: (local file, path inside the version) pairs, and the version's tags."""

    artifact: Path
    name: str
    files: list[tuple[Path, str]]
    tags: dict[str, str]
    manifest: dict
    report: dict
    gate: dict

    def expected(self) -> dict[str, int]:
        return {rel: local.stat().st_size for local, rel in self.files}


class RegistryClient(ABC):
    """One registry backend. Versions are strings of digits ("3"); aliases are names ("production")."""

    uri: str
    explicit_uri: str | None = None  # what a user passes as --registry to reach it (None: the default)

    def default_name(self) -> str | None:
        """A model name the registry URI itself implies (hf://org/name), else None."""
        return None

    @abstractmethod
    def publish(self, bundle: Bundle, staging: Path) -> VersionInfo:
        """Upload every file, then create the version last; on any failure leave no version behind."""

    @abstractmethod
    def list_models(self) -> list[dict]:
        """[{name, latest_version, aliases}] for every registered model."""

    @abstractmethod
    def versions(self, name: str) -> list[VersionInfo]:
        """All versions of `name`, oldest first (empty when the model does not exist)."""

    @abstractmethod
    def get_alias(self, name: str, alias: str) -> str | None: ...

    @abstractmethod
    def alias_history(self, name: str, alias: str) -> list[str]:
        """Versions the alias pointed at, oldest first (may be empty if the backend keeps none)."""

    @abstractmethod
    def set_alias(self, name: str, alias: str, version: str, history: list[str]) -> None: ...

    @abstractmethod
    def download(self, info: VersionInfo, dest: Path) -> None:
        """Write every file of the version under `dest` (an empty folder)."""

    # ---------------------------------------------------------------------------- shared behaviour
    def show(self, name: str, version_or_alias: str) -> VersionInfo:
        vs = self.versions(name)
        if not vs:
            raise RegistryError(f"{self.uri}: no registered model {name!r} (see `quantkit registry list`)")
        ref = str(version_or_alias)
        if re.fullmatch(r"v?[0-9]+", ref):  # "3" or "v3": a version number
            ref = ref.lstrip("v")
        else:
            target = self.get_alias(name, ref)
            if target is None:
                known = sorted({a for v in vs for a in v.aliases})
                raise RegistryError(f"{self.uri}: {name} has no alias {ref!r} (aliases: {', '.join(known) or 'none'}; "
                                    f"versions: {', '.join(v.version for v in vs)})")
            ref = target
        for v in vs:
            if v.version == ref:
                return v
        raise RegistryError(f"{self.uri}: {name} has no version {ref} (versions: {', '.join(v.version for v in vs)})")


def resolve_previous(history: list[str], current: str, existing: list[str]) -> tuple[str, list[str]]:
    """(version to roll back to, new history) for an alias now at `current`."""
    hist = list(history)
    while hist and hist[-1] == current:
        hist.pop()
    while hist and hist[-1] not in existing:  # a deleted version cannot be served again
        hist.pop()
    if hist:
        return hist[-1], hist
    older = sorted((v for v in existing if int(v) < int(current)), key=int)
    if not older:
        raise RegistryError(f"nothing to roll back to: version {current} has no earlier version in the registry")
    return older[-1], [older[-1]]


# ------------------------------------------------------------------------------------------ bundling
def _key_metrics(report: dict, gate: dict) -> dict[str, str]:
    metrics = report.get("metrics") or {}
    names = set(KEY_METRICS) | {g.get("metric") for g in gate.get("gates", [])}
    speed = sorted((n for n in metrics if n.startswith("speed.c")), key=lambda n: int(n.split(".")[1][1:] or 0))
    if speed:  # the lowest concurrency's latency and throughput
        c = speed[0].split(".")[1]
        names |= {f"speed.{c}.tpot_ms_p50", f"speed.{c}.ttft_ms_p50", f"speed.{c}.output_tok_s"}
    out = {}
    for n in sorted(x for x in names if x and x in metrics):
        cand = (metrics[n] or {}).get("candidate")
        if cand is not None:
            out[f"metric.{n}"] = f"{cand:.6g}" if isinstance(cand, float) else str(cand)
    return out


def make_tags(man: dict, report: dict, gate: dict, manifest: Path, report_file: Path, gate_file: Path) -> dict[str, str]:
    stages = (man.get("quantization") or {}).get("stages") or []
    cal = man.get("calibration") or {}
    tags = {
        "quantkit.artifact": str(man.get("name", "")),
        "quantkit.base_model": str((man.get("base_model") or {}).get("path", "")),
        "quantkit.base_model_fingerprint": str((man.get("base_model") or {}).get("fingerprint", "")),
        "quantkit.method": "+".join(str(s.get("method")) for s in stages),
        "quantkit.scheme": "+".join(str(s.get("scheme")) for s in stages if s.get("scheme")),  # transforms: none
        "quantkit.format": str((man.get("quantization") or {}).get("format", "")),
        "quantkit.recipe_sha256": str(man.get("recipe_sha256", "")),
        "quantkit.calibration_fingerprint": str(cal.get("fingerprint") or "none"),
        "quantkit.size_bytes": str(man.get("size_bytes", "")),
        "quantkit.gate": str(gate.get("summary", "")),
        "quantkit.gate_source": str(gate.get("source", "")),
        "quantkit.manifest_sha256": sha256_file(manifest),
        "quantkit.report_sha256": sha256_file(report_file),
        "quantkit.gate_sha256": sha256_file(gate_file),
    }
    tags.update(_key_metrics(report, gate))
    return tags


def prepare_bundle(artifact: str | Path, name: str, staging: Path, report: str | Path | None = None,
                   registry_hint: str | None = None, version_hint: str | None = None) -> Bundle:
    """Check an artifact is publishable and collect what to upload; the card is written into `staging`."""
    art = Path(artifact)
    if not NAME_RE.match(name):
        raise RegistryError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (starting with a letter/digit)")
    try:
        man = read_manifest(art)
    except FileNotFoundError as exc:
        raise RegistryError(f"refusing to publish: {exc}") from None
    problems = verify(art)
    if problems:
        raise RegistryError(f"refusing to publish {art}: manifest checksums do not verify: " + "; ".join(problems)
                            + f". Restore the files or re-run `quantkit convert` (check with `quantkit inspect {art}`)")
    report_path = Path(report) if report else default_report_path(art)
    if not report_path.is_file():
        raise RegistryError(f"refusing to publish {art}: no eval report at {report_path}; run `quantkit eval {art}` "
                            "then `quantkit gate`, or pass --report")
    try:
        rep = read_report(report_path)
        rep_art = rep.get("artifact") or {}
        if rep_art.get("name") and rep_art["name"] != man.get("name"):
            raise GateError(f"{report_path} is the report of {rep_art['name']!r}, not of {man.get('name')!r}; "
                            "pass the right --report")
        gate = redecide(art, report_path)  # the verdict recomputed with the artifact's own gates; gate.json is a record
    except GateError as exc:
        raise RegistryError(f"refusing to publish {art}: {exc}") from None
    files = [(art / fname, fname) for fname in sorted(man.get("files", {}))] + [(art / MANIFEST, MANIFEST)]
    card_rel = CARD if CARD not in man.get("files", {}) else "quantkit/README.md"
    card = staging / "README.md"
    atomic_write_text(card, render_card(man, rep, gate, name=name, version=version_hint, registry=registry_hint))
    (staging / "quantkit").mkdir(exist_ok=True)
    for src, rel in ((report_path, REPORT_IN_VERSION), (gate_path(report_path), GATE_IN_VERSION)):
        shutil.copyfile(src, staging / rel)  # staged under their names in the version
        files.append((staging / rel, rel))
    files.append((card, card_rel))
    tags = make_tags(man, rep, gate, art / MANIFEST, staging / REPORT_IN_VERSION, staging / GATE_IN_VERSION)
    return Bundle(art, name, files, tags, man, rep, gate)


def verify_pulled(folder: Path, info: VersionInfo) -> list[str]:
    """Problems with a downloaded version: every manifest sha256, plus the manifest/report/gate hashes in tags."""
    problems = []
    if not (folder / MANIFEST).is_file():
        return [f"{MANIFEST}: missing from version {info.version}"]
    problems += verify(folder)
    for rel, tag in ((MANIFEST, "quantkit.manifest_sha256"), (REPORT_IN_VERSION, "quantkit.report_sha256"),
                     (GATE_IN_VERSION, "quantkit.gate_sha256")):
        want = info.tags.get(tag)
        if not want:
            continue
        p = folder / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
        elif sha256_file(p) != want:
            problems.append(f"{rel}: sha256 does not match the version's tag {tag}")
    return problems
