"""Model sources: safetensors only, pickle refused with the fix, hub ids offline, unknown families."""

from __future__ import annotations

import shutil

import pytest

from quantkit.model import ModelError
from quantkit.model.arch import arch_for
from quantkit.model.sources import resolve_model_dir
from quantkit.recipe import ModelSpec


def test_local_folder_resolves(tiny_llama):
    assert resolve_model_dir(ModelSpec(path=str(tiny_llama))) == tiny_llama


def test_pickle_checkpoint_is_refused(tiny_llama, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelError, match=r"weights are pickle files \(pytorch_model.bin\); quantkit loads only "
                                         r"safetensors.*save_pretrained\(DIR_OUT, safe_serialization=True\)"):
        resolve_model_dir(ModelSpec(path=str(d)))


def test_folder_without_weights_or_config(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_dir(ModelSpec(path=str(tmp_path / "a")))


def test_hub_id_offline_is_a_clear_error():
    with pytest.raises(ModelError, match=r"'someorg/somemodel' looks like a hub id but could not be downloaded .*"
                                         r"point model.path at the local folder"):
        resolve_model_dir(ModelSpec(path="someorg/somemodel"))


def test_unknown_source_and_missing_gguf(tmp_path):
    with pytest.raises(ModelError, match="is not a folder, a .gguf file, a hub id"):
        resolve_model_dir(ModelSpec(path="not a model"))
    with pytest.raises(ModelError, match="no such GGUF file"):
        resolve_model_dir(ModelSpec(path=str(tmp_path / "x.gguf")))


def test_unknown_architecture():
    class Cfg:
        model_type = "rwkv"

    with pytest.raises(ModelError, match="model_type 'rwkv' has no architecture spec .*register_arch"):
        arch_for(Cfg())
