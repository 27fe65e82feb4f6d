"""Bad recipes and the messages users get for them; --set overrides; the shipped recipes validate."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import REPO, write_recipe
from quantkit.cli import app
from quantkit.recipe import RecipeError, load_recipe

GOOD = {"name": "r", "model": {"path": "smollm2-135m"}, "stages": [{"method": "rtn", "scheme": "W8A8"}]}


def _err(tmp_path: Path, data, overrides=None) -> str:
    p = write_recipe(tmp_path / "x.yaml", data) if not isinstance(data, str) else tmp_path / "x.yaml"
    if isinstance(data, str):
        p.write_text(data)
    with pytest.raises(RecipeError) as ei:
        load_recipe(p, overrides)
    return str(ei.value)


def _with(**changes):
    import copy

    d = copy.deepcopy(GOOD)
    for path, value in changes.items():
        node = d
        parts = path.split("__")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node[part]
        last = parts[-1]
        if value is _DELETE:
            del node[last]
        elif last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value
    return d


_DELETE = object()


@pytest.mark.parametrize("data, expected", [
    (_with(stages__0__scheme="W4A61"),
     "x.yaml: stages[0].scheme: 'W4A61' is not a known scheme (known: W8A8, W4A16"),
    (_with(stages__0__method="awq2"), "stages[0]: 'awq2' is not a known method (known: rtn, gptq, autoround, rotate, awq, smoothquant"),
    (_with(stages__0__group_sz=64), "stages[0].group_sz: unknown key 'group_sz' (allowed: "),
    (_with(stages__0__group_size=-5), "stages[0].group_size: -5 is not a valid group size"),
    (_with(stages__0__group_size=63), "63 is not a valid group size (use a positive even number"),
    (_with(modle={"path": "x"}), "modle: unknown key 'modle' (allowed: accept_anomalies, calibration, description, eval"),
    (_with(model=_DELETE), "x.yaml: model: required field is missing"),
    (_with(stages=[]), "x.yaml: stages: List should have at least 1 item after validation, not 0"),
    (_with(name="bad name!"), "name: 'bad name!': String should match pattern"),
    (_with(model__dtype="float8"), "model.dtype: 'float8' is not allowed ('bfloat16', 'float16' or 'float32')"),
    (_with(stages__0__targets=["re:(unclosed"]), "stages[0].targets: 're:(unclosed' is not a valid regular expression"),
    (_with(stages=[{"method": "gptq", "scheme": "W4A16"}]), "stages[0] (gptq) needs calibration data"),
    (_with(calibration={"sources": [{"type": "csv", "path": "a"}]}),
     "calibration.sources[0].type: 'csv' is not allowed ('text', 'jsonl', 'parquet', 'disk', 'hub', 'chat' or 'builtin')"),
    (_with(calibration={"sources": [{"type": "text", "path": "a"}], "num_samples": 0}),
     "calibration.num_samples: 0: Input should be greater than or equal to 1"),
    (_with(gates=[{"metric": "quality.perplexity", "op": "=<", "threshold": 1.0}]), "gates[0].op: '=<' is not allowed"),
    (_with(calibration={"sources": [{"type": "builtin", "name": "heldout"}]}),
     "calibration.sources[0]: name: 'heldout' is not a builtin corpus (known: prose, code, chat, json, numbers)"),
    (_with(calibration={"sources": [{"type": "builtin", "name": "prose", "path": "x/*.txt"}]}),
     "calibration.sources[0]: path: a builtin source is chosen by `name`, not `path`; remove path"),
    (_with(calibration={"sources": [{"type": "text"}]}),
     "calibration.sources[0]: path: required for type 'text'"),
    (_with(calibration={"sources": [{"type": "text", "path": "a", "name": "prose"}]}),
     "calibration.sources[0]: name: only type builtin takes a name"),
])
def test_bad_recipe_messages(tmp_path, data, expected):
    assert expected in _err(tmp_path, data)


def test_every_error_is_reported_with_file_and_path(tmp_path):
    msg = _err(tmp_path, _with(stages__0__scheme="nope", model__dtype="x"))
    lines = msg.splitlines()
    assert len(lines) == 2 and all(line.startswith(str(tmp_path / "x.yaml")) for line in lines)


def test_not_a_mapping_and_bad_yaml_and_missing_file(tmp_path):
    assert "must be a YAML mapping" in _err(tmp_path, "- just\n- a list\n")
    assert "not valid YAML" in _err(tmp_path, "name: [unclosed\n")
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "missing.yaml")


def test_set_overrides_are_validated_like_the_file(tmp_path):
    p = write_recipe(tmp_path / "x.yaml", GOOD)
    r = load_recipe(p, ["stages[0].scheme=W4A16", "stages.0.group_size=64", "calibration.num_samples=16",
                        "calibration.sources=[{type: text, path: 'a/*.txt'}]"])
    assert r.stages[0].scheme == "W4A16" and r.stages[0].group_size == 64
    # applied, and made absolute against the working directory like every relative path in a recipe
    assert r.calibration.num_samples == 16 and r.calibration.sources[0].path == str(Path.cwd() / "a/*.txt")
    msg = _err(tmp_path, GOOD, ["stages[0].scheme=W4A61"])
    assert "(with --set overrides): stages[0].scheme: 'W4A61' is not a known scheme" in msg
    assert "index 3 out of range" in _err(tmp_path, GOOD, ["stages[3].scheme=W8A8"])
    assert "expected KEY=VALUE" in _err(tmp_path, GOOD, ["stages"])


def test_recipe_hash_is_stable_and_sensitive(tmp_path):
    p = write_recipe(tmp_path / "x.yaml", GOOD)
    a, b = load_recipe(p), load_recipe(p)
    assert a.hash() == b.hash()
    assert load_recipe(p, ["stages[0].scheme=W4A16"]).hash() != a.hash()


def test_shipped_recipes_validate():
    files = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(files) >= 2
    result = CliRunner().invoke(app, ["recipes", "validate", *map(str, files)])
    assert result.exit_code == 0, result.output
    for f in files:  # each shipped recipe documents itself in its first line
        assert f.read_text().startswith("# "), f


def test_cli_validate_reports_bad_recipe(tmp_path):
    p = write_recipe(tmp_path / "x.yaml", _with(stages__0__scheme="W4A61"))
    result = CliRunner().invoke(app, ["recipes", "validate", str(p)])
    assert result.exit_code == 2
    assert "stages[0].scheme: 'W4A61' is not a known scheme" in result.output


def test_unknown_option_is_a_usage_error_not_an_internal_one(tmp_path, monkeypatch):
    """typer vendors its own click: its usage errors must reach click's reporting (exit 2), not the crash path."""
    monkeypatch.setenv("QUANTKIT_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["convert", "--nosuch", "x.yaml"])
    assert result.exit_code == 2, result.output
    assert "No such option: --nosuch" in result.output and "internal error" not in result.output
    assert not (tmp_path / "logs").exists(), "no crash log for a typo"
