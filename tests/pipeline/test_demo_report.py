"""The demo report pools per-depth passkey rows into per-length rows correctly and writes every artefact."""

import json
from pathlib import Path

import pytest

from data_prep.redaction import restore_env_interpolations
from data_prep.schema import ConfigError
from pipeline.demos.demo import load_demo_config
from pipeline.demos.demo_report import write_report


def _write(path, results, train_seq_len=512):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"task": path.stem, "train_seq_len": train_seq_len, "results": results}))


def _ppl_rows(ppl):
    context = {"kind": "context", "nll": 1.0, "tokens": 1536, "documents": 3, "seconds": 1.0, "tokens_per_s": 9.0}
    return [
        {**context, "length": 1024, "ppl": ppl},
        {**context, "length": 4096, "ppl": ppl - 1},
        {**context, "kind": "document", "ppl": ppl + 2, "tokens": 12285},
    ]


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
    _write(tmp_path / "eval/gca/ppl/ppl.json", _ppl_rows(12.5))
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


def test_ppl_rows_of_every_model_in_one_table(tmp_path, caplog):
    _write(tmp_path / "eval/gca/ppl/ppl.json", _ppl_rows(12.5))
    _write(tmp_path / "eval/baseline/ppl/ppl.json", _ppl_rows(20.0))
    _write(tmp_path / "eval/ablation/ppl/ppl.json", [{"length": 1024, "ppl": 12.5, "n": 3}])  # the older format
    report = write_report(tmp_path, ["gca", "baseline", "ablation"], {})
    assert "same final 512 tokens of 3 windows" in report
    assert "| model | 1K | 4K | whole windows |" in report
    assert "| gca | 12.50 | 11.50 | 14.50 |" in report and "| baseline | 20.00 | 19.00 | 22.00 |" in report
    assert "| ablation | – | – | – |" in report and "ablation/ppl/ppl.json is of an older format" in caplog.text
    merged = json.loads((tmp_path / "ppl.json").read_text())["results"]
    assert [(r["model"], r["kind"], r.get("length")) for r in merged] == [
        ("gca", "context", 1024),
        ("gca", "context", 4096),
        ("gca", "document", None),
        ("baseline", "context", 1024),
        ("baseline", "context", 4096),
        ("baseline", "document", None),
    ]
    assert (tmp_path / "ppl.png").stat().st_size > 1000


def test_the_ppl_stage_scores_windows_of_the_validation_split(tmp_path, monkeypatch):
    from pipeline.demos import demo

    demo_yaml = Path(__file__).resolve().parents[2] / "configs/demo/demo.yaml"
    cfg, _ = load_demo_config(demo_yaml, [f"run_dir={tmp_path}", "ppl_lengths=[1024,4096]", "ppl_score_len=256"])
    calls = {}
    monkeypatch.setattr(demo.Stages, "run", lambda self, name, cmd, done, env=None: calls.update({name: cmd}))
    demo.Stages(cfg).evaluate("gca", tmp_path / "export")
    cmd = calls["ppl-gca"]
    assert {"lengths=[1024, 4096]", "score_len=256", "ppl_documents=windows"} <= set(cmd)
    with pytest.raises(ConfigError, match="'ppl_score_len' has a wrong value: 1024 must be >= 1 and below the short"):
        load_demo_config(demo_yaml, ["ppl_lengths=[1024,4096]", "ppl_score_len=1024"])


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
    from pipeline.demos import demo

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


def _recorded_demo(tmp_path, monkeypatch, overrides):
    """Run the demo with every stage recorded instead of run; returns {stage name: command}."""
    from pipeline.demos import demo

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "_COMPLETE").write_text("")
    calls = {}
    monkeypatch.setattr(demo.Stages, "run", lambda self, name, cmd, done, env=None: calls.update({name: cmd}))
    demo_yaml = str(Path(__file__).resolve().parents[2] / "configs/demo/demo.yaml")
    demo.run_demo(demo_yaml, [f"run_dir={tmp_path / 'run'}", f"data={data}", *overrides])
    return calls


