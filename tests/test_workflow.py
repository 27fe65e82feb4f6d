"""The example CI workflow (.github/workflows/quantize.yml) fails when a gate fails.

GitHub runs a `run:` step as a script file under a shell chosen by `shell:` (the step's, else the job's
`defaults.run.shell`, else the workflow's). When none is named, Linux runners use `bash -e {0}`: a pipe
then takes the status of its last command, so `quantkit gate ... | tee` is green whatever the gate says.
Only an explicit `shell: bash` becomes `bash --noprofile --norc -eo pipefail {0}`. These tests read the
workflow, work out each step's command line the way GitHub does, and run the Gate and Publish scripts
with bash against a fake `quantkit` that passes or fails.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

WORKFLOW = Path(__file__).resolve().parents[1] / ".github" / "workflows" / "quantize.yml"

# GitHub's built-in shells on Linux runners (workflow syntax reference, jobs.<job_id>.steps[*].shell)
BUILTIN_SHELLS = {
    None: "bash -e {0}",  # nothing named anywhere
    "bash": "bash --noprofile --norc -eo pipefail {0}",
    "sh": "sh -e {0}",
    "python": "python {0}",
}
PIPE = re.compile(r"(?<!\|)\|(?!\|)")  # a pipe, not the `||` of an or-list
SETS_PIPEFAIL = re.compile(r"^\s*set\s+-[a-z]*o\s+pipefail\b", re.M)  # set -o pipefail, set -eo pipefail

GATE_TABLE = """gate                      baseline  candidate  compared      threshold  result
quality.perplexity ratio  10.00     10.80      1.08 (ratio)  <= 1.05    FAIL
  ! quality.perplexity ratio: ratio 1.08 violates <= 1.05
FAIL 0/1 (recipe) -> runs/x/eval/gate.json"""


def _load() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps() -> list[tuple[dict, dict, dict]]:
    """(workflow, job, step) for every step that has a `run:` script."""
    wf = _load()
    return [(wf, job, step) for job in wf["jobs"].values() for step in job["steps"] if "run" in step]


def _shell_template(wf: dict, job: dict, step: dict) -> str:
    shell = (step.get("shell") or ((job.get("defaults") or {}).get("run") or {}).get("shell")
             or ((wf.get("defaults") or {}).get("run") or {}).get("shell"))
    return BUILTIN_SHELLS.get(shell, shell)  # a name not built in is a custom template "cmd [opts] {0}"


def _argv(template: str, script: Path) -> list[str]:
    return [script.as_posix() if part == "{0}" else part for part in shlex.split(template)]


def _step(name: str) -> tuple[str, str]:
    """(script, shell template) of the step whose name starts with `name`."""
    found = [(s["run"], _shell_template(wf, job, s)) for wf, job, s in _steps() if s.get("name", "").startswith(name)]
    assert len(found) == 1, f"expected one step named {name!r}, found {len(found)}"
    assert "${{" not in found[0][0], "the script uses a GitHub expression this test does not substitute"
    return found[0]


def _fake_quantkit(bin_dir: Path, rc: int, stdout: str) -> Path:
    """A `quantkit` that records its arguments, prints `stdout` and exits `rc`; and `python` for the scripts."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "out.txt").write_text(stdout + "\n")
    exe = bin_dir / "quantkit"
    exe.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{bin_dir}/args.log"\ncat "{bin_dir}/out.txt"\n'
                   f'[ {rc} -eq 0 ] || echo "quantkit: refused" >&2\nexit {rc}\n')
    exe.chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    return bin_dir


def _run_step(script: str, template: str, tmp_path: Path, rc: int, stdout: str) -> subprocess.CompletedProcess:
    bin_dir = _fake_quantkit(tmp_path / "bin", rc, stdout)
    work = tmp_path / "work"
    work.mkdir()
    path = tmp_path / "step.sh"
    path.write_text(script)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path),
           "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"), "RUN_DIR": "runs/ci-42"}
    (tmp_path / "summary.md").write_text("")
    return subprocess.run(_argv(template, path), cwd=work, env=env, capture_output=True, text=True, timeout=60)


def test_the_shell_model_matches_githubs_rules():
    """The resolution order the other tests rely on: step, then job defaults, then workflow defaults."""
    wf = {"defaults": {"run": {"shell": "sh"}}}
    assert _shell_template({}, {}, {"run": "x"}) == "bash -e {0}"
    assert _shell_template(wf, {}, {"run": "x"}) == "sh -e {0}"
    assert _shell_template(wf, {"defaults": {"run": {"shell": "bash"}}}, {"run": "x"}).endswith("-eo pipefail {0}")
    assert _shell_template(wf, {}, {"run": "x", "shell": "bash -x {0}"}) == "bash -x {0}"


def test_every_step_that_pipes_runs_with_pipefail():
    piping = []
    for wf, job, step in _steps():
        first_pipe = next((i for i, line in enumerate(step["run"].splitlines()) if PIPE.search(line)), None)
        if first_pipe is None:
            continue
        piping.append(step["name"])
        template = _shell_template(wf, job, step)
        set_before = SETS_PIPEFAIL.search("\n".join(step["run"].splitlines()[:first_pipe]))
        assert "pipefail" in template or set_before, f"step {step['name']!r} pipes without pipefail ({template})"
    assert {"Gate", "Publish (main only)"} <= set(piping)  # the parser did find the pipes it must judge


def test_job_runs_every_step_under_an_explicit_bash():
    for wf, job, step in _steps():
        assert _shell_template(wf, job, step) == BUILTIN_SHELLS["bash"], step.get("name")


@pytest.mark.parametrize("rc", [1, 0])
def test_gate_step_status_is_the_gates(tmp_path, rc):
    script, template = _step("Gate")
    proc = _run_step(script, template, tmp_path, rc, GATE_TABLE)
    assert proc.returncode == rc, (proc.stdout, proc.stderr)
    summary = (tmp_path / "summary.md").read_text()
    assert summary == "```\n" + GATE_TABLE + "\n```\n"  # the table, fenced, even when a gate fails
    assert (tmp_path / "bin" / "args.log").read_text() == "gate runs/ci-42 --junit runs/ci-42/eval/gates.xml\n"


def test_gate_step_without_pipefail_would_stay_green(tmp_path):
    """The control: the same script with its `set -o pipefail` removed, under the shell GitHub uses when
    none is named, exits 0 on a failing gate, which is the hole the workflow had."""
    script, _ = _step("Gate")
    stripped = SETS_PIPEFAIL.sub(":", script)
    assert stripped != script
    proc = _run_step(stripped, BUILTIN_SHELLS[None], tmp_path, 1, GATE_TABLE)
    assert proc.returncode == 0


def test_publish_step_fails_when_publish_is_refused(tmp_path):
    script, template = _step("Publish")
    proc = _run_step(script, template, tmp_path, 1, "")
    assert proc.returncode != 0 and "quantkit: refused" in proc.stderr
    assert "Published" not in (tmp_path / "summary.md").read_text()


def test_publish_step_reports_the_published_version(tmp_path):
    script, template = _step("Publish")
    proc = _run_step(script, template, tmp_path, 0, '{"name": "smollm2-135m-w8a8", "version": "3"}')
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "summary.md").read_text() == "Published: smollm2-135m-w8a8 version 3\n"
    assert (tmp_path / "bin" / "args.log").read_text() == "publish runs/ci-42 --json\n"
