"""Config parsing from every source, attribute access, and every error the issue lists."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from parallelctx import Config, ConfigError, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults() -> None:
    cfg = Config()
    assert cfg.parallel.tensor.size == 1
    assert cfg.parallel.order == "tp-cp-ep-dp-pp"
    assert cfg.dist.backend == "auto"
    assert cfg.dist.timeout == timedelta(minutes=30)
    assert cfg.seed == 1024


def test_int_or_dict_sizes_and_extra_keys() -> None:
    cfg = Config({"parallel": {"tensor": 2, "pipeline": {"size": 4, "interleaved_overlap": True}, "expert": {"size": 2, "tensor": 1}}})
    assert cfg.parallel.tensor.size == 2
    assert cfg.parallel.pipeline.size == 4
    assert cfg.parallel.pipeline.interleaved_overlap is True
    assert cfg.parallel.expert.size == 2 and cfg.parallel.expert_tensor == 1
    assert Config({"parallel": {"tensor": 4}}).parallel.expert_tensor == 4


def test_other_sections_by_attribute_and_key() -> None:
    cfg = Config({"model": {"hidden_size": 1024, "layers": [1, 2]}, "lr": 0.1})
    assert cfg.model.hidden_size == 1024
    assert cfg["model"]["hidden_size"] == 1024
    assert cfg.model.layers == [1, 2]
    assert cfg.lr == 0.1
    assert cfg["parallel"] is cfg.parallel
    with pytest.raises(AttributeError, match="config.model has no key 'hiden_size'; keys: hidden_size, layers"):
        cfg.model.hiden_size
    with pytest.raises(KeyError, match="config has no key 'optim'"):
        cfg["optim"]


def test_config_round_trip_and_passthrough() -> None:
    cfg = Config({"parallel": {"tensor": 2}, "model": {"h": 1}})
    assert load_config(cfg) is cfg
    again = Config(cfg)
    assert again.parallel.tensor.size == 2 and again.model.h == 1
    assert load_config(None).seed == 1024
    assert load_config({"seed": 7}).seed == 7


def test_timeout_forms() -> None:
    assert Config({"dist": {"timeout": 90}}).dist.timeout == timedelta(seconds=90)
    assert Config({"dist": {"timeout": 1.5}}).dist.timeout == timedelta(seconds=1.5)
    assert Config({"dist": {"timeout": timedelta(minutes=2)}}).dist.timeout == timedelta(minutes=2)


@pytest.mark.parametrize(
    ("data", "path", "text"),
    [
        ({"parallel": {"tensor": 0}}, "parallel.tensor.size", "greater than 0"),
        ({"parallel": {"pipeline": -2}}, "parallel.pipeline.size", "greater than 0"),
        ({"parallel": {"tensor": {"size": 0}}}, "parallel.tensor.size", "greater than 0"),
        ({"parallel": {"order": "tp-xp-dp"}}, "parallel.order", "unknown token 'xp'"),
        ({"parallel": {"order": "tp-dp-dp"}}, "parallel.order", "repeats dp"),
        ({"parallel": {"tensr": 2}}, "parallel.tensr", "Extra inputs are not permitted"),
        ({"dist": {"backend": "mpi"}}, "dist.backend", "'auto', 'nccl' or 'gloo'"),
        ({"dist": {"timeout": "10s"}}, "dist.timeout", "must be seconds (e.g. timeout=1800) or a datetime.timedelta"),
        ({"dist": {"timeout": -1}}, "dist.timeout", "must be positive"),
        ({"dist": {"init_method": "http://x"}}, "dist.init_method", "tcp://, env:// or file://"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"seed": 2**32}, "seed", "less than or equal to 4294967295"),
    ],
)
def test_validation_errors_name_key_and_fix(data, path, text) -> None:
    with pytest.raises(ValidationError) as info:
        Config(data)
    message = str(info.value)
    assert path in message
    assert text in message


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="not list"):
        Config([1, 2])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- files
def test_py_file_top_level_names(tmp_path: Path) -> None:
    helper = tmp_path / "cfg_helper_mod.py"
    helper.write_text("HIDDEN = 512\n")
    path = tmp_path / "cfg.py"
    path.write_text(
        "import os\n"
        "from cfg_helper_mod import HIDDEN\n"
        "_private = 1\n"
        "def f():\n    return 1\n"
        "parallel = dict(tensor=2, pipeline=dict(size=2))\n"
        "model = dict(hidden_size=HIDDEN)\n"
    )
    cfg = Config.from_file(path)
    assert cfg.parallel.tensor.size == 2
    assert cfg.model.hidden_size == 512
    assert cfg.HIDDEN == 512
    assert "os" not in cfg and "_private" not in cfg and "f" not in cfg
    # the config's folder was importable while it ran, and nothing leaked afterwards
    assert "cfg_helper_mod" not in sys.modules
    assert str(tmp_path) not in sys.path


def test_json_toml_yaml(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text('{"parallel": {"tensor": 2}, "model": {"h": 1}}')
    (tmp_path / "c.toml").write_text("seed = 3\n[parallel]\ntensor = 2\n[model]\nh = 1\n")
    (tmp_path / "c.yaml").write_text("parallel:\n  tensor: 2\nmodel:\n  h: 1\n")
    for name in ("c.json", "c.toml", "c.yaml"):
        cfg = load_config(tmp_path / name)
        assert cfg.parallel.tensor.size == 2 and cfg.model.h == 1
    assert load_config(str(tmp_path / "c.toml")).seed == 3


def test_example_configs_load() -> None:
    files = sorted(CONFIGS.glob("*.*"))
    assert files, "configs/ should hold example configs"
    for path in files:
        assert load_config(path).parallel.tensor.size >= 1


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("bad.py", "parallel = dict(tensor=2\nx = 1\n", r"bad\.py:1: syntax error"),
        ("bad.json", '{"a": 1,\n "b": }', r"bad\.json:2: JSON error"),
        ("bad.toml", "a = 1\nb = = 2\n", r"bad\.toml: TOML error.*line 2"),
        ("bad.yaml", "a: 1\nb: [1, 2\n", r"bad\.yaml:\d+: YAML error"),
        ("raises.py", "x = 1 / 0\n", r"raised ZeroDivisionError"),
        ("list.json", "[1, 2]", "must hold a mapping"),
        ("cfg.ini", "a=1", r"suffix '\.ini'; use \.py, \.json, \.toml or \.yaml"),
    ],
)
def test_file_errors(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        Config.from_file(path)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file 'nope/none.py' does not exist"):
        load_config("nope/none.py")


def test_config_pickles_for_spawned_workers() -> None:
    import pickle

    cfg = Config({"parallel": {"tensor": 2, "pipeline": {"size": 2, "overlap": True}}, "dist": {"timeout": 5}, "model": {"h": 3}})
    again = pickle.loads(pickle.dumps(cfg))
    assert isinstance(again, Config)
    assert again.to_dict() == cfg.to_dict()
    assert again.model.h == 3 and again.parallel.pipeline.overlap is True
    assert again.dist.timeout == timedelta(seconds=5)
    section = pickle.loads(pickle.dumps(cfg.model))
    assert section.h == 3
    with pytest.raises(AttributeError, match="config.model has no key 'x'"):
        section.x
