"""Shared fixtures: a tiny random Llama (and friends) saved as a real HF safetensors folder with a real
BPE tokenizer trained here on the project's own text, so pipeline tests run in seconds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from quantkit.model.tokenizer import CHAT_TEMPLATE, build_tokenizer

REPO = Path(__file__).resolve().parent.parent

SAMPLE_TEXT = """Quantization maps each weight to one of a few levels. A scale per group keeps the error small.
The calibration set is packed into windows of equal length. Every window is a sequence of token ids.
GPTQ spreads the rounding error of one column over the columns that are not yet quantized.
Round to nearest is fast and needs no data. Activation outliers make int8 activations hard.
def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n
{"id": 7, "name": "widget", "price": 3.25, "tags": ["blue", "small"]}
The train left at 09:15 and arrived at 11:40; the ticket cost 23.50 and the trip was 184 km long.
"""


# conversions in tests check the format rules and capability only (the engine pre-flight starts vLLM, about
# a minute; it has its own tests). Set for the whole session, so a test's monkeypatch.undo() cannot drop it;
# subprocesses (the CLI under test) inherit it.
os.environ.setdefault("QUANTKIT_PREFLIGHT", "capability")
# no MLflow run per CLI call (each test's fresh store costs seconds of migrations); tests/test_tracking*.py
# turn it back on where tracking is what they test
os.environ.setdefault("QUANTKIT_NO_TRACK", "1")
# no hub here: set before any test imports `datasets` or `huggingface_hub`, which read it once at import (set only
# per test, a hub dataset that cannot be found took 23 s of connection retries before its error)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Every test gets its own QUANTKIT_HOME unless it sets one; the demo models and vLLM's cache are reused."""
    home = tmp_path_factory.mktemp("qkhome")
    monkeypatch.setenv("QUANTKIT_HOME", str(home))
    real = Path(os.environ.get("QUANTKIT_REAL_HOME", Path.home() / ".cache" / "quantkit"))
    if (real / "models").is_dir():
        (home / "models").symlink_to(real / "models")
        # vLLM's model-class info, keyed by source hash: saves each engine start a process (vllm_server.py)
        (real / "vllm-cache").mkdir(exist_ok=True)
        (home / "vllm-cache").symlink_to(real / "vllm-cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield


@pytest.fixture(scope="session")
def demo_baselines(tmp_path_factory) -> Path:
    """One baseline cache for the session's evals of the demo model (tests/test_eval_e2e.py computes the smoke
    suite's baseline fresh and stores it here; tests/test_tracking_ui.py then reuses it, or computes it where it
    runs alone): a test links it into its own QUANTKIT_HOME as `baselines`. The cache's key (model bytes, suite,
    engine and its version) decides a hit, exactly as for a user."""
    return tmp_path_factory.mktemp("demo-baselines")


def make_tokenizer(folder: Path, vocab_size: int = 384):
    """The tiny models' tokenizer: byte-level BPE with merges learned on SAMPLE_TEXT (quantkit's builder)."""
    return build_tokenizer(folder, [SAMPLE_TEXT] * 4, vocab_size, CHAT_TEMPLATE)


TINY_CONFIGS = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "gemma": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    # mixture of experts: 8 experts, 2 per token; Qwen3-MoE's second layer dense (mlp_only_layers)
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
}


def make_tiny_model(folder: Path, model_type: str = "llama", seed: int = 0, layers: int | None = None,
                    hidden: int | None = None, overrides: dict | None = None) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(folder)
    kw = dict(TINY_CONFIGS[model_type])
    if layers is not None:
        kw["num_hidden_layers"] = layers
    if hidden is not None:
        kw["hidden_size"] = hidden
        kw["intermediate_size"] = hidden * 2
    kw.update(overrides or {})
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), max_position_embeddings=512,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # real-looking weights: a few input channels with much larger scale, as trained LLMs have
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embed" not in name:  # 3-D: transformers' fused experts
                p.normal_(0, 0.08)
                p[..., :3] *= 4.0
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("calib")
    for i in range(6):
        (d / f"doc{i}.txt").write_text((SAMPLE_TEXT + f"\nDocument {i} ends here.\n") * 3)
    return d


def write_recipe(path: Path, data: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def tiny_recipe(model_dir: Path, calib_dir: Path | None, stages: list[dict], name: str = "tiny") -> dict:
    # float32 compute pinned: the same numbers on every CPU kind (auto would pick bf16 on AMX only);
    # the bf16 path has its own tests (test_convert.py::test_bf16_compute...)
    r = {"name": name, "model": {"path": str(model_dir), "dtype": "bfloat16", "compute_dtype": "float32"},
         "stages": stages}
    if calib_dir is not None:
        # 8 samples in chunks of 3, 3 and 2: every calibrated test runs the chunked forward, remainder included
        r["calibration"] = {"sources": [{"type": "text", "path": str(calib_dir / "*.txt")}],
                            "num_samples": 8, "seq_len": 32, "seed": 0, "batch_size": 3}
    return r


def read_json(p: Path) -> dict:
    return json.loads(Path(p).read_text())
