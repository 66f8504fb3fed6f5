"""The one config loader: YAML + ``key=value`` overrides into a dataclass, every problem one line naming it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest
from omegaconf import MISSING, OmegaConf
from omegaconf.resolvers import oc

from data_prep.schema import INTERNAL, ConfigError, load_schema


@dataclass
class Part:
    name: str = "p"
    size: int = 1


@dataclass
class Inner:
    width: int = 4
    rate: float = 0.5
    mode: Literal["fast", "slow"] = "fast"
    label: str | None = None

    def __post_init__(self) -> None:
        if self.width > 100:
            raise ValueError(f"inner.width must be <= 100; got {self.width}")


@dataclass
class Outer:
    out: str = MISSING
    inner: Inner = field(default_factory=Inner)
    inputs: list[str] = field(default_factory=list)
    parts: list[Part] = field(default_factory=list)
    text: str = "hello"
    stamp: dict[str, str] = field(default_factory=dict, metadata=INTERNAL)


@pytest.fixture(autouse=True)
def _stock_env_resolver():
    """The loader installs a tracking ``oc.env`` resolver; later tests get the stock one back."""
    yield
    OmegaConf.register_resolver("oc.env", oc.env, replace=True, annotation_validation="off")


def load(path=None, *overrides: str) -> Outer:
    return load_schema(Outer, path, ["out=o", *overrides], what="test")[0]


def error(path=None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load(path, *overrides)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_yaml_then_overrides_in_order_into_the_typed_schema(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  width: 8\n  rate: 1e-3\ntext: from file\nparts:\n  - name: a\n    size: 2\n")
    cfg = load(path, "inner.width=9", "inner.width=10", "inputs=[a, b]")
    assert cfg == Outer(
        out="o", inner=Inner(width=10, rate=0.001), inputs=["a", "b"], parts=[Part("a", 2)], text="from file"
    )
    assert isinstance(cfg.inner, Inner) and isinstance(cfg.parts[0], Part)


def test_an_empty_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load(path) == Outer(out="o")


def test_a_single_value_of_a_list_field_is_a_one_item_list(monkeypatch):
    monkeypatch.setenv("SCHEMA_TEST_INPUT", "/data/corpus.txt")
    cfg, env_paths = load_schema(Outer, None, ["out=o", "inputs=${oc.env:SCHEMA_TEST_INPUT}"], what="test")
    assert cfg.inputs == ["/data/corpus.txt"]
    assert env_paths == {"inputs.0": "${oc.env:SCHEMA_TEST_INPUT}"}


@pytest.mark.parametrize(
    ("tool", "override", "key", "expected"),
    [
        ("eval", "lengths=1024", "lengths", [1024]),
        ("eval", "ruler_tasks=niah_single_1", "ruler_tasks", ["niah_single_1"]),
        ("train", "model.groups=1", "model.groups", [1]),
        ("train", "eval.extrapolation_lengths=64", "eval.extrapolation_lengths", [64]),
        ("prep", "exclude=a/*", "exclude", ["a/*"]),
    ],
)
def test_every_tools_list_key_takes_one_value_on_the_command_line(tool, override, key, expected):
    """``lengths=1024`` means ``lengths=[1024]`` in every tool's config (it was OmegaConf's "AnyNode is not a
    ListConfig"), checked through each tool's own loader; the override's value is read back from the built config."""
    from data_prep.config import load_config as load_prep
    from pipeline.evaluation.config import load_eval_config
    from pipeline.train.config import load_config as load_train

    if tool == "eval":
        cfg: object = load_eval_config(None, [override])[0]
    elif tool == "train":
        cfg = load_train(None, ["run_dir=r", "data.path=d", override])
    else:
        cfg = load_prep(None, ["output=o", "input=i", "tokenizer.vocab_size=300", override])
    for part in key.split("."):
        cfg = getattr(cfg, part)
    assert cfg == expected


def test_a_list_of_sections_takes_no_single_value():
    assert error(None, "parts=3") == (
        "config key 'parts' has a wrong value (in override 'parts=...'): a list of mappings is expected, like "
        "parts=[{key: value}]"
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "inner.widht=3",
            "unknown config key 'inner.widht'; did you mean 'inner.width'? (in override 'inner.widht=...'; "
            "known keys under 'inner': label, mode, rate, width)",
        ),
        (
            "innr.width=3",
            "unknown config key 'innr'; did you mean 'inner'? (in override 'innr.width=...'; known keys: "
            "inner, inputs, out, parts, text)",
        ),
        ("stamp={a: b}", "unknown config key 'stamp' (in override 'stamp=...'; known keys: inner, inputs, out,"),
        ("zzz=1", "unknown config key 'zzz' (in override 'zzz=...'; known keys: inner, inputs, out, parts, text)"),
        ("parts=[{nme: x}]", "unknown config key 'parts[0].nme'; did you mean 'parts[0].name'?"),
        ("inner={widht: 3}", "unknown config key 'inner.widht'; did you mean 'inner.width'?"),
        ("inner=3", "config key 'inner' must be a mapping of keys (in override 'inner=...'); got 3"),
    ],
)
def test_unknown_keys_at_any_depth_name_the_key_a_near_miss_and_the_known_keys(override, expected):
    assert expected in error(None, override)


