"""Calibration data: read sources, tokenize, pack to `num_samples x seq_len`, fingerprint.

Sources (recipe `calibration.sources[i].type`): text files/globs, JSONL (a field), parquet (a column),
a `datasets` folder saved with `save_to_disk`, a hub dataset (online only), and chat records rendered
with the tokenizer's chat template. Documents are shuffled with the seed, joined with the EOS token
and cut into `seq_len` windows; each source contributes windows in proportion to its weight. The same
recipe and files always give the same token ids; the fingerprint is the sha256 of those ids.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.recipe import CalibrationSpec, DataSource

log = logging.getLogger("quantkit")


class DataError(ValueError):
    """A calibration-data problem, phrased for the user."""


@dataclass
class CalibrationSet:
    input_ids: torch.Tensor  # [num_samples, seq_len] int64
    fingerprint: str
    sources: list[dict]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def summary(self) -> dict:
        return {"num_samples": self.input_ids.shape[0], "seq_len": self.input_ids.shape[1],
                "num_tokens": self.num_tokens, "fingerprint": self.fingerprint, "sources": self.sources}


def fingerprint_ids(ids: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(str(tuple(ids.shape)).encode())
    h.update(ids.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ readers
def _files(src: DataSource, where: str) -> list[Path]:
    pattern = src.path
    paths = [Path(p) for p in sorted(glob.glob(pattern, recursive=True))]
    paths = [p for p in paths if p.is_file()]
    if not paths and Path(pattern).is_dir():
        paths = sorted(p for p in Path(pattern).rglob("*") if p.is_file())
    if not paths:
        raise DataError(f"{where}.path: {pattern!r} matches no files")
    return paths


def read_text(path: Path, where: str, strict: bool = False) -> str:
    """A calibration file as text. Invalid UTF-8 is refused when `strict` (the recipe's `encoding: strict`),
    else replaced by U+FFFD with a warning that names the file, the first bad byte's offset and the count."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if strict:
            raise DataError(f"{path}: invalid UTF-8 at byte {exc.start} ({where}.encoding is strict); fix or "
                            "re-encode the file (iconv -f <its encoding> -t utf-8), or set encoding: replace") from None
        text = raw.decode("utf-8", errors="replace")
        replaced = text.count("\ufffd") - raw.count("\ufffd".encode())
        log.warning("%s: invalid UTF-8 from byte %d on; %d character(s) replaced by U+FFFD (set %s.encoding: "
                    "strict to refuse such files)", path, exc.start, replaced, where)
        return text


def _read_jsonl(path: Path, field: str, where: str, strict: bool = False) -> list:
    out = []
    for n, line in enumerate(read_text(path, where, strict).split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or field not in rec:
            keys = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
            raise DataError(f"{path}:{n}: no field {field!r} (found: {keys}); set {where}.field")
        out.append(rec[field])
    return out


def _column(table_like, field: str, where: str, what: str) -> list:
    names = list(getattr(table_like, "column_names", []))
    if field not in names:
        raise DataError(f"{what}: no column {field!r} (columns: {', '.join(names)}); set {where}.field")
    col = table_like[field]
    return col.to_pylist() if hasattr(col, "to_pylist") else list(col)


def read_documents(src: DataSource, where: str, tokenizer) -> list[str]:
    """All documents of one source as strings (chat records rendered through the chat template)."""
    src = src.reader()  # a builtin corpus reads as the text/jsonl/chat source of its shipped files
    if src.type == "text":
        docs = []
        for p in _files(src, where):
            text = read_text(p, where, src.encoding == "strict")
            if text.strip():
                docs.append(text)
        if not docs:
            raise DataError(f"{where}.path: {src.path!r}: every matched file is empty")
        return docs
    records = _records(src, where)
    if src.type == "chat":
        docs = _chat_documents(records, where, tokenizer)
    else:
        docs = [r for r in records if isinstance(r, str) and r.strip()]
    if not docs:
        raise DataError(f"{where}: {src.path!r} holds no non-empty text")
    return docs


def _records(src: DataSource, where: str) -> list:
    """The `field` column of a jsonl / chat / parquet / disk / hub source."""
    if src.type in ("jsonl", "chat"):
        field = "messages" if (src.type == "chat" and src.field == "text") else src.field
        records = []
        for p in _files(src, where):
            records.extend(_read_jsonl(p, field, where, src.encoding == "strict"))
        return records
    if src.type == "parquet":
        import pyarrow.parquet as pq

        records = []
        for p in _files(src, where):
            records.extend(_column(pq.read_table(p), src.field, where, str(p)))
        return records
    if src.type == "disk":
        from datasets import load_from_disk

        if not Path(src.path).is_dir():
            raise DataError(f"{where}.path: {src.path!r} is not a folder written by datasets' save_to_disk")
        ds = load_from_disk(src.path)
        if hasattr(ds, "keys"):
            if src.split not in ds:
                raise DataError(f"{where}.split: {src.split!r} not in {src.path} (splits: {', '.join(ds)})")
            ds = ds[src.split]
        return _column(ds, src.field, where, src.path)
    if src.type == "hub":
        try:
            from datasets import load_dataset

            ds = load_dataset(src.path, split=src.split)
        except Exception as exc:  # offline, unknown name, auth: one message with the fix
            raise DataError(f"{where}: hub dataset {src.path!r} could not be loaded ({type(exc).__name__}); "
                            "this machine may be offline: save it with save_to_disk elsewhere and use "
                            "type: disk") from None
        return _column(ds, src.field, where, src.path)
    raise DataError(f"{where}.type: {src.type!r} is not supported")  # pragma: no cover - the schema forbids it


def _chat_documents(records: list, where: str, tokenizer) -> list[str]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: type chat needs a tokenizer with a chat template; this one has none")
    docs = []
    for i, msgs in enumerate(records):
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in msgs):
            raise DataError(f"{where}: record {i}: expected a list of {{role, content}} messages")
        docs.append(tokenizer.apply_chat_template(msgs, tokenize=False))
    return docs


# ------------------------------------------------------------------------------------------ packing
def pack_windows(docs: list[str], tokenizer, seq_len: int, rng: random.Random) -> list[list[int]]:
    """Documents in a seeded order, tokenized and joined with EOS, cut into full `seq_len` windows."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for i in order:
        stream.extend(tokenizer(docs[i], add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
    return [stream[s:s + seq_len] for s in range(0, len(stream) - seq_len + 1, seq_len)]


def build_calibration_set(spec: CalibrationSpec, tokenizer, where: str = "calibration") -> CalibrationSet:
    rng = random.Random(spec.seed)
    per_source: list[list[list[int]]] = []
    info = []
    for i, src in enumerate(spec.sources):
        w = f"{where}.sources[{i}]"
        docs = read_documents(src, w, tokenizer)
        wins = pack_windows(docs, tokenizer, spec.seq_len, rng)
        per_source.append(wins)
        info.append({"type": src.type, "path": src.reader().path, **({"name": src.name} if src.name else {}),
                     "documents": len(docs), "windows": len(wins), "weight": src.weight})

    total_w = sum(s.weight for s in spec.sources)
    want = [int(round(spec.num_samples * s.weight / total_w)) for s in spec.sources]
    want[-1] = spec.num_samples - sum(want[:-1])
    # hand any shortfall of a small source to the others, so weights are a preference, not a wall
    chosen = [rng.sample(range(len(wins)), min(len(wins), n)) for wins, n in zip(per_source, want)]
    short = spec.num_samples - sum(len(c) for c in chosen)
    for wins, c in zip(per_source, chosen):
        if short <= 0:
            break
        rest = sorted(set(range(len(wins))) - set(c))
        extra = rng.sample(rest, min(short, len(rest)))
        c.extend(extra)
        short -= len(extra)
    if short > 0:
        have = sum(len(w) for w in per_source)
        raise DataError(
            f"{where}: too little text: {have} windows of {spec.seq_len} tokens in all sources, "
            f"{spec.num_samples} needed; add text, or lower {where}.num_samples or {where}.seq_len")
    picked = [wins[j] for wins, c in zip(per_source, chosen) for j in c]
    ids = torch.tensor(picked, dtype=torch.int64)  # [num_samples, seq_len]
    return CalibrationSet(ids, fingerprint_ids(ids), info)
