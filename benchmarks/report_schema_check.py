"""Does report.json keep its schema? One deterministic eval, written and normalized for a diff.

    python benchmarks/report_schema_check.py OUT            # writes OUT/{fresh,cached}/report.{json,md} + .norm
    python benchmarks/report_schema_check.py --compare A B  # diffs two OUTs' normalized reports (exit 1 if they differ)

A tiny W8A8 artifact (tests/conftest.py's tiny model) is evaluated twice with the `smoke` suite plus one serving
variant: first with a fresh baseline (stored in the baseline cache), then reusing it. The engine is a stand-in
for vLLM (tests/_fake_openai.py: an in-process HTTP server that answers the OpenAI API deterministically), and
lm-eval is replaced by a deterministic `simple_evaluate`.
Everything else is quantkit's own code: the probes, the engine-free reference, the baseline cache, metrics,
intervals, plots, report.json and report.md. Wall-clock figures (timings, latencies, throughputs, cost, the
created stamp) are masked in the .norm files; everything else must match byte for byte.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from _fake_openai import fake_lm_eval, fake_vllm, serve  # noqa: E402

WORK = Path("/tmp/qk-report-schema-work")  # fixed, so the paths recorded in the report are the same every run


# ----------------------------------------------------------------------------- the evals
def run(out: Path) -> None:
    import os

    import yaml

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    os.environ["QUANTKIT_HOME"] = str(WORK / "home")
    from conftest import make_tiny_model, tiny_recipe

    from quantkit import api
    from quantkit import engine as engine_mod
    from quantkit.recipe import parse_recipe
    from quantkit.resources import shipped

    base = make_tiny_model(WORK / "base")
    art = api.convert(parse_recipe(tiny_recipe(base, None, [{"method": "rtn", "scheme": "W8A8"}])), WORK / "art",
                      quiet=True)
    suite = yaml.safe_load(shipped("evals", "suites", "smoke.yaml").read_text())
    suite["variants"] = [{"name": "pc", "engine_args": {"enable_prefix_caching": True}}]
    (WORK / "suite.yaml").write_text(yaml.safe_dump(suite))
    srv, url = serve()
    engine_mod.ENGINES["vllm"] = fake_vllm(url)
    sys.modules.update(fake_lm_eval())
    from quantkit.evaluate import run_eval

    try:
        for label, fresh in (("fresh", True), ("cached", False)):
            folder = run_eval(art, suite=WORK / "suite.yaml", output=WORK / f"eval-{label}", overwrite=True,
                              fresh_baseline=fresh, progress=lambda m: None)
            dest = out / label
            dest.mkdir(parents=True, exist_ok=True)
            for name in ("report.json", "report.md"):
                shutil.copy(folder / name, dest / name)
            (dest / "report.json.norm").write_text(json.dumps(normalize(json.loads((folder / "report.json").read_text())),
                                                             indent=1, sort_keys=True) + "\n")
            (dest / "report.md.norm").write_text(normalize_md((folder / "report.md").read_text()))
    finally:
        srv.shutdown()
    print(f"wrote {out}/fresh and {out}/cached")


# ----------------------------------------------------------------------------- normalizing wall-clock figures
TIMED_KEYS = {"created", "wall_s", "timings", "start_s", "while_loading_s", "reused", "seconds",
              "manifest_sha256"}  # the manifest records when it was written
TIMED_PREFIXES = ("speed.", "cost.")


def _mask(x):
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, (int, float)):
        return "<num>"
    if isinstance(x, str) and re.fullmatch(r"[0-9a-f]{64}", x):
        return "<sha256>"
    if isinstance(x, str):
        return re.sub(r"\d+(\.\d+)?", "#", x)
    if isinstance(x, dict):
        return {k: _mask(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_mask(v) for v in x]
    return x


def normalize(x, path: tuple = ()):
    """The report with wall-clock-dependent values masked (their keys and types stay)."""
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            timed = (k in TIMED_KEYS or k in ("speed", "cost", "where_the_wait_is", "engine_metrics")
                     or k.startswith(TIMED_PREFIXES) or (path[-1:] == ("reused",)))
            if k == "where_the_wait_is":  # sentences chosen by the measured latencies
                out[k] = sorted(v) if isinstance(v, dict) else _mask(v)
            else:
                out[k] = _mask(v) if timed else normalize(v, path + (k,))
        return out
    if isinstance(x, list):
        return [normalize(v, path) for v in x]
    return x


def normalize_md(text: str) -> str:
    out, timed = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            timed = line[3:].split(" ")[0] in ("Speed", "Cost", "Where", "Serving")
        if timed and line.startswith("- "):  # "where the wait is": sentences chosen by the measured latencies
            continue
        if timed or "wall time" in line or "reused" in line:
            line = re.sub(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "#", line)
        out.append(line)
    return "\n".join(out) + "\n"


def compare(a: Path, b: Path) -> int:
    same = True
    for label in ("fresh", "cached"):
        for name in ("report.json.norm", "report.md.norm"):
            x, y = (a / label / name).read_text().splitlines(), (b / label / name).read_text().splitlines()
            diff = list(difflib.unified_diff(x, y, f"{a}/{label}/{name}", f"{b}/{label}/{name}", lineterm="", n=1))
            print(f"{label}/{name}: {'identical' if not diff else f'{len(diff)} diff lines'}")
            if diff:
                same = False
                print("\n".join(diff[:200]))
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    run(args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
