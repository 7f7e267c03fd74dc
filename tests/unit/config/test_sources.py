"""parse() from each source: dict, JSON path (str or Path), base64, an existing config."""

import base64
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from deepspeed_ext.config import ConfigError, DeepSpeedConfig, parse

CFG = {"train_batch_size": 8, "fp16": {"enabled": True}, "optimizer": {"type": "Adam"}}


def test_from_dict():
    cfg = parse(CFG)
    assert isinstance(cfg, DeepSpeedConfig)
    assert cfg.train_batch_size == 8 and cfg.fp16.enabled and cfg.optimizer.type == "Adam"
    assert cfg.source == "<dict>"


@pytest.mark.parametrize("as_path", [str, Path])
def test_from_json_file(tmp_path, as_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(CFG))
    cfg = parse(as_path(f))
    assert cfg.to_dict() == parse(CFG).to_dict()
    assert cfg.source == str(f)


@pytest.mark.parametrize("encode", [base64.urlsafe_b64encode, base64.b64encode])
def test_from_base64(encode):
    opt = {"type": "Adam", "params": {"x": "??>>"}}  # characters base64 encodes to + / _ -
    text = encode(json.dumps({**CFG, "optimizer": opt}).encode()).decode()
    cfg = parse(text)
    assert cfg.train_batch_size == 8 and cfg.optimizer.params["x"] == "??>>"
    assert cfg.source == "<base64>"


def test_an_existing_config_is_returned_as_is():
    cfg = parse(CFG)
    assert parse(cfg) is cfg


def test_bad_json_names_file_line_and_column(tmp_path):
    f = tmp_path / "broken.json"
    f.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as e:
        parse(f)
    msg = str(e.value)
    assert str(f) in msg and "line 3" in msg and "column 28" in msg
    assert '"fp16": {"enabled": true,}' in msg  # the offending line is shown


def test_duplicate_key_is_an_error(tmp_path):
    f = tmp_path / "dup.json"
    f.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match='duplicate key "train_batch_size"'):
        parse(f)


def test_missing_file_and_garbage_string():
    with pytest.raises(ConfigError, match="no such config file: /nonexistent/ds.json"):
        parse("/nonexistent/ds.json")
    with pytest.raises(ConfigError, match="neither an existing JSON file nor base64"):
        parse("not a config")


def test_top_level_must_be_an_object(tmp_path):
    f = tmp_path / "list.json"
    f.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse(f)


def test_config_is_frozen():
    cfg = parse({"optimizer": {"type": "Adam", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}})
    with pytest.raises(ValidationError):
        cfg.gradient_clipping = 2.0  # type: ignore[misc]
    with pytest.raises(ValidationError):
        cfg.fp16.enabled = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.optimizer.params["lr"] = 1.0  # type: ignore[index]
    assert cfg.optimizer.params["betas"] == (0.9, 0.99)  # lists become tuples
    assert dict(cfg.optimizer.params) == {"lr": 0.1, "betas": (0.9, 0.99)}


def test_raw_is_what_the_user_gave_and_to_dict_the_effective_config():
    user = {"bfloat16": {"enabled": True}, "train_batch_size": 4}
    with pytest.warns(FutureWarning):
        cfg = parse(user)
    assert cfg.raw == user
    cfg.raw["train_batch_size"] = 99  # a copy: the config does not change
    assert cfg.raw == user
    effective = cfg.to_dict()
    assert effective["bf16"]["enabled"] is True and "bfloat16" not in effective
    assert effective["fp16"]["initial_scale_power"] == 16  # defaults are filled in
    json.dumps(effective)  # plain JSON data
    assert parse(effective).to_dict() == effective