def test_multihop_part_trains_two_groups_against_one_and_evaluates_two_hops(tmp_path, monkeypatch):
    calls = _recorded_demo(tmp_path, monkeypatch, ["multihop.enabled=true"])
    run = tmp_path / "run"
    hop = {name: cmd for name, cmd in calls.items() if "multihop" in name}
    assert list(hop) == [
        "train-multihop-gca_2groups-single",
        "train-multihop-gca_2groups-hop",
        "train-multihop-gca-single",
        "train-multihop-gca-hop",
        "passkey-multihop-gca_2groups-0",
        "passkey-multihop-gca_2groups-1",
        "passkey-multihop-gca-0",
        "passkey-multihop-gca-1",
    ]
    two, one = hop["train-multihop-gca_2groups-hop"], hop["train-multihop-gca-hop"]
    assert "model.groups=[1,1]" in two and not any(a.startswith("model.groups") for a in one)
    for cmd in (two, one):
        assert {"data.retrieval_mix.families.multihop=1", "data.retrieval_mix.chains=3", "train.seq_len=192"} <= set(
            cmd
        )
        assert {"data.retrieval_mix.families.single=0", "data.retrieval_mix.families.multikey=0"} <= set(cmd)
    single = hop["train-multihop-gca_2groups-single"]
    assert "model.groups=[1,1]" in single and not any("families.multihop" in a for a in single)
    assert f"run_dir={run / 'multihop' / 'gca_2groups' / 'hop'}" in two
    assert f"checkpoint.init_from={run / 'multihop' / 'gca_2groups' / 'single' / 'export'}" in two
    evaluation = hop["passkey-multihop-gca_2groups-1"]
    assert {"variant=multihop", "needles=6", "lengths=[262144, 1048576]", "data=stdlib"} <= set(evaluation)
    assert evaluation[evaluation.index("--checkpoint") + 1] == str(run / "multihop" / "gca_2groups" / "hop" / "export")
    # the main demo's stages are unchanged by the two-hop part
    assert "train-gca-short" in calls and not any("families.multihop" in a for a in calls["train-gca-short"])


def test_longest_adds_the_16m_slice_for_gca_only(tmp_path, monkeypatch):
    calls = _recorded_demo(tmp_path, monkeypatch, ["longest=true", "models=[gca,baseline]"])
    assert {"lengths=[16777216]", "samples=1", "data=builtin"} <= set(calls["passkey-gca-2"])
    assert "data=stdlib" in calls["passkey-gca-1"]
    assert "passkey-baseline-2" not in calls and "passkey-baseline-1" in calls
    (tmp_path / "plain").mkdir()
    plain = _recorded_demo(tmp_path / "plain", monkeypatch, [])
    assert "passkey-gca-2" not in plain and not any("multihop" in name for name in plain)


def test_multihop_section_and_seconds_per_sample_in_the_report(tmp_path):
    _write(
        tmp_path / "eval/gca/passkey_0/passkey.json",
        [{"length": 1024, "depth": 0.5, "accuracy": 1.0, "exact_match": 1.0, "n": 4, "seconds": 10.0}],
    )
    for model, acc in (("gca_2groups", 0.75), ("gca", 0.25)):
        _write(
            tmp_path / f"multihop/eval/{model}/passkey_0/passkey.json",
            [{"length": 4096, "depth": 0.5, "accuracy": acc, "exact_match": acc / 2, "n": 4, "seconds": 2.0}],
        )
    report = write_report(tmp_path, ["gca"], {}, ["gca_2groups", "gca"])
    section = report[report.index("Two-hop retrieval") :]
    assert "| gca_2groups | 75% (38%, n=4) |" in section and "| gca | 25% (12%, n=4) |" in section
    assert "| gca | 2.5 s |" in report  # 10 s over 4 samples
    merged = json.loads((tmp_path / "multihop/passkey.json").read_text())
    assert merged["variant"] == "multihop" and [r["model"] for r in merged["results"]] == ["gca_2groups", "gca"]
    assert (tmp_path / "multihop.png").stat().st_size > 1000
    assert "Two-hop" not in write_report(tmp_path, ["gca"], {})


