#!/usr/bin/env python3
"""Copy the quantkit task YAMLs into a folder with absolute data paths.

lm-eval 0.4.13 passes ``dataset_kwargs.data_files`` unchanged to
``datasets.load_dataset``, which resolves a relative path against the current
working directory, not against the YAML file. The committed YAMLs therefore use
paths relative to the repository root (``evals/data/<task>.jsonl``) and work
when lm-eval runs from the repository root. To run from anywhere, render a copy
whose paths are absolute and pass that folder as ``--include_path``:

    python evals/tools/render_tasks.py /tmp/qk_tasks
    lm_eval ... --include_path /tmp/qk_tasks --tasks qk_suite

Standard library only; quantkit may import ``render`` from this file or do the
same one-line rewrite itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

EVALS = Path(__file__).resolve().parent.parent
REL_PREFIX = "evals/data/"


def render(out_dir: str | Path, data_dir: str | Path | None = None) -> Path:
    """Write every evals/tasks/*.yaml into ``out_dir`` with absolute data_files paths.

    ``data_dir`` defaults to this checkout's evals/data. Returns ``out_dir``.
    """
    out = Path(out_dir).resolve()
    data = Path(data_dir).resolve() if data_dir is not None else EVALS / "data"
    out.mkdir(parents=True, exist_ok=True)
    for src in sorted((EVALS / "tasks").glob("*.yaml")):
        lines = []
        for line in src.read_text(encoding="utf-8").splitlines(keepends=True):
            stripped = line.lstrip()
            if stripped.startswith("test: " + REL_PREFIX):
                indent = line[: len(line) - len(stripped)]
                name = stripped[len("test: " + REL_PREFIX):].strip()
                target = data / name
                if not target.is_file():
                    raise FileNotFoundError(target)
                line = f"{indent}test: {target.as_posix()}\n"
            lines.append(line)
        (out / src.name).write_text("".join(lines), encoding="utf-8")
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: render_tasks.py OUT_DIR [DATA_DIR]")
    print(render(*sys.argv[1:]))
