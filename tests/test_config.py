"""Config parsing from every source, attribute access, and every error the issue lists."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from parallelctx import Config, ConfigError, load_config

pytest_plugins = ["pytester"]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults() -> None:
    cfg = Config()
    assert cfg.parallel.tensor.size == 1
    assert cfg.parallel.order == "tp-cp-ep-dp-pp"
    assert cfg.dist.backend == "auto"
    assert cfg.dist.timeout == timedelta(minutes=30)
    assert cfg.seed == 1024


def test_int_or_dict_sizes_and_extra_keys() -> None:
    cfg = Config(
        {
            "parallel": {
                "tensor": 2,
                "pipeline": {"size": 4, "interleaved_overlap": True},
                "expert": {"size": 2, "tensor": 1},
            }
        }
    )
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
    with pytest.raises(
        AttributeError, match="config.model has no key 'hiden_size'; keys: hidden_size, layers"
    ):
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
        ({"parallel": {"tensr": 2}}, "parallel", "parallel: unknown key 'tensr'; did you mean 'tensor'?"),
        ({"dist": {"backend": "mpi"}}, "dist.backend", "'auto', 'nccl' or 'gloo'"),
        (
            {"dist": {"timeout": "10s"}},
            "dist.timeout",
            "must be seconds (e.g. timeout=1800) or a datetime.timedelta",
        ),
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
    # the config's folder was importable while it ran and left sys.path afterwards; the modules the
    # config imported stay imported (module identity, see test_py_config_keeps_module_identity)
    assert "cfg_helper_mod" in sys.modules
    assert str(tmp_path) not in sys.path
    del sys.modules["cfg_helper_mod"]


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

    cfg = Config(
        {
            "parallel": {"tensor": 2, "pipeline": {"size": 2, "overlap": True}},
            "dist": {"timeout": 5},
            "model": {"h": 3},
        }
    )
    again = pickle.loads(pickle.dumps(cfg))
    assert isinstance(again, Config)
    assert again.to_dict() == cfg.to_dict()
    assert again.model.h == 3 and again.parallel.pipeline.overlap is True
    assert again.dist.timeout == timedelta(seconds=5)
    section = pickle.loads(pickle.dumps(cfg.model))
    assert section.h == 3
    with pytest.raises(AttributeError, match="config.model has no key 'x'"):
        section.x


# --------------------------------------------------------------------------- issue 10: values
@pytest.mark.parametrize(
    ("timeout", "text"),
    [
        (float("inf"), "dist.timeout=inf must be a finite number of seconds"),
        (float("nan"), "dist.timeout=nan must be a finite number of seconds"),
        (-float("inf"), "dist.timeout=-inf must be a finite number of seconds"),
        (1e20, "dist.timeout=1e+20 is out of range"),
        (2**64, "dist.timeout=18446744073709551616 is out of range"),
        (10**400, "is out of range"),
        (timedelta(days=999999999), "dist.timeout=datetime.timedelta(days=999999999) is out of range"),
        (timedelta(days=366), "is out of range"),
        (1e-4, "dist.timeout=0.0001 is out of range"),
        (0, "dist.timeout=0 must be positive"),
        (timedelta(0), "must be positive"),
    ],
)
def test_timeouts_must_be_finite_and_in_range(timeout, text) -> None:
    # inf, nan, 1e20 and 2**64 used to escape as OverflowError; 999999999 days failed at launch
    with pytest.raises(ValidationError) as info:
        Config({"dist": {"timeout": timeout}})
    assert text in str(info.value)
    assert "between 0.001 and 31536000 seconds (1 ms to 365 days)" in str(info.value)


def test_timeout_limits_are_inclusive() -> None:
    from parallelctx.config import to_timedelta

    assert Config({"dist": {"timeout": 365 * 86400}}).dist.timeout == timedelta(days=365)
    assert Config({"dist": {"timeout": 0.001}}).dist.timeout == timedelta(milliseconds=1)
    with pytest.raises(ValueError, match=r"^timeout=inf must be a finite number"):
        to_timedelta(float("inf"))
    with pytest.raises(TypeError, match="my_wait='1' must be seconds"):
        to_timedelta("1", "my_wait")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (
            {"parallel": {"tensor": {"sizes": 4}}},
            "parallel.tensor: unknown key 'sizes'; did you mean 'size'?",
        ),
        (
            {"parallel": {"pipeline": {"size": 2, "szie": 4}}},
            "parallel.pipeline: unknown key 'szie'; did you mean 'size'?",
        ),
        (
            {"parallel": {"expert": {"size": 2, "tensr": 2}}},
            "parallel.expert: unknown key 'tensr'; did you mean 'tensor'?",
        ),
        (
            {"parallel": {"context": {"Size": 2}}},
            "parallel.context: unknown key 'Size'; did you mean 'size'?",
        ),
        ({"parallel": {"tensor": {"size": True}}}, "size=True is of type bool, not an integer"),
        ({"parallel": {"tensor": True}}, "parallel.tensor=True is of type bool"),
        (
            {"parallel": {"tensor": "2"}},
            "parallel.tensor='2' is of type str; give the size as an int (tensor=2)",
        ),
        ({"parallel": {"tensor": {"size": "2"}}}, "size='2' is of type str, not an integer"),
        ({"parallel": {"tensor": 2.0}}, "parallel.tensor=2.0 is of type float"),
        ({"parallel": {"tensor": {"size": 2.0}}}, "size=2.0 is of type float"),
        ({"parallel": {"tensor": None}}, "parallel.tensor=None is of type NoneType"),
        ({"parallel": {"expert": {"size": 2, "tensor": True}}}, "tensor=True is of type bool"),
        ({"parallel": {"data": True}}, "data=True is of type bool"),
        ({"parallel": {"data": "4"}}, "data='4' is of type str"),
        (
            {"parallel": {"pipeline": {"size": 2, "copy": 1}}},
            "key 'copy' has the name of a pydantic model or config-section attribute",
        ),
        ({"parallel": {"pipeline": {"size": 2, 3: 1}}}, "parallel.pipeline: key 3 is not a name"),
        ({"parallel": {"order": b"tp-dp"}}, "Input should be a valid string"),
        ({"seed": True}, "seed=True is of type bool, not an integer"),
        ({"seed": b"1"}, "seed=b'1' is of type bytes, not an integer"),
        ({"seed": "1"}, "seed='1' is of type str"),
        ({"seed": 1.0}, "seed=1.0 is of type float"),
        (
            {"dist": {"timout": 3}},
            "dist: unknown key 'timout'; did you mean 'timeout'? valid keys: backend, timeout",
        ),
        ({"dist": {"gloo_lazy_init": "yes"}}, "dist.gloo_lazy_init"),
        ({"parallel": {"pipelin": 2}}, "parallel: unknown key 'pipelin'; did you mean 'pipeline'?"),
        ({"parallel": {"zzz": 2}}, "parallel: unknown key 'zzz'; valid keys: tensor, pipeline"),
    ],
)
def test_typos_and_wrong_types_are_refused(data, text) -> None:
    with pytest.raises(ValidationError) as info:
        Config(data)
    assert text in str(info.value)


def test_axis_extras_kept_and_numpy_sizes_accepted() -> None:
    import numpy as np

    cfg = Config(
        {
            "parallel": {
                "tensor": np.int64(2),
                "pipeline": {"size": np.int32(4), "overlap_p2p": True},
                "expert": {"size": 2, "tensor": np.int64(1)},
                "data": np.int64(1),
            },
            "seed": np.uint32(7),
        }
    )
    assert (cfg.parallel.tensor.size, cfg.parallel.pipeline.size, cfg.parallel.expert_tensor) == (2, 4, 1)
    assert type(cfg.parallel.tensor.size) is int and cfg.seed == 7 and type(cfg.seed) is int
    assert cfg.parallel.pipeline.overlap_p2p is True
    with pytest.raises(ValidationError, match="parallel.tensor=np.True_ is of type bool"):
        Config({"parallel": {"tensor": np.True_}})


@pytest.mark.parametrize(
    ("url", "text"),
    [
        ("tcp://", "names no host; write tcp://HOST:PORT"),
        ("tcp://host", "'tcp://host' names no port"),
        ("tcp://127.0.0.1:99999", "the port is not a number in 1..65535"),
        ("tcp://127.0.0.1:0", "port 0 must lie in 1..65535"),
        ("tcp://h:abc", "the port is not a number in 1..65535"),
        ("tcp://:29500", "names no host"),
        ("tcp://user:pw@h:1", "user name or password"),
        ("tcp://h:1/path", "has a path '/path'"),
        ("tcp://bad_host!:1", "neither an IP address nor a host name"),
        ("tcp://h:1#frag", "fragment"),
        ("tcp://h :1", "whitespace"),
        ("file://", "names no file"),
        ("file:///tmp/", "names no file"),
        ("file://tmp/x", "'tmp' would be read as a host name"),
        ("env://host:1", "nothing may follow env://"),
        ("http://x", "must start with tcp://, env:// or file://"),
        ("TCP://h:1", "must start with tcp://"),
    ],
)
def test_init_method_validated_in_full(url: str, text: str) -> None:
    with pytest.raises(ValidationError) as info:
        Config({"dist": {"init_method": url}})
    assert "dist.init_method" in str(info.value) and text in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "tcp://10.0.0.1:29500",
        "tcp://[::1]:29500",
        "tcp://node-01.cluster:1",
        "tcp://h:65535?x=1",
        "env://",
        "env://?rank=0",
        "file:///tmp/rdzv",
        "file://localhost/tmp/rdzv",
    ],
)
def test_good_init_methods_are_kept(url: str) -> None:
    assert Config({"dist": {"init_method": url}}).dist.init_method == url


def test_check_init_method_env(tmp_path: Path) -> None:
    from parallelctx.config import check_init_method_env

    good = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    check_init_method_env("env://", good)
    check_init_method_env(None, {})
    check_init_method_env("tcp://h:1", {})
    with pytest.raises(
        ConfigError, match=r"dist.init_method='env://' .* MASTER_ADDR and MASTER_PORT are not set; export"
    ):
        check_init_method_env("env://", {})
    with pytest.raises(ConfigError, match="MASTER_PORT is not set"):
        check_init_method_env("env://", {"MASTER_ADDR": "h"})
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set"):
        check_init_method_env("env://", {"MASTER_ADDR": "", "MASTER_PORT": "1"})
    for port in ("abc", "0", "70000", "1_0", "-1"):
        with pytest.raises(ConfigError, match=rf"MASTER_PORT='{port}' must be a port in 1..65535"):
            check_init_method_env("env://", {"MASTER_ADDR": "h", "MASTER_PORT": port})
    check_init_method_env(f"file://{tmp_path}/rdzv", {})
    with pytest.raises(ConfigError, match=r"the folder '.*/nope' does not exist"):
        check_init_method_env(f"file://{tmp_path}/nope/rdzv", {})
    with pytest.raises(ConfigError, match="launch_url='env://'"):
        check_init_method_env("env://", {}, name="launch_url")


# --------------------------------------------------------------------------- issue 10: keys and structure
@pytest.mark.parametrize("key", ["items", "keys", "values", "get", "to_dict", "_data"])
def test_keys_shadowed_by_methods_are_refused(key: str) -> None:
    # gpc.config.model.items used to return the mapping method, silently
    with pytest.raises(
        ConfigError, match=rf"config.model: key '{key}' is the name of a config-section method"
    ):
        Config({"model": {key: 1}})
    with pytest.raises(ConfigError, match=rf"config: key '{key}' is the name"):
        Config({key: 1})


def test_from_file_key_is_refused_at_the_top_only() -> None:
    with pytest.raises(ConfigError, match="config: key 'from_file'"):
        Config({"from_file": 1})
    assert Config({"model": {"from_file": 1}}).model.from_file == 1


def test_self_reference_and_deep_nesting_are_refused() -> None:
    loop: dict = {}
    loop["again"] = loop
    with pytest.raises(ConfigError, match="config.model.again contains itself"):
        Config({"model": loop})
    items: list = []
    items.append(items)
    with pytest.raises(ConfigError, match=r"config.data\[0\] contains itself"):
        Config({"data": items})
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ConfigError, match=r"config.x\[0\]\[0\].* is nested 65 levels deep, more than the 64"):
        Config({"x": deep})
    shared = [1, 2]
    assert Config({"a": {"x": shared, "y": shared}}).a.y == [1, 2]  # shared, not circular: fine


def test_too_many_values_are_refused_quickly() -> None:
    import time

    level: list = ["x"] * 10
    for _ in range(9):
        level = [level] * 10  # 10**10 values once expanded, in a few hundred bytes
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="config holds more than 1000000 values"):
        Config({"model": {"bomb": level}})
    assert time.perf_counter() - start < 10


# --------------------------------------------------------------------------- issue 10: files
@pytest.mark.parametrize("name", ["c.json", "c.toml", "c.yaml", "c.yml"])
def test_non_utf8_files_name_the_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    text = {"c.json": b'{"model": {"name": "caf\xe9"}}', "c.toml": b'[model]\nname = "caf\xe9"\n'}
    path.write_bytes(text.get(name, b"model:\n  name: caf\xe9\n"))
    with pytest.raises(
        ConfigError, match=rf"{name}:\d+: not UTF-8 text \(byte 0xe9 at offset \d+\); save the file as UTF-8"
    ):
        Config.from_file(path)


def test_non_utf8_py_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.py"
    path.write_bytes(b"model = dict(name='caf\xe9')\n")
    with pytest.raises(ConfigError, match=r"c\.py:1: syntax error: .*utf-8"):
        Config.from_file(path)


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_bytes(b'\xef\xbb\xbf{"seed": 3}')
    assert Config.from_file(tmp_path / "c.json").seed == 3


def test_yaml_alias_bomb_is_refused_in_bounded_time(tmp_path: Path) -> None:
    # 1 KB of YAML whose aliases expand to 10**10 values: used to take 46 s and 2.5 GB
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size < 1200
    import time

    start = time.perf_counter()
    with pytest.raises(
        ConfigError, match=r"bomb\.yaml: config holds more than 1000000 values .*YAML aliases"
    ):
        Config.from_file(path)
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("self.yaml", "a: &a [*a]\n", r"self\.yaml: config\.a\[0\] contains itself"),
        ("selfmap.yaml", "a: &a {b: *a}\n", r"selfmap\.yaml: config\.a\.b contains itself"),
        ("self.py", "model = {}\nmodel['m'] = model\n", r"self\.py: config\.model\.m contains itself"),
        ("deep.json", "[" * 5000 + "]" * 5000, r"deep\.json: JSON nested too deeply to parse"),
        (
            "deep2.json",
            '{"a": ' + "[" * 100 + "]" * 100 + "}",
            r"deep2\.json: config\.a(\[0\])+.* is nested 65 levels deep",
        ),
        (
            "deep.toml",
            "a = " + "[" * 5000 + "]" * 5000 + "\n",
            r"deep\.toml: TOML nested too deeply to parse",
        ),
        (
            "deep.yaml",
            "a: " + "[" * 5000 + "]" * 5000 + "\n",
            r"deep\.yaml(:\d+: YAML error|: YAML nested too deeply)",
        ),
        (
            "deep.py",
            "x = []\nfor _ in range(5000):\n    x = [x]\n",
            r"deep\.py: config\.x.* is nested 65 levels deep",
        ),
        ("bigint.json", '{"a": ' + "1" * 5000 + "}", r"bigint\.json: JSON error: Exceeds the limit"),
        ("bigint.yaml", "a: " + "1" * 5000 + "\n", r"bigint\.yaml: YAML error: Exceeds the limit"),
        ("items.yaml", "model:\n  items: 3\n", r"items\.yaml: config\.model: key 'items' is the name"),
    ],
)
def test_structure_faults_in_files_name_the_file(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        Config.from_file(path)


def test_directory_and_oversized_files(tmp_path: Path) -> None:
    folder = tmp_path / "cfg.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="cfg.yaml' is a directory; pass the path of a config file"):
        Config.from_file(folder)
    big = tmp_path / "big.json"
    with big.open("wb") as handle:
        handle.truncate(16 * 2**20 + 1)
    with pytest.raises(
        ConfigError, match=r"big\.json: 16777217 bytes, more than the 16777216 bytes \(16 MiB\)"
    ):
        Config.from_file(big)


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    import os

    path = tmp_path / "secret.json"
    path.write_text("{}")
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):  # root reads anything
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(ConfigError, match=r"secret\.json: cannot be read: Permission denied"):
            Config.from_file(path)
    finally:
        path.chmod(0o600)


def test_py_config_keeps_module_identity(tmp_path: Path) -> None:
    # the enum a .py config imports must be the one model code imports later
    package = tmp_path / "idpkg_issue10"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "types.py").write_text(
        "import enum\nclass Precision(enum.Enum):\n    BF16 = 'bf16'\n    FP32 = 'fp32'\n"
    )
    cfg_path = tmp_path / "train.py"
    cfg_path.write_text("from idpkg_issue10.types import Precision\ntrain = dict(precision=Precision.BF16)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        cfg = Config.from_file(cfg_path)
        from idpkg_issue10.types import Precision  # the user's later import

        assert cfg.train.precision is Precision.BF16
        assert cfg.train.precision == Precision.BF16
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.startswith("idpkg_issue10")]:
            del sys.modules[name]


# ------------------------------------------------------------------ issue 38: sections under another name
# torchtitan calls the section `parallelism`; others write `distributed`, `model_parallel`,
# `parallel_config`. Each held tensor=2, pipeline=2 and the job ran at tensor 1, pipeline 1.
ELSEWHERE = ("parallelism", "distributed", "model_parallel", "parallel_config")


@pytest.mark.parametrize("name", ELSEWHERE)
def test_parallel_keys_under_another_name_are_refused(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config({name: {"tensor": 2, "pipeline": 2}, "model": {"hidden": 64}})
    text = str(info.value)
    assert not isinstance(info.value, ValidationError)
    assert text.startswith(f"config: section {name!r} holds parallel's keys tensor=2, pipeline=2, "), text
    assert "parallelctx reads only from 'parallel'" in text, text
    assert "rename the section to 'parallel'" in text, text
    assert f"user_sections = [{name!r}]" in text, text  # the override, for an entry of the user's own


@pytest.mark.parametrize("name", ELSEWHERE)
def test_a_section_under_another_name_is_refused_from_a_file(tmp_path: Path, name: str) -> None:
    py = tmp_path / "train_cfg.py"
    py.write_text(f"{name} = dict(tensor=2, pipeline=2)\nmodel = dict(hidden=64)\n")
    yaml = tmp_path / "train_cfg.yaml"
    yaml.write_text(f"{name}:\n  tensor: 2\n  pipeline: 2\n")
    for path in (py, yaml):
        with pytest.raises(ConfigError, match=rf"^{path}: config: section '{name}' holds parallel's keys"):
            load_config(path)


def test_dist_keys_elsewhere_and_keys_beside_their_section() -> None:
    with pytest.raises(
        ConfigError,
        match=r"section 'distributed' holds dist's keys backend='gloo', timeout=60.*"
        r"rename the section to 'dist'",
    ):
        Config({"distributed": {"backend": "gloo", "timeout": 60}})
    # keys of both sections: each is named
    with pytest.raises(
        ConfigError,
        match=r"holds parallel's key tensor=2 and dist's key backend='nccl'.*"
        r"move them into 'parallel' and 'dist'",
    ):
        Config({"distributed": {"tensor": 2, "backend": "nccl"}})
    # beside a `parallel` section: the keys move into it
    with pytest.raises(ConfigError, match=r"holds parallel's key pipeline=2.*move it into 'parallel'"):
        Config({"parallel": {"tensor": 2}, "parallelism": {"pipeline": 2}})
    # any name, when the content is mostly parallel's keys
    with pytest.raises(
        ConfigError, match="section 'layout' holds parallel's keys tensor=2, pipeline=4, order="
    ):
        Config({"layout": {"tensor": 2, "pipeline": 4, "order": "tp-pp-dp"}})


@pytest.mark.parametrize(
    ("entry", "meant"),
    [
        ({"paralel": {"tensr": 2}}, "parallel"),  # any mapping under a near miss of parallel
        ({"Parallel": {"tensor": 2}}, "parallel"),
        ({"dsit": {"timout": 60}}, "dist"),  # a key close to dist's
        ({"dist_": {"backend": "gloo"}}, "dist"),
    ],
)
def test_a_misspelt_name_holding_the_sections_content_is_refused(entry: dict, meant: str) -> None:
    name = next(iter(entry))
    with pytest.raises(ConfigError) as info:
        Config(entry)
    text = str(info.value)
    assert text.startswith(
        f"config: top-level section {name!r} is not read by parallelctx; did you mean {meant!r}?"
    )
    assert f"user_sections = [{name!r}]" in text, text


def test_a_list_of_seeds_is_the_users_own(tmp_path: Path) -> None:
    cfg = Config({"seeds": [1, 2, 3]})
    assert cfg.seeds == [1, 2, 3] and cfg.seed == 1024
    assert Config({"seeds": (1, 2), "seed": 7}).seed == 7
    assert Config({"Seeds": {"data": 1, "init": 2}}).Seeds.init == 2
    path = tmp_path / "sweep.py"
    path.write_text("seeds = [1, 2, 3]\nparallel = dict(tensor=1)\n")
    assert load_config(path).seeds == [1, 2, 3]
    # a number under a name this close to seed is still taken for a typo, with the override named
    for entry in ({"Seed": 3}, {"seeds": 3}, {"sed": "42"}):
        name = next(iter(entry))
        with pytest.raises(ConfigError) as info:
            Config(entry)
        text = str(info.value)
        assert f"top-level section {name!r} = {entry[name]!r} is not read by parallelctx" in text, text
        assert "did you mean 'seed'?" in text and f"user_sections = [{name!r}]" in text, text


@pytest.mark.parametrize(
    "entry",
    [
        {"model": {"tensor_dim": 64, "pipeline_chunks": 4, "hidden": 128}},
        {"model": {"tensor": "bf16", "pipeline": "fused"}},  # not sizes: not parallel's content
        {"compile": {"backend": "inductor", "mode": "max-autotune"}},  # torch.compile's backend
        {"loader": {"timeout": 30, "workers": 4}},  # a DataLoader timeout
        {"data": {"path": "/data", "batch": 8}},
        {"vision": {"tensor": 2}},  # one key of parallel's under a name of the user's own
        {"parallelism": {"zero_stage": 1}},  # the name alone is no reason
        {"distributed": {"find_unused_parameters": True}},
        {"dists": {"normal": 0.1}},  # distributions: dist's near miss by name, not by content
        {"dst": "/out"},
        {"Parallel": True},
        {"random_seed": 42},
        {"data_seed": 3},
        # a setup word in the name, but the section's keys are not more than half (issue 38 review)
        {"distributed_sampler": {"shuffle": True, "timeout": 10}},
        {"distributed_eval": {"timeout": 30, "batch": 4}},
        # a near miss of dist, but no key of dist's with a value of its shape
        {"dis": {"lr": 1e-4, "init_method": "xavier"}},
        {"dis": {"time": 3}},
        {"speed": 1.5},  # a float that is not integral is no seed
        # generic names at the top level, and values not of the key's shape
        {"data": 4},
        {"data": {"size": 1000, "path": "/data"}},
        {"timeout": 30},
        {"backend": "inductor"},
        {"init_method": "xavier"},
        {"context": "long"},
        {"order": "by-length"},
        {"reform": True},
        {"tensor_model_parallel_size": None},  # Megatron's "unset"
    ],
)
def test_lookalike_entries_of_the_users_own_are_kept(entry: dict) -> None:
    cfg = Config(entry)
    name = next(iter(entry))
    assert cfg.to_dict()[name] == entry[name]
    assert cfg.parallel.tensor.size == 1 and cfg.dist.backend == "auto" and cfg.seed == 1024


def test_user_sections_keeps_a_lookalike_and_survives_round_trips() -> None:
    import pickle

    data = {
        "parallelism": {"tensor": 2, "pipeline": 2},
        "seeds": 3,
        "user_sections": ["parallelism", "seeds"],
    }
    cfg = Config(data)
    assert cfg.parallelism.tensor == 2 and cfg.seeds == 3
    assert cfg.parallel.tensor.size == 1  # the user's own: parallelctx does not read it
    assert pickle.loads(pickle.dumps(cfg)).to_dict() == cfg.to_dict() == Config(cfg.to_dict()).to_dict()
    # only the names listed are the user's
    with pytest.raises(ConfigError, match="section 'parallelism' holds"):
        Config({**data, "user_sections": ["seeds"]})


@pytest.mark.parametrize(
    ("listed", "match"),
    [
        ("seeds", r"user_sections='seeds' must be a list of top-level names of your own"),
        ([1], r"user_sections lists \[1\], which are not names"),
        (["seed"], r"user_sections lists seed, which parallelctx reads itself"),
    ],
)
def test_user_sections_must_name_entries_of_the_users_own(listed: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Config({"user_sections": listed})


def test_the_keys_looked_for_are_the_sections_keys() -> None:
    from parallelctx.config import DistConfig, ParallelConfig
    from parallelctx.config.sections import DIST_KEYS, PARALLEL_KEYS

    assert set(PARALLEL_KEYS) == set(ParallelConfig.model_fields)
    assert set(DIST_KEYS) == set(DistConfig.model_fields)


def test_launching_with_a_section_under_another_name_is_refused_at_load(tmp_path: Path) -> None:
    """As a user meets it: the training script's launch refuses the config before any group."""
    import parallelctx
    from parallelctx import ParallelMode, gpc

    path = tmp_path / "titan_style.py"
    path.write_text("parallelism = dict(tensor=2, pipeline=2)\nmodel = dict(hidden=64)\n")
    try:
        with pytest.raises(
            ConfigError, match=rf"{path}: config: section 'parallelism' holds parallel's keys"
        ):
            parallelctx.launch_from_env(str(path))
        assert not gpc.is_initialized(ParallelMode.GLOBAL)
    finally:
        if gpc.is_initialized(ParallelMode.GLOBAL):
            gpc.destroy()


