"""The demo report pools per-depth passkey rows into per-length rows correctly and writes every artefact."""

import json
from pathlib import Path

import pytest

from data_prep.redaction import restore_env_interpolations
from data_prep.schema import ConfigError
from pipeline.demo import load_demo_config
from pipeline.demo_report import write_report


def _write(path, results, train_seq_len=512):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"task": path.stem, "train_seq_len": train_seq_len, "results": results}))


def test_pooling_and_artefacts(tmp_path):
    rows = [
        {"length": 1024, "depth": 0.0, "accuracy": 1.0, "exact_match": 0.5, "n": 2},
        {"length": 1024, "depth": 1.0, "accuracy": 0.0, "exact_match": 0.0, "n": 6},
    ]
    _write(tmp_path / "eval/gca/passkey_0/passkey.json", rows)
    _write(
        tmp_path / "eval/gca/passkey_1/passkey.json",
        [{"length": 1048576, "depth": 0.5, "accuracy": 0.5, "exact_match": 0.5, "n": 10}],
    )
    _write(tmp_path / "eval/gca/ppl/ppl.json", [{"length": 1024, "ppl": 12.5, "n": 3}])
    report = write_report(tmp_path, ["gca"], {"train-gca": 10.0, "passkey-gca-0": 5.0})
    merged = json.loads((tmp_path / "passkey.json").read_text())["results"]
    assert merged[0] == {
        "model": "gca",
        "length": 1024,
        "accuracy": 2 / 8,
        "exact_match": 1 / 8,
        "n": 8,
        "seconds": 0.0,
    }
    assert merged[1]["length"] == 1048576 and merged[1]["n"] == 10
    assert "| gca | 25% (12%, n=8) | 50% (50%, n=10) |" in report
    assert "| total | 15 s |" in report
    for name in ("ppl.json", "passkey.png", "ppl.png", "results.md"):
        assert (tmp_path / name).is_file()


def test_bad_override_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="override 'passkey=\\[\\{lengths:\\[1\\]\\}\\]': not a valid value") as err:
        load_demo_config(Path(__file__).resolve().parents[2] / "configs/demo/demo.yaml", ["passkey=[{lengths:[1]}]"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not found"):
        load_demo_config(tmp_path / "missing.yaml", [])


def test_a_list_at_the_top_level_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_text("- models: [gca]\n")
    with pytest.raises(ConfigError, match=f"{path}: the top level must be a mapping of demo keys, not a list"):
        load_demo_config(path, [])


def test_environment_values_stay_out_of_errors_and_the_saved_demo_config(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setenv("DEMO_SENTINEL_DIR", str(tmp_path / "sentinel-7f3a9c"))
    monkeypatch.setenv("DEMO_SENTINEL_SEED", "not-a-number-7f3a9c")
    path = tmp_path / "demo.yaml"
    path.write_text("run_dir: ${oc.env:DEMO_SENTINEL_DIR}\nseed: ${oc.env:DEMO_SENTINEL_SEED}\n")
    with pytest.raises(ConfigError) as err:
        load_demo_config(path, [])
    assert "7f3a9c" not in str(err.value) and "seed" in str(err.value)
    cfg, env_paths = load_demo_config(path, ["seed=3"])
    assert cfg.run_dir == str(tmp_path / "sentinel-7f3a9c") and env_paths == {"run_dir": "${oc.env:DEMO_SENTINEL_DIR}"}
    written = restore_env_interpolations(OmegaConf.to_container(OmegaConf.structured(cfg)), env_paths)
    assert "7f3a9c" not in OmegaConf.to_yaml(OmegaConf.create(written))


def test_curriculum_stages_chain_their_weights(tmp_path, monkeypatch):
    from pipeline import demo

    cfg, _ = load_demo_config(
        Path(__file__).resolve().parents[2] / "configs/demo/demo.yaml",
        [f"run_dir={tmp_path}", "models=[gca,baseline,ablation]"],
    )
    assert [s.name for s in cfg.train_stages] == ["short", "long"]
    calls = []
    monkeypatch.setattr(demo.Stages, "run", lambda self, name, cmd, done, env=None: calls.append((name, cmd)))
    stages = demo.Stages(cfg)
    exports = {model: stages.train(model) for model in cfg.models}
    assert exports["gca"] == tmp_path / "gca" / "long" / "export"
    by_name = dict(calls)
    assert list(by_name) == [f"train-{m}-{s}" for m in cfg.models for s in ("short", "long")]
    short, long_ = by_name["train-gca-short"], by_name["train-gca-long"]
    assert short[short.index("--module") + 1] == "pipeline.cli.train"  # ranks start the trainer by module name
    assert "train.seq_len=64" in short and not any(a.startswith("checkpoint.init_from") for a in short)
    assert f"checkpoint.init_from={tmp_path / 'gca' / 'short' / 'export'}" in long_
    assert "model.arch=swa" in by_name["train-baseline-long"]
    assert "model.retrieval_grad=false" in by_name["train-ablation-short"]
    with pytest.raises(ConfigError, match="config key 'models' has a wrong value: \\['oracle'\\] are not among"):
        demo.run_demo(str(Path(__file__).resolve().parents[2] / "configs/demo/demo.yaml"), ["models=[gca,oracle]"])


def test_cli_reports_a_bad_config_and_missing_data_as_one_line(tmp_path, capsys):
    """A bad config exits 2, missing data exits 1; each is one ``demo: error:`` line and nothing runs."""
    from pipeline.cli.demo import main

    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("demo: error: config file not found:") and err.count("\n") == 1
    demo_yaml = str(Path(__file__).resolve().parents[2] / "configs/demo/demo.yaml")
    assert main(["--config", demo_yaml, f"run_dir={tmp_path / 'run'}", f"data={tmp_path / 'nodata'}"]) == 1
    err = capsys.readouterr().err
    assert err == f"demo: error: {tmp_path / 'nodata'} is not a complete data-prep output; run `make prep` first\n"
    assert not (tmp_path / "run").exists()
