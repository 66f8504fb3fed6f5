"""Config validation: every bad input fails before anything starts, naming the full key (and a near miss)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.train.config import ConfigError, load_config
from pipeline.train.parallel import build_deepspeed_config

REPO = Path(__file__).resolve().parents[2]
BASE = ["run_dir=/tmp/unused/run", "data.path=/tmp/unused/data"]


def fails(overrides, world_size=1, path=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, BASE + overrides, world_size)
    return str(err.value)


@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("train.max_step=3", "train.max_step", "train.max_steps"),
        ("optim.min_lrr=0.1", "optim.min_lr", "optim.min_lr"),
        ("chekpoint.every=3", "chekpoint", "checkpoint"),
        ("model.d_modle=64", "model.d_modle", "model.d_model"),
    ],
)
def test_unknown_key_names_full_key_and_near_miss(override, key, suggestion):
    msg = fails([override])
    assert f"unknown config key '{key}" in msg
    assert f"did you mean '{suggestion}'" in msg


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  seq_lenn: 128\n")
    msg = fails([], path=path)
    assert "train.seq_lenn" in msg and str(path) in msg and "train.seq_len" in msg


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.global_batch=8x", "train.global_batch"),
        ("optim.lr=fast", "optim.lr"),
        ("parallel.engine=ddp", "parallel.engine"),
        ("logging.wandb=maybe", "logging.wandb"),
    ],
)
def test_wrong_type_names_key(override, key):
    assert f"config key '{key}' has a wrong value" in fails([override])


def test_missing_required_value():
    with pytest.raises(ConfigError, match="config key 'data.path' is required"):
        load_config(None, ["run_dir=/tmp/x"])


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        (
            ["train.global_batch=8", "train.micro_batch=3"],
            1,
            "train.global_batch=8 must be divisible by train.micro_batch x world size = 3 x 1 = 3",
        ),
        (["train.global_batch=8", "train.micro_batch=2"], 3, "2 x 3 = 6"),
        (
            ["train.seq_len=64", "model.chunk_size=16", "model.top_k=5"],
            1,
            "model.top_k=5 is larger than the number of chunks per sequence, "
            "train.seq_len // model.chunk_size = 64 // 16 = 4",
        ),
        (
            ["optim.lr=1e-3", "optim.min_lr=1e-2"],
            1,
            "optim.min_lr must satisfy 0 <= optim.min_lr <= optim.lr; got min_lr=0.01, lr=0.001",
        ),
        (
            ["schedule.warmup_steps=100", "train.max_steps=100"],
            1,
            "schedule.warmup_steps=100 must be < train.max_steps=100",
        ),
        (["parallel.zero_stage=2"], 1, "need parallel.engine=deepspeed; got engine=none, zero_stage=2"),
        (
            ["parallel.engine=deepspeed", "parallel.zero_stage=2", "parallel.offload_params=true"],
            1,
            "parallel.offload_params needs parallel.zero_stage=3; got 2",
        ),
        (["parallel.engine=deepspeed", "parallel.zero_stage=4"], 1, "parallel.zero_stage must be 0, 1, 2 or 3; got 4"),
        (["checkpoint.keep_last=0"], 1, "checkpoint.keep_last must be >= 1; got 0"),
        (["checkpoint.every=-1"], 1, "checkpoint.every must be >= 0; got -1"),
        (["data.needle_mix=1.5"], 1, "data.needle_mix must be in [0, 1]; got 1.5"),
        (
            ["checkpoint.resume=/no/such/ckpt"],
            1,
            "checkpoint.resume must be 'auto', 'none' or an existing checkpoint directory",
        ),
        (["model.d_model=30", "model.n_heads=4"], 1, "model.d_model=30 must be divisible by model.n_heads=4"),
    ],
)
def test_inconsistent_values_state_rule_and_values(overrides, world, expected):
    assert expected in fails(overrides, world)


@pytest.mark.parametrize("arch", ["swa", "full"])
def test_top_k_is_not_checked_for_the_baselines_which_retrieve_nothing(arch):
    short = ["train.seq_len=64", "model.chunk_size=16", "model.top_k=5"]
    cfg = load_config(REPO / "configs/train/debug.yaml", [*short, f"model.arch={arch}"])
    assert (cfg.model.arch, cfg.model.top_k, cfg.train.seq_len) == (arch, 5, 64)


def test_overrides_apply_and_derived_numbers():
    cfg = load_config(REPO / "configs/train/debug.yaml", ["train.max_steps=3", "model.groups=[1,1]"])
    assert cfg.train.max_steps == 3 and cfg.model.groups == [1, 1]
    assert cfg.tokens_per_step == cfg.train.global_batch * cfg.train.seq_len
    assert cfg.grad_accum(1) == cfg.train.global_batch // cfg.train.micro_batch


@pytest.mark.parametrize("name, world", [("debug", 1), ("tiny", 2), ("gca_pg19_16k", 8), ("gca_pg19_16k", 4)])
def test_shipped_configs_load(name, world):
    cfg = load_config(REPO / f"configs/train/{name}.yaml", [], world)
    assert cfg.grad_accum(world) >= 1


def test_paper_config_batch_arithmetic_and_deepspeed_json():
    cfg = load_config(REPO / "configs/train/gca_pg19_16k.yaml", [], 8)
    assert cfg.tokens_per_step == 524_160 and cfg.train.seq_len % cfg.model.chunk_size == 0
    ds = build_deepspeed_config(cfg, 8, bf16=True)
    assert ds["train_batch_size"] == 32 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 1 and ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"]["stage"] == 1 and ds["bf16"] == {"enabled": True}
    cfg3 = load_config(
        REPO / "configs/train/gca_pg19_16k.yaml",
        ["parallel.zero_stage=3", "parallel.offload_optimizer=true", "parallel.offload_params=true"],
        4,
    )
    ds3 = build_deepspeed_config(cfg3, 4, bf16=False)
    assert ds3["gradient_accumulation_steps"] == 2
    assert ds3["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds3["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_cli_rejects_typo_before_creating_anything(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch/pretrain.py"),
            "--config",
            str(REPO / "configs/train/debug.yaml"),
            "--local_rank=0",
            f"run_dir={run_dir}",
            "train.max_stpes=3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "unknown config key 'train.max_stpes'" in proc.stderr and "did you mean 'train.max_steps'" in proc.stderr
    assert not run_dir.exists()


def test_every_tool_reports_a_bad_key_as_the_one_shared_config_error():
    """Prep, training and eval load through one loader: the same error type and wording for the same mistake."""
    from data_prep import schema
    from data_prep.config import load_config as load_prep_config
    from data_prep.errors import PrepError
    from pipeline.evaluation.config import load_eval_config

    assert ConfigError is schema.ConfigError
    loaders = {
        "train": lambda: load_config(None, [*BASE, "seeed=1"]),
        "prep": lambda: load_prep_config(None, ["seeed=1"]),
        "eval": lambda: load_eval_config(None, ["seeed=1"]),
    }
    for name, load in loaders.items():
        with pytest.raises(schema.ConfigError) as caught:
            load()
        assert str(caught.value).startswith("unknown config key 'seeed'"), (name, str(caught.value))
        assert isinstance(caught.value, PrepError) == (name == "prep"), "prep's is also a PrepError, for its CLI"


@pytest.mark.parametrize("world", [3, 16, 32, 48])
def test_batch_error_suggests_settings_that_work_on_that_world_size(world):
    """The paper recipe (global 32, micro 4) on cluster sizes it does not divide: every setting the error
    suggests is accepted on that world size, and the suggested micro batch keeps the global batch of 32."""
    with pytest.raises(ConfigError) as err:
        load_config(str(REPO / "configs/train/gca_pg19_16k.yaml"), [], world)
    suggested = re.findall(r"(train\.(?:micro|global)_batch=\d+) keeps", str(err.value))
    assert suggested, str(err.value)
    for setting in suggested:
        cfg = load_config(str(REPO / "configs/train/gca_pg19_16k.yaml"), [setting], world)
        assert cfg.train.global_batch % (cfg.train.micro_batch * world) == 0
        if setting.startswith("train.micro_batch"):
            assert cfg.train.global_batch == 32
