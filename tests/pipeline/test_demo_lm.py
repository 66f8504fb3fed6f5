"""``make demo-lm``'s pieces: its config rules, the held-out evaluation documents and the claims in its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece as spm

from data_prep import format as fmt
from data_prep.builtin import corpus_files
from data_prep.schema import ConfigError
from pipeline.demos.demo_lm import (
    DemoLMError,
    check_earlier_outputs,
    holdout_files,
    load_demo_lm_config,
    write_eval_documents,
)
from pipeline.demos.demo_lm_report import (
    claims,
    far_recall_table,
    mix_accuracy,
    mix_claims,
    mix_table,
    retrieval_summary,
    write_demo_lm_report,
)

REPO = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    for name in ("demo_lm.yaml", "smoke.yaml"):
        cfg, _ = load_demo_lm_config(REPO / "configs/demo_lm" / name, [])
        assert cfg.models == ["gca", "gca_mix", "gca_random", "baseline", "full"]
    # One model alone: the shipped per-model settings of the others stay harmless.
    cfg, _ = load_demo_lm_config(REPO / "configs/demo_lm/demo_lm.yaml", ["models=[gca_mix]"])
    assert cfg.models == ["gca_mix"] and "full" in cfg.model_overrides


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("models=[gca,transformer]", r"'models' has a wrong value"),
        ("lengths=[512,4096]", r"'lengths' has a wrong value \[512, 4096\]: each must exceed score_len=512"),
        ("holdout=[]", r"'holdout' must name at least one"),
        ("max_length={transformer: 4096}", r"'max_length' names unknown models \['transformer'\]"),
        ("model_overrides={gpt: []}", r"'model_overrides' names unknown models \['gpt'\]"),
        ("mix_eval_models=[gca,gpt]", r"'mix_eval_models' names unknown models \['gpt'\]"),
        ("max_length={full: 1000}", r"'max_length' has a wrong value .*a model would be evaluated at no length"),
        ("score_len=0", r"'lengths' has a wrong value|'score_len' has a wrong value"),
    ],
)
def test_config_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_demo_lm_config(REPO / "configs/demo_lm/demo_lm.yaml", [override])


def test_unknown_package_is_named():
    with pytest.raises(DemoLMError, match=r"\['no_such_package'\] hold no files"):
        holdout_files(["json", "no_such_package"])


def test_evaluation_document_is_the_package_in_path_order(tiny_data, tmp_path):
    root, files = corpus_files("python_stdlib")
    expected = [p for p in files if p.relative_to(root).parts[0] == "json"]
    index = write_eval_documents(["json"], tmp_path, tiny_data / fmt.TOKENIZER_FILENAME, min_tokens=100)
    text = (tmp_path / "json.txt").read_text(encoding="utf-8")
    headers = [line.removeprefix("# file: ") for line in text.splitlines() if line.startswith("# file: json/")]
    assert headers == [p.relative_to(root).as_posix() for p in expected]
    for path in expected:  # every module whole, in the document
        assert path.read_text(encoding="utf-8").rstrip() in text
    sp = spm.SentencePieceProcessor(model_file=str(tiny_data / fmt.TOKENIZER_FILENAME))
    assert index == [{"name": "json", "files": len(expected), "tokens": len(sp.encode(text))}]


def test_a_document_too_short_for_the_longest_context_is_refused(tiny_data, tmp_path):
    with pytest.raises(DemoLMError, match=r"'json' is \d+ tokens long, fewer than the longest context length"):
        write_eval_documents(["json"], tmp_path, tiny_data / fmt.TOKENIZER_FILENAME, min_tokens=10**9)


def _row(model: str, length: int, ppl: float) -> dict:
    return {"model": model, "kind": "context", "length": length, "ppl": ppl, "tokens": 512, "documents": 1}


def test_claims_state_the_numbers_that_decide_them():
    rows = [
        *(_row("gca", n, p) for n, p in ((1024, 9.0), (4096, 8.0), (16384, 8.5))),
        *(_row("baseline", n, p) for n, p in ((1024, 8.8), (4096, 8.7), (16384, 8.4))),
        *(_row("full", n, p) for n, p in ((1024, 7.0), (4096, 35.0))),
    ]
    gca, versus, full = claims(rows, 1024)
    assert gca == (
        "GCA's perplexity falls (or at least does not rise) as context grows (9.00 -> 8.00 -> 8.50): holds: it falls "
        "by 5.6% from 1K to 16K, though it rises 6.2% from 4K to 16K."
    )
    assert versus.endswith("(GCA vs baseline, 4K: 8.00 vs 8.70, 16K: 8.50 vs 8.40): does not hold at 16K.")
    assert full == "Full attention's perplexity past its training length, relative to 1K: 4K: 5.00x."


@pytest.mark.parametrize(
    ("trend", "verdict"),
    [
        ((10.0, 10.05, 10.02), "holds only as 'does not rise': it changes by +0.20% from 1K to 16K"),
        ((10.0, 10.5, 11.0), "does not hold: it rises by 10.0% from 1K to 16K"),
    ],
)
def test_flat_and_rising_perplexity_are_named(trend, verdict):
    rows = [_row("gca", n, p) for n, p in zip((1024, 4096, 16384), trend)]
    assert verdict in claims(rows, 1024)[0]


def test_retrieval_summary_compares_with_random_picks(tmp_path):
    run = tmp_path / "gca"
    run.mkdir()
    (run / "config.yaml").write_text("model: {top_k: 4, chunk_size: 16}\ntrain: {seq_len: 64}\n")
    steps = [{"step": 1, "loss": 3.0, "retrieval_entropy_g0": 1.3, "retrieval_distance_g0": 2.5}]
    steps += [{"event": "eval", "step": 1, "val_loss": 3.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    # 4 chunks: query chunks 1, 2, 3 pick at random (1 + 3) / 2, (2 + 3) / 2, (3 + 3) / 2 back -> mean 2.5
    assert retrieval_summary(tmp_path) == (
        "gca's retriever at its last training step (step 1): weight entropy 1.30 nats over its top-4 (uniform: "
        "ln 4 = 1.39), mean distance 2.5 chunks back (uniformly random picks among the visible chunks of a "
        "64-token sequence: 2.5)."
    )


def test_mix_claims_state_the_numbers_that_decide_them():
    def row(model, n, p, recall=None, random=None):
        extra = {} if recall is None else {"far_recall": recall, "far_recall_random": random, "far_recall_tokens": 40}
        return {**_row(model, n, p), **extra}

    rows = [
        row("gca_mix", 1024, 9.0, 0.30, 0.10),
        row("gca_mix", 16384, 8.9, 0.20, 0.02),
        row("gca_mix", 65536, 9.2, 0.012, 0.01),
        *(row("gca_random", n, p) for n, p in ((1024, 9.5), (16384, 8.8), (65536, 9.5))),
    ]
    falls, versus, recall = mix_claims(rows)
    assert (
        falls
        == "gca_mix's perplexity at 16K and 64K is below its 1K one (9.00; 16K: 8.90, 64K: 9.20): does not hold at 64K."
    )
    assert versus == (
        "gca_mix < gca_random (the random-retriever ablation) at every length (1K: 9.00 vs 9.50, 16K: 8.90 vs 8.80, "
        "64K: 9.20 vs 9.50): does not hold at 16K."
    )
    assert recall.endswith(
        "(at least 1.5x; far recall vs random, 1K: 0.300 vs 0.100, 16K: 0.200 vs 0.020, 64K: 0.012 vs 0.010): "
        "does not hold at 64K."
    )
    table = far_recall_table(rows, ["gca_mix", "gca_random"])
    assert "| gca_mix | 0.300 / 0.100 (40) | 0.200 / 0.020 (40) | 0.012 / 0.010 (40) |" in table
    assert "gca_random" not in table  # no far recall recorded for it here
    with_rule = far_recall_table([{**rows[0], "far_recall_nearest": 0.4}], ["gca_mix"])
    assert "| gca_mix | 0.300 / 0.100 / 0.400 (40) |" in with_rule
    assert mix_claims([row("gca", 1024, 9.0)]) == []  # no gca_mix: nothing to claim


def test_mix_accuracy_is_the_mean_exact_match_per_family_and_length(tmp_path):
    for family, scores in (("vt", [1.0, 0.0, 0.5]), ("single", [1.0, 1.0, 1.0])):
        out = tmp_path / "eval" / "gca_mix" / "mix" / family
        out.mkdir(parents=True)
        rows = [{"length": 1024, "depth": d, "exact_match": e} for d, e in zip((0.0, 0.5, 1.0), scores)]
        rows.append({"length": 4096, "depth": 0.0, "exact_match": 0.0})
        (out / "passkey.json").write_text(json.dumps({"results": rows}))
    accuracy = mix_accuracy(tmp_path, ["gca_mix", "gca"])
    assert accuracy == {"gca_mix": {"single": {1024: 1.0, 4096: 0.0}, "vt": {1024: 0.5, 4096: 0.0}}}
    assert mix_table(accuracy).splitlines()[2:] == ["| single | 1.00 | 0.00 |", "| vt | 0.50 | 0.00 |"]


def test_report_pools_every_model(tmp_path):
    for model, ppl in (("gca", 5.0), ("baseline", 6.0)):
        out = tmp_path / "eval" / model
        out.mkdir(parents=True)
        rows = [
            {"kind": "context", "length": 1024, "ppl": ppl, "nll": 1.0, "tokens": 512, "documents": 2},
            {"kind": "document", "ppl": ppl + 1, "nll": 1.0, "tokens": 9000, "documents": 2},
        ]
        (out / "ppl.json").write_text(json.dumps({"train_seq_len": 1024, "results": rows}))
    markdown = write_demo_lm_report(tmp_path, ["gca", "baseline"], {"train-gca": 10.0})
    assert "| gca | 5.00 | 6.00 |" in markdown and "| baseline | 6.00 | 7.00 |" in markdown
    payload = json.loads((tmp_path / "ppl.json").read_text())
    assert [(r["model"], r["kind"]) for r in payload["results"]] == [
        ("gca", "context"),
        ("gca", "document"),
        ("baseline", "context"),
        ("baseline", "document"),
    ]
    assert (tmp_path / "ppl.png").stat().st_size > 0


def test_outputs_of_another_holdout_are_refused(tiny_data, tmp_path):
    """A corpus prepared (or documents written) for other held-out packages would be skipped as done, and a package
    evaluated now could then be in the training split: both are refused, naming what they were made for."""
    from data_prep.config import load_config
    from data_prep.shard import main as prep

    corpus, data, run_dir = tmp_path / "corpus", tmp_path / "data", tmp_path / "run"
    for package in ("email", "json"):
        (corpus / package).mkdir(parents=True)
        (corpus / package / "module.txt").write_text(f"the grass is green in {package} " * 20)
    settings = [f"input={corpus}", f"output={data}", f"tokenizer.model={tiny_data / fmt.TOKENIZER_FILENAME}"]
    prep(load_config(None, [*settings, 'exclude=["email/*"]', "val_fraction=0", "progress=false"]))
    check_earlier_outputs(["email"], data, run_dir)  # the same holdout: reused
    with pytest.raises(DemoLMError, match=r"prepared with exclude=\['email/\*'\], not for holdout=\['json'\]"):
        check_earlier_outputs(["json"], data, run_dir)
    run_dir.mkdir()
    (run_dir / "eval_docs.json").write_text(json.dumps([{"name": "email", "files": 1, "tokens": 9}]))
    with pytest.raises(DemoLMError, match=r"holdout=\['email'\], not \['email', 'json'\]: set run_dir="):
        check_earlier_outputs(["email", "json"], tmp_path / "fresh", run_dir)