def test_only_the_two_hop_part_keeps_the_main_demos_results(tmp_path, monkeypatch):
    """``make demo-multihop`` (multihop.only=true) runs no main-demo stage; the main results already on disk
    stay in results.md, and without them the report has no empty main table."""
    run = tmp_path / "run"
    calls = _recorded_demo(tmp_path, monkeypatch, ["multihop.enabled=true", "multihop.only=true"])
    assert calls and all("multihop" in name for name in calls)
    assert "Passkey retrieval" not in (run / "results.md").read_text()
    _write(
        run / "eval/gca/passkey_0/passkey.json",
        [{"length": 1024, "depth": 0.5, "accuracy": 0.5, "exact_match": 0.5, "n": 2, "seconds": 1.0}],
    )
    _recorded_demo(tmp_path, monkeypatch, ["multihop.enabled=true", "multihop.only=true"])
    assert "| gca | 50% (50%, n=2) |" in (run / "results.md").read_text()


def test_the_demo_trains_gca_alone_and_a_baselines_earlier_results_stay_in_the_report(tmp_path, monkeypatch):
    """``make demo`` trains the GCA model only; ``make demo-baseline`` (models=[gca,baseline]) adds the baseline's
    stages; a later ``make demo`` keeps the baseline's rows in results.md."""
    run = tmp_path / "run"
    calls = _recorded_demo(tmp_path, monkeypatch, [])
    assert [name for name in calls if name.startswith("train-")] == ["train-gca-short", "train-gca-long"]
    with_baseline = _recorded_demo(tmp_path, monkeypatch, ["models=[gca,baseline]"])
    assert {"train-baseline-short", "train-baseline-long", "ruler-baseline"} <= set(with_baseline)
    assert "model.arch=swa" in with_baseline["train-baseline-long"]
    for model, acc in (("gca", 1.0), ("baseline", 0.25)):
        _write(
            run / f"eval/{model}/passkey_0/passkey.json",
            [{"length": 1024, "depth": 0.5, "accuracy": acc, "exact_match": acc, "n": 4, "seconds": 1.0}],
        )
    _recorded_demo(tmp_path, monkeypatch, [])
    report = (run / "results.md").read_text()
    assert "| gca | 100% (100%, n=4) |" in report and "| baseline | 25% (25%, n=4) |" in report


def test_hop_retrieval_pooled_per_model_and_group(tmp_path):
    def checks(link, key, other, n):
        return {
            "first_hop_link": {"hits": link, "n": n},
            "second_hop_key": {"hits": key, "n": n},
            "second_hop_distractor_key": {"hits": other, "n": n},
        }

    row = {"depth": 0.5, "accuracy": 0.5, "exact_match": 0.25, "n": 4, "seconds": 2.0}
    for i, (length, g0, g1) in enumerate(
        [(1024, checks(1, 4, 4, 4), checks(3, 4, 2, 4)), (4096, checks(0, 3, 4, 4), checks(1, 2, 2, 4))]
    ):
        _write(
            tmp_path / f"multihop/eval/gca_2groups/passkey_{i}/passkey.json",
            [{**row, "length": length, "retrieval": {"g0": g0, "g1": g1}}],
        )
    _write(tmp_path / "multihop/eval/gca/passkey_0/passkey.json", [{**row, "length": 1024}])
    report = write_report(tmp_path, [], {}, ["gca_2groups", "gca"])
    # pooled over both lengths: g0 1/8 links, 7/8 keys, 8/8 distractor keys; g1 4/8, 6/8, 4/8
    assert "| gca_2groups | g0 | 12% (n=8) | – | 88% (n=8) | 100% (n=8) |" in report  # no distractor-link count
    assert "| gca_2groups | g1 | 50% (n=8) | – | 75% (n=8) | 50% (n=8) |" in report
    assert "| gca | g" not in report  # no retrieval recorded for it: no row


