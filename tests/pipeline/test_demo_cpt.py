"""``make demo-cpt``'s pieces: its config rules, the per-model evaluation plan, the conversions' layout (read by the
converter's own parser), the dense trainer's command line (read by its own parser), the dense trainer's output
(loaded by ``transformers``, accepted by the converter), the dense check against ``transformers`` and the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from data_prep.schema import ConfigError
from pipeline.cli.convert import parse_layout
from pipeline.demos import dense_llama
from pipeline.demos.demo_cpt import (
    DenseSpec,
    check_dense_export,
    dense_command,
    eval_lengths,
    layout_overrides,
    load_demo_cpt_config,
)
from pipeline.demos.demo_cpt_report import passkey_rows, ppl_rows, training_summary, write_demo_cpt_report

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "demo_cpt"


def test_the_shipped_configs_load_and_cap_the_dense_model():
    for name in ("demo_cpt.yaml", "smoke.yaml"):
        load_demo_cpt_config(CONFIGS / name, [])
    cfg, _ = load_demo_cpt_config(CONFIGS / "demo_cpt.yaml", [])
    ppl, slices = eval_lengths("dense", cfg)
    assert ppl == [n for n in cfg.ppl_lengths if n <= cfg.dense_max_length] and ppl
    assert all(n <= cfg.dense_max_length for s in slices for n in s.lengths)
    # 256K and 1M belong to the final model only (stage 1: the recipe has one stage); every GCA model gets 1K..64K
    assert cfg.stage2 is None and cfg.models == ("dense", "converted", "stage1") and cfg.eval_order[0] == "stage1"
    final = [n for s in eval_lengths("stage1", cfg)[1] for n in s.lengths]
    assert max(final) == 1048576 and min(final) == 1024
    assert max(n for s in eval_lengths("converted", cfg)[1] for n in s.lengths) == 65536
    assert eval_lengths("converted", cfg)[0] == cfg.ppl_lengths


@pytest.mark.parametrize(
    "override, message",
    [
        ("ppl_lengths=[256,4096]", r"'ppl_lengths' has a wrong value \[256, 4096\]: each must exceed score_len=256"),
        ("dense_max_length=100", r"'dense_max_length' has a wrong value 100"),
        ("passkey=[{lengths: [1024], models: [gpt]}]", r"'passkey' names unknown models \['gpt'\]"),
        ("passkey=[{lengths: []}]", r"'passkey' needs slices with lengths"),
        ("depths=[1.5]", r"'depths' has a wrong value \[1.5\]"),
        ("holdout=[]", r"'holdout' must name at least one"),
        ("check_tokens=0", r"'check_tokens' has a wrong value 0"),
        ("ruler_tasks=[niah_single_9]", r"'ruler_tasks' or 'ruler_models' has a wrong value: \['niah_single_9'\]"),
        ("ruler_models=[gpt]", r"'ruler_tasks' or 'ruler_models' has a wrong value: \['gpt'\]"),
        ("ruler_models=[stage2]", r"wrong value: \['stage2'\] are not among .* \['dense', 'converted', 'stage1'\]"),
        ("ruler_samples=0", r"'ruler_samples' has a wrong value: 0"),
    ],
)
def test_a_bad_config_value_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_demo_cpt_config(CONFIGS / "demo_cpt.yaml", [override])
    assert "\n" not in str(err.value)


def test_the_conversions_take_the_train_configs_layout(tmp_path):
    from omegaconf import OmegaConf

    train = OmegaConf.load(REPO / "configs/demo_cpt/train.yaml").model
    layout = parse_layout(layout_overrides(REPO / "configs/demo_cpt/train.yaml"))
    assert (layout.n_lower_layers, layout.groups, layout.chunk_size, layout.top_k, layout.window) == (
        train.n_lower_layers,
        list(train.groups),
        train.chunk_size,
        train.top_k,
        train.window,
    )
    assert layout.tokens_see_landmarks is False
    assert parse_layout(layout_overrides(REPO / "configs/demo_cpt/train.yaml", window=4096)).window == 4096
    (tmp_path / "t.yaml").write_text("model: {n_lower_layers: 2, groups: [2]}\n")
    with pytest.raises(ConfigError, match=r"model.n_encoder_layers must be set"):
        layout_overrides(tmp_path / "t.yaml")


def test_the_dense_command_is_read_back_by_the_dense_trainers_parser():
    cfg, _ = load_demo_cpt_config(CONFIGS / "demo_cpt.yaml", [])
    cmd = dense_command(cfg, Path("d"), Path("o"))
    args = dense_llama.parse_args(cmd[3:])
    assert (args.data, args.out, args.seed) == ("d", "o", cfg.seed)
    for name in DenseSpec.__dataclass_fields__:
        assert getattr(args, name) == getattr(cfg.dense, name), name


def test_the_dense_schedule_warms_up_then_decays_to_min_lr():
    args = dense_llama.parse_args(["--data", "d", "--out", "o", "--steps", "10", "--warmup", "2", "--lr", "1.0"])
    args.min_lr = 0.1
    assert [dense_llama.lr_at(s, args) for s in (0, 1)] == [0.5, 1.0]
    assert dense_llama.lr_at(2, args) == pytest.approx(1.0)
    assert dense_llama.lr_at(10, args) == pytest.approx(0.1)
    halfway = 0.1 + 0.45 * (1 + math.cos(math.pi * 0.5))
    assert dense_llama.lr_at(6, args) == pytest.approx(halfway)


def test_the_trained_dense_folder_loads_converts_and_matches_its_dense_export(tiny_data, tmp_path):
    """Two steps on the tiny dataset: the folder is a transformers checkpoint with the dataset's tokenizer, the
    converter accepts it, and the window-spanning export computes its logits (the demo's dense check)."""
    from pipeline.cli.convert import main as convert

    out = tmp_path / "dense"
    flags = ["--d-model", "32", "--ffn-hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1"]
    args = dense_llama.parse_args(
        ["--data", str(tiny_data), "--out", str(out), "--steps", "2", "--seq-len", "32", "--batch", "2", *flags]
    )
    dense_llama.train_dense_llama(args)
    log = json.loads((out / "train_log.json").read_text())
    assert [s["step"] for s in log["steps"]] == [1, 2] and log["tokens"] == 2 * 2 * 32
    assert (out / "tokenizer.model").read_bytes() == (tiny_data / "tokenizer.model").read_bytes()
    assert not (tmp_path / "dense.tmp").exists()
    layout = ["model.n_lower_layers=1", "model.groups=[1]", "model.chunk_size=8", "model.top_k=2"]
    assert convert(["--dense", str(out), "--out", str(tmp_path / "gca"), *layout, "model.window=200"]) == 0
    document = tmp_path / "doc.txt"
    document.write_text("def f(x):\n    return x + 1\n" * 20)
    check = check_dense_export(out, tmp_path / "gca", document, 150)
    assert check["tokens"] == 150 and check["max_abs_logit"] > 0.0
    assert check["max_abs_diff"] < 1e-4
    # a window shorter than the text: the conversion is no longer the dense model, and the check shows it
    assert convert(["--dense", str(out), "--out", str(tmp_path / "short"), *layout, "model.window=16"]) == 0
    assert check_dense_export(out, tmp_path / "short", document, 150)["max_abs_diff"] > 1e-3


def _write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


FETCHED = {"retrieval": {"g0": {"asked_needle": {"hits": 2, "n": 2}}}}
MISSED = {"retrieval": {"g0": {"asked_needle": {"hits": 0, "n": 1}}}}


def test_the_report_pools_passkey_depths_by_samples_and_marks_what_is_missing(tmp_path):
    _write(
        tmp_path / "eval/stage2/passkey_0/passkey.json",
        {
            "results": [
                {"length": 1024, "depth": 0.25, "accuracy": 1.0, "exact_match": 0.5, "n": 2, "seconds": 1.0, **FETCHED},
                {"length": 1024, "depth": 0.75, "accuracy": 0.0, "exact_match": 0.0, "n": 1, "seconds": 2.0, **MISSED},
            ]
        },
    )
    _write(
        tmp_path / "eval/stage2/passkey_1/passkey.json",
        {"results": [{"length": 1048576, "depth": 0.25, "accuracy": 1.0, "exact_match": 1.0, "n": 1}]},
    )
    context = {"kind": "context", "tokens": 512}
    _write(tmp_path / "eval/dense/ppl/ppl.json", {"results": [{**context, "length": 1024, "ppl": 50.0}]})
    _write(
        tmp_path / "eval/stage2/ppl/ppl.json",
        {"results": [{**context, "length": 1024, "ppl": 40.0}, {**context, "length": 65536, "ppl": 41.5}]},
    )
    rows = {(r["model"], r["length"]): r for r in passkey_rows(tmp_path)}
    assert rows[("stage2", 1024)]["accuracy"] == pytest.approx(2 / 3)
    assert rows[("stage2", 1024)]["exact_match"] == pytest.approx(1 / 3)
    assert rows[("stage2", 1024)]["n"] == 3 and rows[("stage2", 1048576)]["n"] == 1
    assert len(ppl_rows(tmp_path)) == 3
    _write(tmp_path / "dense_check.json", {"tokens": 10, "max_abs_diff": 1.5e-6, "max_abs_logit": 9.0})
    markdown = write_demo_cpt_report(tmp_path, {"train-dense": 12.0})
    assert "| dense | 50.00 | — |" in markdown
    assert "| stage2 | 40.00 | 41.50 |" in markdown
    assert "| stage2 | 67% (33%, n=3; fetched 2) | 100% (100%, n=1) |" in markdown  # the 1M row has no record
    assert "1.50e-06" in markdown and "| train-dense | 12 |" in markdown
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["dense_check"]["max_abs_diff"] == 1.5e-6 and len(saved["passkey"]) == 2


def test_the_training_summary_reads_both_trainers_logs(tmp_path):
    steps = [{"step": i, "loss": loss} for i, loss in enumerate([8.0, 7.0, 6.0, 5.0, 4.0, 3.0], start=1)]
    _write(tmp_path / "dense_hf/train_log.json", {"steps": steps, "tokens": 96, "val_loss": 3.5, "seconds": 2.0})
    metrics = [{"event": "start"}, {"step": 1, "loss": 6.0, "retrieval_entropy_g0": 1.38}]
    metrics += [{"event": "eval", "step": 2, "loss": 9.0}, {"step": 2, "loss": 5.0, "retrieval_entropy_g0": 1.2}]
    (tmp_path / "stage1").mkdir()
    (tmp_path / "stage1/metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\n")
    summary = training_summary(tmp_path)
    assert summary["dense"]["final_loss"] == pytest.approx((7 + 6 + 5 + 4 + 3) / 5)
    assert summary["dense"]["val_loss"] == 3.5 and summary["dense"]["first_loss"] == 8.0 and "stage2" not in summary
    assert summary["stage1"] == {"steps": 2, "first_loss": 6.0, "final_loss": 5.5, "retrieval_entropy": 1.2}
