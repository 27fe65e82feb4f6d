"""The device check's steps under one time budget; benchmarks/device_check.sh runs this once the wheels are
installed, on the GPU machine and (at toy sizes, on the CPU) under `--simulate`.

Each step is one benchmarks/scale.py run (`<shape>-<layers>:<method>`) in its own process, under coreutils
`timeout` (TERM, then KILL `--grace-s` later, to the step's whole process group) set from what is left of
the budget: a step is given everything up to the deadline less the grace, and a step that would get less
than `--min-step-s` is not started. Steps share --work, so a shape's checkpoint is written once.

Prints, on stdout, one JSON line per step, then one summary line:

    {"step": "llama8b-8:gptq", "status": "ok", "step_s": ..., "wall_s": ..., "peak_gpu_mb": ..., "peak_rss_mb": ..., ...}
    {"step": "llama70b-1:gptq", "status": "skipped", "reason": "..."}
    {"summary": true, "finished": [...], "cut": [...], "skipped": [...], "failed": [...], "elapsed_s": ..., "budget_s": ...}

Status: ok (the run's own figures follow, see docs/gpu.md), cut (stopped by its timeout: the budget ran
out), skipped (too little budget left to start), failed (it ended by itself with an error; its stderr went to
this process's stderr). Exit status: 1 when a step failed; else 3 when no step finished, or when
--all-must-finish is given and one was cut or skipped; else 0 (what ran succeeded; the rest is printed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
TIMED_OUT = (124, 137)  # coreutils timeout: TERM sent (124), or KILL after the grace (128 + 9)


@dataclass(frozen=True)
class Step:
    name: str  # shown in the output, e.g. "llama8b-8:gptq"
    argv: tuple[str, ...]  # the command; the step's figures are read from `result` when it ends well
    result: Path | None = None  # a JSON file the command writes (scale.py --json-out)


def step_timeout(remaining_s: float, grace_s: int, min_step_s: int) -> int | None:
    """Whole seconds to give the next step so that it is over (KILL included) by the deadline, or None when
    that is under `min_step_s`: the step is then skipped."""
    t = int(remaining_s - grace_s)
    return t if t >= max(1, min_step_s) else None


def figures(step: Step) -> dict:
    """What a step that ended well reported: scale.py's one run row."""
    if step.result is None or not step.result.is_file():
        return {}
    runs = json.loads(step.result.read_text()).get("runs") or [{}]
    return runs[0]


def run_steps(steps: list[Step], deadline: float, *, grace_s: int = 10, min_step_s: int = 20,
              clock: Callable[[], float] = time.time, emit: Callable[[dict], None] | None = None) -> dict:
    """Run `steps` in order until `deadline` (a `clock()` time); returns the summary (also emitted)."""
    emit = emit or (lambda rec: print(json.dumps(rec), flush=True))
    timeout = shutil.which("timeout")
    if timeout is None:
        raise SystemExit("device_check: coreutils `timeout` is not on PATH; it bounds each step")
    started = clock()
    out: dict[str, list[str]] = {"finished": [], "cut": [], "skipped": [], "failed": []}
    for step in steps:
        left = deadline - clock()
        t = step_timeout(left, grace_s, min_step_s)
        if t is None:
            out["skipped"].append(step.name)
            emit({"step": step.name, "status": "skipped",
                  "reason": f"{max(left, 0):.0f} s of the budget left; a step is started with at least "
                            f"{min_step_s} s plus {grace_s} s to stop"})
            continue
        t0 = time.perf_counter()
        # the step's own output goes to stderr: stdout carries this check's JSON lines only
        rc = subprocess.run([timeout, "-k", str(grace_s), str(t), *step.argv], cwd=REPO,
                            stdout=2).returncode  # fd 2: stderr
        rec = {"step": step.name, "step_s": round(time.perf_counter() - t0, 1), "timeout_s": t}
        if rc == 0:
            out["finished"].append(step.name)
            emit({**rec, "status": "ok", **figures(step)})
        elif rc in TIMED_OUT:
            out["cut"].append(step.name)
            emit({**rec, "status": "cut", "reason": f"not done within its {t} s (the rest of the budget)"})
        else:
            out["failed"].append(step.name)
            emit({**rec, "status": "failed", "exit_code": rc})
    summary = {"summary": True, **out, "elapsed_s": round(clock() - started, 1),
               "budget_left_s": round(deadline - clock(), 1)}
    emit(summary)
    return summary


def exit_status(summary: dict, all_must_finish: bool) -> int:
    if summary["failed"]:
        return 1
    if not summary["finished"] or (all_must_finish and (summary["cut"] or summary["skipped"])):
        return 3
    return 0


def scale_steps(runs: list[str], samples: int, seq_len: int, device: str, work: Path) -> list[Step]:
    """One scale.py process per run, all on one --work folder (a shape's checkpoint is written once)."""
    steps = []
    for run in runs:
        result = work / f"result-{run.replace(':', '-')}.json"
        argv = (sys.executable, str(REPO / "benchmarks" / "scale.py"), "--runs", run, "--samples", str(samples),
                "--seq-len", str(seq_len), "--device", device, "--work", str(work), "--json-out", str(result))
        steps.append(Step(run, argv, result))
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="comma-separated scale.py runs, in order")
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--work", type=Path, default=None, help="checkpoints and outputs (default: a temporary folder)")
    ap.add_argument("--budget-s", type=float, required=True, help="the whole check's budget, from --started-at")
    ap.add_argument("--started-at", type=float, default=None, help="epoch seconds the budget counts from (default: now)")
    ap.add_argument("--grace-s", type=int, default=10, help="between a step's TERM and its KILL")
    ap.add_argument("--min-step-s", type=int, default=20, help="a step needs at least this to be started")
    ap.add_argument("--all-must-finish", action="store_true", help="exit 3 unless every step finished")
    args = ap.parse_args(argv)
    deadline = (args.started_at if args.started_at is not None else time.time()) + args.budget_s
    work = args.work or Path(tempfile.mkdtemp(prefix="quantkit-device-"))
    work.mkdir(parents=True, exist_ok=True)
    steps = scale_steps([r for r in args.runs.split(",") if r], args.samples, args.seq_len, args.device, work)
    summary = run_steps(steps, deadline, grace_s=args.grace_s, min_step_s=args.min_step_s)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return exit_status(summary, args.all_must_finish)


if __name__ == "__main__":
    sys.exit(main())