def _main_run_config(run: Path, seed: int = 0) -> None:
    """What the main run's last training stage leaves for ``run_seeds`` to read its seed from."""
    (run / "gca" / "long").mkdir(parents=True)
    (run / "gca" / "long" / "config.yaml").write_text(f"seed: {seed}\n")


def test_seeds_train_the_gca_model_again_and_read_the_same_slices(tmp_path, monkeypatch):
    _main_run_config(tmp_path / "run")
    (tmp_path / "books").mkdir()
    calls = _recorded_demo(tmp_path, monkeypatch, ["seeds=[1,2]", f"prose={tmp_path / 'books'}"])
    run = tmp_path / "run"
    seeds = [name for name in calls if "seeds/" in name]
    assert seeds == [
        "train-seeds/seed1-gca-short",
        "train-seeds/seed1-gca-long",
        "passkey-seeds/seed1-gca-0",
        "passkey-seeds/seed1-gca-1",
        "train-seeds/seed2-gca-short",
        "train-seeds/seed2-gca-long",
        "passkey-seeds/seed2-gca-0",
        "passkey-seeds/seed2-gca-1",
        *[f"passkey-seeds/seed{s}/prose-gca-{i}" for s in (0, 1, 2) for i in (0, 1)],
    ]
    long_ = calls["train-seeds/seed1-gca-long"]
    assert long_[-2:] == ["seed=1", f"checkpoint.init_from={run / 'seeds/seed1/gca/short/export'}"]
    assert f"run_dir={run / 'seeds/seed1/gca/long'}" in long_
    assert (
        "seed=2" in calls["train-seeds/seed2-gca-short"] and "train.seq_len=64" in calls["train-seeds/seed2-gca-short"]
    )
    # the same evaluation samples as the main run's, on the seed's own model
    for i in (0, 1):
        main, other = calls[f"passkey-gca-{i}"], calls[f"passkey-seeds/seed2-gca-{i}"]
        assert main[main.index("--task") :][4:] == other[other.index("--task") :][4:]
        assert other[other.index("--checkpoint") + 1] == str(run / "seeds/seed2/gca/long/export")
    prose = calls["passkey-seeds/seed0/prose-gca-1"]
    assert prose[prose.index("--checkpoint") + 1] == str(run / "gca/long/export")  # the main run's model
    assert {"lengths=[1048576]", "samples=2", f"data={tmp_path / 'books'}"} <= set(prose)
    assert prose[prose.index("--out") + 1] == str(run / "seeds/seed0/prose/eval/gca/passkey_1")
    assert not any("baseline" in name and "seeds" in name for name in calls)


def test_seeds_without_prose_and_the_main_seed_listed_again(tmp_path, monkeypatch):
    _main_run_config(tmp_path / "run", seed=7)
    calls = _recorded_demo(tmp_path, monkeypatch, ["seeds=[7,3]"])
    assert [name for name in calls if "seeds/" in name] == [
        "train-seeds/seed3-gca-short",
        "train-seeds/seed3-gca-long",
        "passkey-seeds/seed3-gca-0",
        "passkey-seeds/seed3-gca-1",
    ]


@pytest.mark.parametrize(
    "overrides,error",
    [
        (["seeds=[1,1]"], "config key 'seeds' has a wrong value: [1, 1] repeats a seed"),
        (["seeds=[1]", "models=[baseline]"], "config key 'seeds' needs the gca model among models=['baseline']"),
        (["prose=/books", "models=[baseline]"], "config key 'prose' needs the gca model"),
    ],
)
def test_bad_seed_settings_are_one_line(tmp_path, overrides, error):
    with pytest.raises(ConfigError) as err:
        load_demo_config(Path(__file__).resolve().parents[2] / "configs/demo/demo.yaml", overrides)
    assert error in str(err.value) and "\n" not in str(err.value)


