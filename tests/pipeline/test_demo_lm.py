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
from pipeline.demos.demo_lm_report import claims, retrieval_summary, write_demo_lm_report

REPO = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    for name in ("demo_lm.yaml", "smoke.yaml"):
        cfg, _ = load_demo_lm_config(REPO / "configs/demo_lm" / name, [])
        assert cfg.models == ["gca", "baseline", "full"]


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("models=[gca,transformer]", r"'models' has a wrong value"),
        ("lengths=[512,4096]", r"'lengths' has a wrong value \[512, 4096\]: each must exceed score_len=512"),
        ("holdout=[]", r"'holdout' must name at least one"),
        ("max_length={transformer: 4096}", r"'max_length' names unknown models \['transformer'\]"),
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
        "GCA's retriever at its last training step (step 1): weight entropy 1.30 nats over its top-4 (uniform: "
        "ln 4 = 1.39), mean distance 2.5 chunks back (uniformly random picks among the visible chunks of a "
        "64-token sequence: 2.5)."
    )


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
