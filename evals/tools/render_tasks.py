#!/usr/bin/env python3
"""Copy the quantkit task YAMLs into a folder with absolute data paths, for running lm-eval by hand.

lm-eval passes ``dataset_kwargs.data_files`` unchanged to ``datasets.load_dataset``, which resolves a
relative path against the working directory, not against the YAML. The committed YAMLs say
``test: evals/data/<task>.jsonl``; render a copy with absolute paths and pass it as ``--include_path``:

    python evals/tools/render_tasks.py /tmp/qk_tasks
    lm_eval ... --include_path /tmp/qk_tasks --tasks qk_suite

The rewrite itself is quantkit's (``quantkit.evaluate.tasks.render_tasks``, which ``quantkit eval``
uses); this script points it at this checkout's evals/ folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

EVALS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(EVALS.parent))  # run from a checkout without installing quantkit

from quantkit.evaluate.tasks import render_tasks  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: render_tasks.py OUT_DIR")
    print(render_tasks(Path(sys.argv[1]).resolve(), EVALS))