def test_the_spread_over_seeds_in_the_report(tmp_path):
    def passkey(where: Path, i: int, length: int, accuracy: float, exact: float, n: int) -> None:
        row = {"length": length, "depth": 0.5, "accuracy": accuracy, "exact_match": exact, "n": n}
        _write(where / "eval" / "gca" / f"passkey_{i}" / "passkey.json", [row], train_seq_len=1024)

    runs = {
        0: (tmp_path, tmp_path / "seeds/seed0/prose"),
        1: (tmp_path / "seeds/seed1", tmp_path / "seeds/seed1/prose"),
    }
    passkey(tmp_path, 0, 1024, 1.0, 1.0, 50)
    passkey(tmp_path, 1, 1048576, 0.8, 0.7, 10)
    passkey(runs[1][0], 0, 1024, 0.96, 0.9, 50)
    passkey(runs[1][0], 1, 1048576, 1.0, 1.0, 10)
    passkey(runs[0][1], 0, 65536, 1.0, 1.0, 50)
    passkey(runs[1][1], 0, 65536, 0.9, 0.8, 50)
    report = write_report(tmp_path, ["gca"], {}, seed_runs=runs)
    assert "| 0 | main | 100% (100%) | – | 80% (70%) |" in report
    assert "| 1 | main | 96% (90%) | – | 100% (100%) |" in report
    assert "| min-max over 2 | main | 96-100% (90-100%) | – | 80-100% (70-100%) |" in report
    assert "| min-max over 2 | prose | – | 90-100% (80-100%) | – |" in report
    rows = json.loads((tmp_path / "seeds.json").read_text())["results"]
    assert {(r["seed"], r["haystack"], r["length"], r["n"]) for r in rows} == {
        (0, "main", 1024, 50),
        (0, "main", 1048576, 10),
        (1, "main", 1024, 50),
        (1, "main", 1048576, 10),
        (0, "prose", 65536, 50),
        (1, "prose", 65536, 50),
    }
    assert "gca" in json.loads((tmp_path / "passkey.json").read_text())["results"][0]["model"]
    runs[1] = (runs[1][0], tmp_path / "no-prose")
    report = write_report(tmp_path, ["gca"], {}, seed_runs=runs)
    assert "| min-max over 1 | prose | – | 100% (100%) | – |" in report


def test_how_often_the_needle_was_fetched_is_pooled_over_depths(tmp_path):
    def row(depth, hits, n):
        return {
            "length": 4096,
            "depth": depth,
            "accuracy": 0.5,
            "exact_match": 0.5,
            "n": n,
            "retrieval": {"g0": {"asked_needle": {"hits": hits, "n": n}}},
        }

    _write(tmp_path / "eval/gca/passkey_0/passkey.json", [row(0.0, 3, 4), row(1.0, 1, 4)])
    _write(tmp_path / "eval/baseline/passkey_0/passkey.json", [{**row(0.5, 0, 4), "retrieval": {}}])
    report = write_report(tmp_path, ["gca", "baseline"], {})
    assert json.loads((tmp_path / "passkey.json").read_text())["results"][0]["needle_fetched"] == 4 / 8
    assert "| gca | 50% |" in report and "| baseline | –" not in report.split("held the asked needle")[1]


def test_a_missing_prose_folder_is_one_line_before_any_stage(tmp_path, monkeypatch):
    from pipeline.demos import demo

    with pytest.raises(demo.DemoError, match=r"prose=.*/no-books: no such file or folder") as err:
        _recorded_demo(tmp_path, monkeypatch, [f"prose={tmp_path / 'no-books'}"])
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "gca").exists()


