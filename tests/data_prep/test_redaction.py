"""Secret redaction (data_prep/redaction.py): environment values, secret-named variables and secret shapes never
reach text the project writes, while everything else passes through unchanged."""

import logging

import pytest
from omegaconf import OmegaConf

from data_prep import redaction

HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
AWS = "AKIA" + "ABCDEFGHIJKLMNOP"
GH = "ghp_" + "a1b2c3d4e5f6g7h8i9j0k1l2m3n4o5p6q7r8"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"


@pytest.fixture
def fresh(monkeypatch):
    """Track oc.env values from a clean slate; restore the stock resolver afterwards."""
    from omegaconf.resolvers import oc

    monkeypatch.setattr(redaction, "_env_values", {})
    monkeypatch.delenv(redaction.REVEAL_ENV, raising=False)
    redaction.track_env_values()
    yield
    OmegaConf.register_resolver("oc.env", oc.env, replace=True, annotation_validation="off")


def test_env_values_resolved_through_oc_env_are_redacted_in_text(fresh, monkeypatch):
    monkeypatch.setenv("MY_BUCKET", "s3-private-bucket-77")
    cfg = OmegaConf.create({"data": {"path": "${oc.env:MY_BUCKET}/train"}, "n": 3})
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["data"]["path"] == "s3-private-bucket-77/train"  # resolution itself is unchanged
    text = f"cannot open {resolved['data']['path']}: no such file"
    assert redaction.redact(text) == "cannot open ${oc.env:MY_BUCKET}/train: no such file"


def test_short_and_embedded_values_are_left_alone(fresh, monkeypatch):
    monkeypatch.setenv("MODE", "cpu")
    monkeypatch.setenv("WORD", "test")
    OmegaConf.to_container(OmegaConf.create({"a": "${oc.env:MODE}", "b": "${oc.env:WORD}"}), resolve=True)
    assert redaction.redact("device cpu, ran pytest") == "device cpu, ran pytest"
    assert redaction.redact("a test, test.") == "a ${oc.env:WORD}, ${oc.env:WORD}."


def test_long_values_are_found_even_joined_to_other_text(fresh, monkeypatch):
    monkeypatch.setenv("DATA_DIR", "corpus2026")
    OmegaConf.to_container(OmegaConf.create({"a": "${oc.env:DATA_DIR}x"}), resolve=True)
    assert redaction.redact("no file corpus2026x") == "no file ${oc.env:DATA_DIR}x"


def test_show_env_values_reveals_env_values_but_never_secrets(fresh, monkeypatch):
    monkeypatch.setenv("MY_NAME", "visible-run-name")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef-key")
    OmegaConf.to_container(OmegaConf.create({"a": "${oc.env:MY_NAME}"}), resolve=True)
    monkeypatch.setenv(redaction.REVEAL_ENV, "1")
    text = "run visible-run-name key 0123456789abcdef-key " + HF
    assert redaction.redact(text) == "run visible-run-name key <redacted:WANDB_API_KEY> <redacted>"


@pytest.mark.parametrize(
    "secret",
    [
        HF,
        AWS,
        GH,
        JWT,
        "sk-" + "x" * 40,
        "xoxb-123456789012-abcdefghij",
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\nabc\n-----END RSA PRIVATE KEY-----",
    ],
)
def test_known_secret_shapes_are_redacted_without_any_environment(secret):
    out = redaction.redact(f"value=({secret}) end")
    assert secret not in out and out == "value=(<redacted>) end"


def test_url_passwords_are_redacted_and_plain_urls_kept():
    assert redaction.redact("s3://user:pa55word@host/bucket") == "s3://user:<redacted>@host/bucket"
    assert (
        redaction.redact("https://example.org:8443/x and git@github.com:a/b")
        == "https://example.org:8443/x and git@github.com:a/b"
    )


def test_hashes_and_paths_are_not_mistaken_for_secrets():
    text = "sha256 " + "ab" * 32 + " commit " + "c" * 40 + " /tmp/hf_cache/model.safetensors step_12"
    assert redaction.redact(text) == text


def test_config_files_keep_the_interpolation_not_the_value(fresh, monkeypatch):
    monkeypatch.setenv("RUN_ROOT", "/secret/place")
    raw_cfg = OmegaConf.create({"run_dir": "${oc.env:RUN_ROOT}/r1", "lengths": [1, "${oc.env:RUN_ROOT}"], "k": 2})
    env_paths = redaction.raw_env_paths(OmegaConf.to_container(raw_cfg, resolve=False))
    assert env_paths == {"run_dir": "${oc.env:RUN_ROOT}/r1", "lengths.1": "${oc.env:RUN_ROOT}"}
    resolved = OmegaConf.to_container(raw_cfg, resolve=True)
    written = redaction.restore_env_interpolations(resolved, env_paths)
    assert written == {"run_dir": "${oc.env:RUN_ROOT}/r1", "lengths": [1, "${oc.env:RUN_ROOT}"], "k": 2}
    assert resolved["run_dir"] == "/secret/place/r1"  # the input is not modified
    # Re-loading the written file resolves to the same values as the original config.
    assert OmegaConf.to_container(OmegaConf.create(written), resolve=True) == resolved


def test_redact_tree_covers_keys_values_and_nesting(fresh, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "tok-1234567890")
    tree = {"a": ["x tok-1234567890", 3, {"tok-1234567890": None}], "b": (HF,)}
    assert redaction.redact_tree(tree) == {
        "a": ["x <redacted:HF_TOKEN>", 3, {"<redacted:HF_TOKEN>": None}],
        "b": ("<redacted>",),
    }


def test_log_filter_redacts_messages_args_and_tracebacks(fresh, monkeypatch, capsys):
    monkeypatch.setenv("MY_URL", "https://internal.example/abc")
    OmegaConf.to_container(OmegaConf.create({"u": "${oc.env:MY_URL}"}), resolve=True)
    logger = logging.getLogger("redaction-test")
    handler = logging.StreamHandler()
    handler.addFilter(redaction.RedactingFilter())
    logger.addHandler(handler)
    try:
        logger.error("fetch %s failed", "https://internal.example/abc")
        try:
            raise ValueError(f"bad token {HF}")
        except ValueError:
            logger.exception("boom")
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert "internal.example" not in err and HF not in err
    assert "fetch ${oc.env:MY_URL} failed" in err and "ValueError: bad token <redacted>" in err


def test_secret_names():
    assert all(map(redaction.is_secret_name, ["WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "db.password"]))
    assert not any(map(redaction.is_secret_name, ["TOKENIZERS_PARALLELISM", "HOME", "keys_dir"]))


def test_find_secret_names_the_variable_or_the_shape_never_the_value(fresh, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "tok-1234567890")
    monkeypatch.setenv("MY_DIR", "/data/plain-path")
    OmegaConf.to_container(OmegaConf.create({"d": "${oc.env:MY_DIR}"}), resolve=True)
    assert redaction.find_secret("prefix tok-1234567890") == "the value of the environment variable HF_TOKEN"
    assert "credential" in redaction.find_secret(f"x {GH}") and GH not in redaction.find_secret(f"x {GH}")
    assert "credential" in redaction.find_secret("s3://u:pw@host/b")
    assert redaction.find_secret("/data/plain-path/run") is None  # environment-derived, but not a secret
