"""Input integrity, checked before any work starts: a corrupt model folder is refused with one message that
names every bad file, what is wrong with it and the fix, and no work folder is created for it.

Checked, cheapest first:
- config.json exists and parses;
- every *.safetensors file opens: the `safetensors` library checks the header length, the header JSON
  and that the tensors' byte ranges cover the file exactly (a download cut short fails here);
- model.safetensors.index.json, when present, parses, and every tensor it maps is in the file it names;
- the sha256 of every file a `quantkit_source.json` records (the demo models) matches, and an artifact's
  files match its manifest.json (quantkit.export.manifest.verify); hashes are cached by path, size, mtime.
The tokenizer is checked where it is loaded (quantkit.model.sources.load_tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.export.manifest import MANIFEST
from quantkit.export.manifest import verify as verify_manifest
from quantkit.io import cached_sha256
from quantkit.model import ModelError

FIX = "re-download or re-create the file (or check it against the source's sha256)"


def _json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        return f"{path.name}: not UTF-8 text (byte {exc.start}); {FIX}"
    except json.JSONDecodeError as exc:
        return f"{path.name}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); {FIX}"
    return None


def safetensors_problems(folder: Path) -> tuple[list[str], dict[str, set[str]]]:
    """Problems with the folder's safetensors files, and the tensor names of each file that opened."""
    from safetensors import safe_open

    problems: list[str] = []
    keys: dict[str, set[str]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as h:
                keys[f.name] = set(h.keys())
        except Exception as exc:  # noqa: BLE001 - the library raises its own SafetensorError (and OSError)
            what = str(exc).replace("Error while deserializing header: ", "")
            problems.append(f"{f.name}: not a complete safetensors file ({what}; {f.stat().st_size} bytes on "
                            f"disk), probably cut short or overwritten; {FIX}")
    index = Path(folder) / "model.safetensors.index.json"
    if index.is_file():
        bad = _json_problem(index)
        if bad:
            problems.append(bad)
        else:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            missing_files = sorted({fn for fn in weight_map.values() if not (Path(folder) / fn).is_file()})
            for fn in missing_files:
                problems.append(f"{index.name} maps tensors to {fn}, which is not in the folder; {FIX}")
            absent = [t for t, fn in weight_map.items() if fn in keys and t not in keys[fn]]
            if absent:
                problems.append(f"{index.name}: {len(absent)} tensor(s) it maps are not in their file "
                                f"(first: {absent[0]} in {weight_map[absent[0]]}); {FIX}")
    return problems, keys


def checksum_problems(folder: Path, expected: dict[str, str], source: str) -> list[str]:
    out = []
    for name, digest in sorted(expected.items()):
        p = Path(folder) / name
        if not p.is_file():
            out.append(f"{name}: listed in {source} but missing; {FIX}")
        elif cached_sha256(p) != digest:
            out.append(f"{name}: sha256 differs from the one {source} records (the file changed or is damaged); {FIX}")
    return out


def verify_model_folder(folder: Path, what: str = "model") -> None:
    """Refuse a model folder (or an artifact) whose files are corrupt, before any work starts."""
    folder = Path(folder)
    problems: list[str] = []
    cfg = folder / "config.json"
    if not cfg.is_file():
        problems.append(f"config.json: missing; a {what} folder needs config.json and *.safetensors weights")
    elif (bad := _json_problem(cfg)) is not None:
        problems.append(bad)
    st, _ = safetensors_problems(folder)
    problems += st
    src = folder / "quantkit_source.json"
    if src.is_file() and not _json_problem(src):
        problems += checksum_problems(folder, json.loads(src.read_text()).get("files_sha256", {}), src.name)
    if (folder / MANIFEST).is_file():
        if (bad := _json_problem(folder / MANIFEST)) is not None:
            problems.append(bad)
        else:
            problems += [f"{p}; {FIX}" for p in verify_manifest(folder)]
    if problems:
        raise ModelError(f"{folder}: damaged {what} files, nothing was started: " + " | ".join(problems))