def test_ruler_slices_and_seed_ruler_run_after_the_main_ruler_stage(tmp_path, monkeypatch):
    _main_run_config(tmp_path / "run")
    slices = "ruler_slices=[{lengths: [1048576], samples: 4, tasks: [niah_single_1, niah_multivalue]}]"
    calls = _recorded_demo(tmp_path, monkeypatch, [slices, "seeds=[1]", "seed_ruler=true"])
    run = tmp_path / "run"
    ruler = [name for name in calls if name.startswith("ruler")]
    assert ruler == ["ruler-gca", "ruler-gca-0", "ruler-seeds/seed1-gca", "ruler-seeds/seed1-gca-0"]
    long_ = calls["ruler-gca-0"]
    assert {"lengths=[1048576]", "samples=4", "ruler_tasks=[niah_single_1,niah_multivalue]"} <= set(long_)
    assert long_[long_.index("--out") + 1] == str(run / "eval/gca/ruler_0")
    seed = calls["ruler-seeds/seed1-gca"]
    assert seed[seed.index("--checkpoint") + 1] == str(run / "seeds/seed1/gca/long/export")
    assert seed[seed.index("--task") :][4:] == calls["ruler-gca"][calls["ruler-gca"].index("--task") :][4:]
    _main_run_config(tmp_path / "plain" / "run")
    plain = _recorded_demo(tmp_path / "plain", monkeypatch, ["seeds=[1]"])
    assert [name for name in plain if name.startswith("ruler")] == ["ruler-gca"]  # seeds read the passkey only


@pytest.mark.parametrize(
    "overrides,error",
    [
        (["ruler_slices=[{lengths: [4096], samples: 2, tasks: [niah_x]}]"], "'ruler_slices[0].tasks' has a wrong"),
        (["ruler_slices=[{lengths: [], samples: 2}]"], "'ruler_slices[0]' has a wrong value: lengths=[]"),
        (["ruler_slices=[{lengths: [4096], samples: 0}]"], "samples=0 >= 1"),
        (["seed_ruler=true", "ruler_lengths=[]"], "'seed_ruler' needs a RULER stage"),
    ],
)
def test_bad_ruler_slices_are_one_line(overrides, error):
    with pytest.raises(ConfigError) as err:
        load_demo_config(Path(__file__).resolve().parents[2] / "configs/demo/demo.yaml", overrides)
    assert error in str(err.value) and "\n" not in str(err.value)


def test_every_ruler_run_joins_the_report_and_the_spread_over_seeds(tmp_path):
    def ruler(where: Path, folder: str, task: str, length: int, score: float, n: int) -> None:
        row = {"task": task, "family": "single", "held_out": False, "length": length, "metric": "string_match_all"}
        row |= {"string_match_all": score, "string_match_part": score, "score": score, "n": n, "seconds": 1.0}
        _write(where / "eval" / "gca" / folder / "ruler.json", [row])

    runs = {0: (tmp_path, tmp_path / "p0"), 1: (tmp_path / "seeds/seed1", tmp_path / "p1")}
    ruler(tmp_path, "ruler", "niah_single_1", 4096, 1.0, 10)
    ruler(tmp_path, "ruler_0", "niah_single_1", 1048576, 0.75, 4)
    ruler(runs[1][0], "ruler", "niah_single_1", 4096, 0.8, 10)
    ruler(runs[1][0], "ruler_0", "niah_single_1", 1048576, 1.0, 4)
    ruler(tmp_path, "ruler_old", "niah_single_1", 2048, 0.0, 1)  # not a folder the demo writes: left out
    report = write_report(tmp_path, ["gca"], {}, seed_runs=runs)
    merged = json.loads((tmp_path / "ruler.json").read_text())["results"]
    assert [(r["length"], r["n"]) for r in merged] == [(4096, 10), (1048576, 4)]
    assert "| niah_single_1 | 4K | 100 (10) | 80 (10) | 80-100% |" in report
    assert "| niah_single_1 | 1M | 75 (4) | 100 (4) | 75-100% |" in report
    assert len(json.loads((tmp_path / "seeds.json").read_text())["ruler"]) == 4
    assert "across training seeds (`seed_ruler`)" not in write_report(tmp_path, ["gca"], {})