def test_a_pooled_test_with_such_a_config_file_fails_at_load(pytester: pytest.Pytester) -> None:
    """The pytest plugin reads the marker's config in the controller: refused before any pool."""
    pytester.makepyfile(cfg_titan="parallelism = dict(tensor=2, pipeline=2)\n")
    pytester.makepyfile(
        test_titan="""
import pytest

@pytest.mark.parallel(world_size=4, config="cfg_titan.py")
def test_layout():
    from parallelctx import gpc
    assert gpc.get_world_size("tensor") == 2
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*cfg_titan.py: config: section 'parallelism' holds parallel's keys tensor=2, *"]
    )


# ------------------------------------------------------------------ issue 38 review: flat keys, other names
@pytest.mark.parametrize(
    ("entry", "section", "fix"),
    [
        (
            {"tensor": 2, "pipeline": 2, "model": {"hidden": 4}},
            "parallel",
            "parallel = dict(tensor=2, pipeline=2)",
        ),
        ({"order": "tp-dp-pp"}, "parallel", "parallel = dict(order='tp-dp-pp')"),
        ({"expert": {"size": 4, "tensor": 1}}, "parallel", "parallel = dict(expert=dict(size=4, tensor=1))"),
        ({"context": 2}, "parallel", "parallel = dict(context=2)"),
        ({"gtp_remat": {"size": 2}}, "parallel", "parallel = dict(gtp_remat=dict(size=2))"),
        ({"reform": "replicate"}, "parallel", "parallel = dict(reform='replicate')"),
        (
            {"data": {"replicate": 2, "shard": 4}},
            "parallel",
            "parallel = dict(data=dict(replicate=2, shard=4))",
        ),
        ({"backend": "nccl"}, "dist", "dist = dict(backend='nccl')"),
        ({"init_method": "tcp://h:29500"}, "dist", "dist = dict(init_method='tcp://h:29500')"),
        ({"hang_report": {"after": 60}}, "dist", "dist = dict(hang_report=dict(after=60))"),
        ({"gloo_lazy_init": True}, "dist", "dist = dict(gloo_lazy_init=True)"),
    ],
)
def test_a_sections_key_at_the_top_level_is_refused(entry: dict, section: str, fix: str) -> None:
    name = next(iter(entry))
    with pytest.raises(ConfigError) as info:
        Config(entry)
    text = str(info.value)
    assert text.startswith(f"config: top-level {name}={entry[name]!r} is a key of the {section!r} section"), (
        text
    )
    assert f"reads only inside {section!r}" in text and f"put it in a {section!r} section: {fix} " in text, (
        text
    )
    assert f"user_sections = [{name!r}]" in text, text
    listed = Config({**entry, "user_sections": list(entry)})  # the override keeps them all
    assert listed[name] == entry[name] and listed.parallel.tensor.size == 1


def test_a_flat_key_from_a_file_and_beside_its_section(tmp_path: Path) -> None:
    path = tmp_path / "flat.py"
    path.write_text("tensor = 2\npipeline = 2\nmodel = dict(hidden=4)\n")
    with pytest.raises(
        ConfigError, match=rf"^{path}: config: top-level tensor=2 .*parallel = dict\(tensor=2, pipeline=2\)"
    ):
        load_config(path)
    # beside the section: moved into it, the section's own keys kept in the fix
    with pytest.raises(
        ConfigError, match=r"move it into the 'parallel' section: parallel = dict\(pipeline=2, tensor=4\)"
    ):
        Config({"tensor": 4, "parallel": {"pipeline": 2}})
    # a .py helper whose value the section uses is kept (tensor = 2; parallel = dict(tensor=tensor))
    path.write_text("tensor = 2\nparallel = dict(tensor=tensor, pipeline=dict(size=2))\npipeline = 2\n")
    cfg = load_config(path)
    assert cfg.parallel.tensor.size == 2 and cfg.tensor == 2 and cfg.pipeline == 2


TITAN_MEGATRON = [
    ("tensor_parallel_degree", "parallel.tensor"),
    ("pipeline_parallel_degree", "parallel.pipeline"),
    ("context_parallel_degree", "parallel.context"),
    ("expert_parallel_degree", "parallel.expert"),
    ("data_parallel_shard_degree", "parallel.data.shard"),
    ("data_parallel_replicate_degree", "parallel.data.replicate"),
    ("tensor_model_parallel_size", "parallel.tensor"),
    ("pipeline_model_parallel_size", "parallel.pipeline"),
    ("context_parallel_size", "parallel.context"),
    ("expert_model_parallel_size", "parallel.expert"),
]


@pytest.mark.parametrize(("key", "path"), TITAN_MEGATRON)
def test_torchtitans_and_megatrons_names_are_refused(key: str, path: str) -> None:
    # in a section of any name, with other keys beside (torchtitan's [parallelism] has many)
    entry = {key: 2, "enable_async_tensor_parallel": True, "schedule": "1F1B", "x": 1}
    for name in ("parallelism", "model_parallel", "megatron"):
        with pytest.raises(ConfigError) as info:
            Config({name: entry})
        text = str(info.value)
        assert f"{key}=2 (parallelctx's {path})" in text and f"{key} -> {path}" in text, text
    # at the top level
    with pytest.raises(
        ConfigError, match=rf"top-level {key}=2 is torchtitan's or Megatron's name for {path}"
    ):
        Config({key: 2})
    # kept when the real section has that value (options handed to Megatron's bridge)
    there = {"tensor": 2, "pipeline": 2, "context": 2, "expert": 2, "data": {"shard": 2, "replicate": 2}}
    assert Config({"parallel": there, "megatron": {key: 2, "num_layers": 4}}).megatron[key] == 2


def test_torchtitans_section_from_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "titan.toml"
    path.write_text("[parallelism]\ntensor_parallel_degree = 2\ndata_parallel_shard_degree = -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert (
        "tensor_parallel_degree -> parallel.tensor, data_parallel_shard_degree -> parallel.data.shard" in text
    )


@pytest.mark.parametrize("value", ["2", 2.0, True, None, [2]])
def test_any_value_of_a_sections_key_counts_under_a_setup_name(value: object) -> None:
    for name in ("parallelism", "model_parallel"):
        with pytest.raises(ConfigError, match=rf"section '{name}' holds parallel's key tensor="):
            Config({name: {"tensor": value}})
    assert Config({"vision": {"tensor": value}}).vision["tensor"] == value  # not under another name


@pytest.mark.parametrize(
    "entry",
    [
        {"model_parallel": {"tensor": 2}},
        {"distributed": {"backend": "nccl", "timeout": 60}},
        {"parallelism": {"tensor": 2, "pipeline": 2}},
        {"parallelism": {"tensor": 2, "zero_stage": 1, "fsdp": True}},  # an axis of its shape: enough
        {"distributed_sampler": {"timeout": 10, "backend": "gloo", "shuffle": True}},  # more than half
    ],
)
def test_a_setup_name_with_mostly_the_sections_keys_is_refused(entry: dict) -> None:
    name = next(iter(entry))
    with pytest.raises(ConfigError, match=rf"^config: section '{name}' holds "):
        Config(entry)


def test_a_yaml_anchor_merged_into_the_section_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "anchor.yaml"
    path.write_text("defaults: &par\n  tensor: 2\n  pipeline: 2\nparallel:\n  <<: *par\n")
    cfg = load_config(path)
    assert cfg.parallel.tensor.size == 2 and cfg.defaults == {"tensor": 2, "pipeline": 2}
    dist = Config({"common": {"backend": "gloo", "timeout": 60}, "dist": {"backend": "gloo", "timeout": 60}})
    assert dist.common["timeout"] == 60
    # a value the section does not have: still refused, naming it
    path.write_text("defaults: &par\n  tensor: 2\n  pipeline: 2\nparallel:\n  <<: *par\n  tensor: 4\n")
    with pytest.raises(ConfigError, match=r"section 'defaults' holds parallel's keys tensor=2, pipeline=2"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"section 'layout' holds parallel's keys tensor=2, pipeline=4"):
        Config({"layout": {"tensor": 2, "pipeline": 4}, "parallel": {"tensor": 2}})


@pytest.mark.parametrize(
    ("entry", "trigger"),
    [
        ({"dsit": {"timout": 60}}, "it holds timout=60, close to dist's key 'timeout'; "),
        ({"dis": {"lr": 1, "init_method": "env://"}}, "it holds dist's key init_method='env://'; "),
        ({"paralel": {"tensr": 2}}, "it holds tensr=2; "),
        ({"Parallel": {"tensor": 2, "pipeline": 4}}, "it holds parallel's keys tensor=2, pipeline=4; "),
    ],
)
def test_a_name_typos_message_says_which_key_triggered_it(entry: dict, trigger: str) -> None:
    name = next(iter(entry))
    with pytest.raises(ConfigError) as info:
        Config(entry)
    text = str(info.value)
    assert f"top-level section {name!r} is not read by parallelctx; did you mean" in text, text
    assert trigger in text, text


def test_an_integral_float_under_a_seed_typo_is_refused() -> None:
    for entry in ({"speed": 3.0}, {"Seed": 3.0}):
        with pytest.raises(ConfigError, match="did you mean 'seed'"):
            Config(entry)
    for value in (1.5, float("nan"), float("inf")):
        assert Config({"speed": value}).to_dict()["speed"] is value