def test_an_unknown_key_is_reported_before_its_value_is_parsed():
    assert error(None, "inner.widht= a: b: c").startswith("unknown config key 'inner.widht'")


def test_an_unknown_key_in_the_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  rte: 2\n")
    assert error(path).startswith(f"unknown config key 'inner.rte'; did you mean 'inner.rate'? (in config file {path};")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("inner.width=4x", "config key 'inner.width' has a wrong value (in override 'inner.width=...'): Value '4x'"),
        (
            "inner.mode=medium",
            "config key 'inner.mode' has a wrong value (in override 'inner.mode=...'): "
            "Invalid value 'medium', expected one of ['fast', 'slow']",
        ),
        ("inputs={a: 1}", "config key 'inputs' has a wrong value (in override 'inputs=...'): a list is expected"),
    ],
)
def test_a_wrong_value_names_the_key_the_value_and_where_it_came_from(override, expected):
    message = error(None, override)
    assert message.startswith(expected), message
    assert "quote text" not in message, "the quoting hint is for text fields only"


def test_text_read_as_a_mapping_gets_the_quoting_hint():
    message = error(None, "text={key}")
    assert message.startswith("config key 'text' has a wrong value (in override 'text=...')"), message
    assert "values are read as YAML, so quote text" in message and "'text=\"" in message


def test_an_override_that_is_not_yaml_gets_the_quoting_hint():
    message = error(None, "text= a: {b}: c")
    assert message.startswith("override 'text= a: {b}: c': not a valid value (") and "quote text" in message


@pytest.mark.parametrize("item", ["novalue", "=3"])
def test_an_override_must_be_key_equals_value(item):
    assert error(None, item) == f"override {item!r} is not of the form key=value"


def test_a_missing_required_value_names_the_key():
    with pytest.raises(ConfigError) as caught:
        load_schema(Outer, None, [], what="test")
    assert str(caught.value) == "config key 'out' is required: set it in the test config file or pass out=..."


def test_a_rule_of_the_schema_itself_is_a_config_error():
    assert error(None, "inner.width=101") == "inner.width must be <= 100; got 101"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"- a\n- b\n", "the top level must be a mapping of test keys, not a list; write lines like 'key: value'"),
        (b"42\n", "the top level must be a mapping of test keys, not a single value; write lines like 'key: value'"),
        (
            b"just text\n",
            "the top level must be a mapping of test keys, not a single value; write lines like 'key: value'",
        ),
        (b"inner: [1,\n", "not valid YAML (expected the node content, but found '<stream end>' at line 2, column 1)"),
        (b"\xff\xfe\x00inner", "not UTF-8 text; a config file is YAML"),
    ],
)
def test_a_file_that_is_not_a_mapping_of_keys_is_one_line_naming_it(content, expected, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    assert error(path) == f"config file {path}: {expected}"


def test_a_missing_file_is_named(tmp_path):
    assert (
        error(tmp_path / "no.yaml")
        == f"config file not found: {tmp_path / 'no.yaml'} (expected a YAML file of test keys)"
    )


def test_environment_values_become_paths_and_never_reach_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SCHEMA_TEST_DIR", "/secret-dir-7c1e")
    monkeypatch.setenv("SCHEMA_TEST_WIDTH", "wide-7c1e")
    path = tmp_path / "c.yaml"
    path.write_text("out: ${oc.env:SCHEMA_TEST_DIR}/run\n")
    cfg, env_paths = load_schema(Outer, path, [], what="test")
    assert cfg.out == "/secret-dir-7c1e/run" and env_paths == {"out": "${oc.env:SCHEMA_TEST_DIR}/run"}
    path.write_text("inner:\n  width: ${oc.env:SCHEMA_TEST_WIDTH}\n")
    message = error(path)
    assert message.startswith(f"config key 'inner.width' has a wrong value (in config file {path}): ")
    assert "${oc.env:SCHEMA_TEST_WIDTH}" in message and "7c1e" not in message


def test_secret_shapes_in_a_value_are_redacted():
    token = "hf_" + "a1B2c3D4e5" * 4
    message = error(None, f"inner.width={token}")
    assert token not in message and "<redacted>" in message


def test_an_override_is_named_by_its_key_never_its_value():
    """A value under an unknown key may be a credential no redaction rule recognises; the error names the key only."""
    message = error(None, "inner.api_kee=abcdefgh12345")
    assert message.startswith("unknown config key 'inner.api_kee' (in override 'inner.api_kee=...';"), message
    assert "abcdefgh12345" not in message
