"""``make demo-lm-gpu``: its refusals (one line, exit 2, nothing written), the held-out draw and the unpacking, the
claims against hand-made numbers, and (``gpucheck`` + ``slow``) the CPU dry run of every stage on a tiny book set
made here, its JSON checked against the eval outputs and trainer metrics it summarises and its training shards
against the held-out books."""

from __future__ import annotations

import io
import json
import math
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from pipeline.cli.demo_lm_gpu import main
from pipeline.demos.books import Book, BooksError, choose_holdout, scan, unpack
from pipeline.demos.demo_lm_gpu_report import summarize

ROOT = Path(__file__).resolve().parents[2]
WORDS = (
    "the of and to a in that was he it his for with as had you not be her on at by which have or from this but all "
    "she they were my are me one their so an said them we who would been will no when there if more out up into do"
).split()


def marker(book_id: int) -> str:
    """A string only book ``book_id`` holds: what the leak check looks for in the training shards."""
    return f"Zq{book_id:05d}xw"


def book_bytes(book_id: int, size: int, rng: random.Random) -> bytes:
    """About ``size`` bytes of CRLF text: the book's marker, then lines of words, some lines repeated far apart (so
    far recall has tokens to measure)."""
    phrases = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(20)]
    lines = [f"Book {marker(book_id)} begins.\r\n"]
    while sum(map(len, lines)) < size:
        words = rng.choice(phrases) if rng.random() < 0.3 else " ".join(rng.choice(WORDS) for _ in range(12))
        lines.append(words + ".\r\n")
    return "".join(lines).encode()


SIZES = {10001: 14_000, 10002: 1_200, 10003: 2_600, 10004: 2_600, 10005: 2_600, 10006: 2_600, 10007: 1_200}
SIZES.update({10008 + i: 1_900 for i in range(4)})
"""One long book (> 2K tokens of the dry run's 320-piece tokenizer, at ~1.8 bytes a token), four of 1K-2K tokens
(the dry run's holdout_min_bytes is 2,000), short ones."""


def make_books(folder: Path, sizes: dict[int, int] = SIZES, shards: int = 2) -> dict[int, bytes]:
    """Shards ``gutenberg-<nn>.tar.xz`` of ``<id>.txt`` books, dealt round-robin; returns each book's bytes."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    texts = {i: book_bytes(i, size, rng) for i, size in sorted(sizes.items())}
    for shard in range(shards):
        with tarfile.open(folder / f"gutenberg-{shard:02d}.tar.xz", "w:xz") as tar:
            for i in sorted(texts)[shard::shards]:
                info = tarfile.TarInfo(f"{i}.txt")
                info.size = len(texts[i])
                tar.addfile(info, io.BytesIO(texts[i]))
    return texts


def _refused(capsys, argv: list[str], *expect: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("demo-lm-gpu: error: "), err
    for text in expect:
        assert text in err, err


def test_missing_books_folder_is_refused(tmp_path, capsys):
    _refused(capsys, ["--cpu", "--books", str(tmp_path / "nope"), "--out", str(tmp_path / "out")], "nope", "not a dir")
    assert not (tmp_path / "out").exists()


def test_folder_without_shards_is_refused(tmp_path, capsys):
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "10001.txt").write_text("loose text, not a shard")
    _refused(capsys, ["--cpu", "--books", str(tmp_path / "books"), "--out", str(tmp_path / "out")], "gutenberg-*")
    assert not (tmp_path / "out").exists()


def test_truncated_shard_is_refused_before_any_work(tmp_path, capsys):
    make_books(tmp_path / "books")
    shard = tmp_path / "books" / "gutenberg-01.tar.xz"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    argv = ["--cpu", "--books", str(tmp_path / "books"), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")]
    _refused(capsys, argv, "gutenberg-01.tar.xz", "not a readable tar.xz")
    assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()


def test_member_that_is_not_a_book_is_refused(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    with tarfile.open(folder / "gutenberg-00.tar.xz", "w:xz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(BooksError, match=r"'\.\./escape\.txt' is not a regular <id>\.txt file"):
        scan(folder)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_no_cuda_without_the_cpu_flag_is_refused(tmp_path, capsys):
    make_books(tmp_path / "books")
    _refused(capsys, ["--books", str(tmp_path / "books"), "--out", str(tmp_path / "out")], "no CUDA", "--cpu")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("override", "expect"),
    [
        ("models=[gca,full]", "models"),
        ("holdout=50", "holdout=50: only"),
        ("boxes={train: 0}", "boxes"),
        ("score_len=4096", "score_len"),
        ("no_such_key=1", "no_such_key"),
    ],
)
def test_bad_config_is_refused(tmp_path, capsys, override, expect):
    make_books(tmp_path / "books")
    argv = ["--cpu", "--books", str(tmp_path / "books"), "--out", str(tmp_path / "out"), override]
    _refused(capsys, argv, expect)
    assert not (tmp_path / "out").exists()


def test_holdout_is_seeded_eligible_and_disjoint(tmp_path):
    make_books(tmp_path / "books")
    books = scan(tmp_path / "books")
    assert {i: b.bytes for i, b in books.items()} == {i: len(t) for i, t in make_books(tmp_path / "again").items()}
    first = choose_holdout(books, 2, 2_000, 1, 10_000, seed=0)
    reordered = dict(sorted(books.items(), reverse=True))  # the draw depends on ids, not on the order found
    assert choose_holdout(reordered, 2, 2_000, 1, 10_000, seed=0) == first
    assert first["long_books"] == [10001] and 10001 not in first["books"]
    assert all(books[i].bytes >= 2_000 for i in first["books"])
    draws = {tuple(choose_holdout(books, 2, 2_000, 1, 10_000, seed=s)["books"]) for s in range(8)}
    assert len(draws) > 1  # the seed does choose
    with pytest.raises(BooksError, match="holdout_long=3: only 1 books hold >= 10000 bytes"):
        choose_holdout(books, 1, 2_000, 3, 10_000, seed=0)
    with pytest.raises(BooksError, match="leaves none to train on"):
        choose_holdout({i: Book(i, "s", 9) for i in (1, 2)}, 1, 1, 1, 1, seed=0)


def test_unpack_separates_and_normalises(tmp_path):
    texts = make_books(tmp_path / "books", {1: 40, 2: 40, 3: 40}, shards=1)
    with tarfile.open(tmp_path / "books" / "gutenberg-01.tar.xz", "w:xz") as tar:  # a stray byte, as a few books have
        info = tarfile.TarInfo("4.txt")
        info.size = 7
        tar.addfile(info, io.BytesIO(b"ab\xffc\r\nd"))
    counts = unpack(tmp_path / "books", {2, 4}, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "train").iterdir()) == ["1.txt", "3.txt"]
    assert sorted(p.name for p in (tmp_path / "out" / "heldout").iterdir()) == ["2.txt", "4.txt"]
    assert (tmp_path / "out" / "heldout" / "4.txt").read_text() == "ab\ufffdc\nd"
    assert (tmp_path / "out" / "train" / "1.txt").read_bytes() == texts[1].replace(b"\r\n", b"\n")
    assert counts == json.loads((tmp_path / "out" / "index.json").read_text())
    assert counts["heldout"] == {
        "books": 2,
        "bytes": len(texts[2].replace(b"\r\n", b"\n")) + len("ab\ufffdc\nd".encode()),
    }
    with pytest.raises(BooksError, match=r"held-out books \[9\] are in no shard"):
        unpack(tmp_path / "books", {9}, tmp_path / "out2")


def _ppl_rows(table: dict[int, float], recall: dict[int, tuple] | None = None) -> dict:
    rows = []
    for n, ppl in table.items():
        row = {"kind": "context", "length": n, "ppl": ppl, "tokens": 1024, "documents": 2}
        if recall:
            r, uniform, recency = recall[n]
            row.update(far_recall=r, far_recall_random=uniform, far_recall_nearest=recency, far_recall_tokens=50)
        rows.append(row)
    return {"status": "ok", "numbers": {"rows": rows, "seconds": 1.0, "train_seq_len": 16380}}


def test_claims_are_judged_from_the_numbers():
    lengths = [1024, 4096, 16384, 65536]
    results = {
        "ppl-gca": _ppl_rows(
            dict(zip(lengths, [20.0, 19.0, 18.5, 19.9])),
            dict(zip(lengths, [(0.3, 0.2, 0.4), (0.3, 0.1, 0.2), (0.2, 0.05, 0.25), (0.2, 0.01, 0.1)])),
        ),
        "ppl-gca_random": _ppl_rows(dict(zip(lengths, [20.5, 19.5, 18.5, 20.5]))),
        "ppl-swa": _ppl_rows(dict(zip(lengths, [19.0, 19.0, 19.0, 19.0]))),
        "train-swa": {"status": "timeout", "seconds": 120.0},
    }
    summary = summarize(results, {"models": ["gca", "gca_random", "swa"]})
    verdicts = {c["claim"]: c["verdict"] for c in summary["claims"]}
    # 16K and 64K are past 16380; 18.5 < 20 and 19.9 < 20.
    assert verdicts["1"] == "holds"
    assert verdicts["2"] == "fails at 16K"  # equal is not below
    assert verdicts["3"] == "fails at 64K"  # 19.9 > 19.0; 1K (20 vs 19) is not judged
    assert verdicts["4"] == "fails at 16K"  # 0.2 <= 0.25; 1K (0.3 vs 0.4) is not judged
    assert summary["claims"][3]["numbers"][4096] == {"far_recall": 0.3, "uniform": 0.1, "recency": 0.2, "tokens": 50}
    assert summary["stages_not_ok"] == ["train-swa"]
    untested = summarize({"ppl-gca": results["ppl-gca"]}, {"models": ["gca", "gca_random", "swa"]})["claims"]
    assert untested[1]["verdict"] == "untested: ppl-gca_random (not run yet) did not finish ok"
    assert untested[0]["verdict"] == "holds"


@pytest.mark.gpucheck
@pytest.mark.slow
def test_cpu_dry_run_every_stage_and_its_numbers(tmp_path):
    """Every stage at tiny shapes (~5 min on 2 cores), then each number of the JSON against the file it came from."""
    texts = make_books(tmp_path / "books")
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "launch/demo_lm_gpu.py", "--cpu", "--books", str(tmp_path / "books")]
    cmd += ["--out", str(out), "--work", str(work)]
    done = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1500
    )
    report = json.loads((out / "demo-lm-gpu.json").read_text())
    assert done.returncode == 0, (done.stderr[-2000:], report["summary"]["stages_not_ok"])
    summary, holdout = report["summary"], report["experiment"]["holdout"]
    models = ["gca", "gca_random", "swa"]
    assert len(report["stages"]) == 2 + 6 * len(models) - len(models)
    assert all(stage["status"] == "ok" for stage in report["stages"].values())

    # Held out before training, recorded, and never in a training or validation shard.
    held_out = {*holdout["books"], *holdout["long_books"]}
    assert sorted(p.name for p in (work / "books" / "heldout").iterdir()) == sorted(f"{i}.txt" for i in held_out)
    from pipeline.evaluation.haystack import TokenSource
    from pipeline.evaluation.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(work / "data" / "tokenizer.model")
    trained = "".join(
        tokenizer.decode(doc.tolist())
        for split in ("train", "val")
        for doc in TokenSource(str(work / "data" / split), tokenizer).documents(0)
    )
    assert all(marker(i) not in trained for i in held_out)
    assert all(marker(i) in trained for i in set(texts) - held_out)  # the check can see a book that is there

    # Every table equals the outputs it summarises.
    manifest = json.loads((work / "data" / "manifest.json").read_text())
    for model in models:
        rows = [json.loads(line) for line in (work / "runs" / model / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "loss" in r and "step" in r]
        training = summary["training"][model]
        assert training["tokens_trained"] == steps[-1]["step"] * steps[0]["tokens"] == 3 * 512
        assert training["loss_last"] == steps[-1]["loss"] and training["steps"] == len(steps)
        assert math.isclose(training["epochs"], training["tokens_trained"] / manifest["splits"]["train"]["tokens"])
        for kind in ("ppl", "ppl_long"):
            result = json.loads((work / "eval" / model / kind / "ppl.json").read_text())
            assert summary[kind][model] == {str(r["length"]): r["ppl"] for r in result["results"]}
            if model != "swa" and kind == "ppl":
                assert summary["far_recall"][model] == {
                    str(r["length"]): {
                        "far_recall": r["far_recall"],
                        "uniform": r["far_recall_random"],
                        "recency": r["far_recall_nearest"],
                        "tokens": r["far_recall_tokens"],
                    }
                    for r in result["results"]
                    if r["far_recall"] is not None
                }
        passkey = json.loads((work / "eval" / model / "passkey" / "passkey.json").read_text())["results"]
        for length, value in summary["passkey_exact_match"][model].items():
            matches = [r["exact_match"] for r in passkey if r["length"] == int(length)]
            assert value == sum(matches) / len(matches)
    assert "swa" not in summary["far_recall"]
    # 1K-context scoring uses every held-out book; 2K only the long one.
    assert summary["scored"] == {"ppl": {"tokens": 3 * 64, "documents": 3}, "ppl_long": {"tokens": 64, "documents": 1}}
    assert [c["claim"] for c in summary["claims"]] == ["1", "2", "3", "4"]
    assert all(not c["verdict"].startswith("untested") for c in summary["claims"])
    markdown = (out / "results.md").read_text()
    assert "## Claims" in markdown and f"{summary['ppl']['gca']['1024']:.2f}" in markdown
    assert (out / "ppl.png").stat().st_size > 0


def test_gpu_plan_keeps_its_budget_arithmetic(tmp_path):
    """The GPU config as planned in docs/demo-lm.md: the core stages first, their expected seconds inside the budget,
    4,586,400 training tokens a model, each model's own override, and eval keys the eval itself accepts."""
    from omegaconf import OmegaConf

    from pipeline.evaluation.config import load_eval_config
    from pipeline.gpucheck.demo_lm_gpu import build_stages, load_config
    from pipeline.gpucheck.stages import Plan

    cfg = load_config(ROOT / "configs/demo_lm_gpu/gpu.yaml", [])
    stages = build_stages(Plan(cuda=True, work=tmp_path, python="python3"), cfg, tmp_path / "books")
    names = [s.name for s in stages]
    core = ["books", "prep"] + [f"{kind}-{m}" for m in ("gca", "gca_random", "swa") for kind in ("train", "ppl")]
    assert names[: len(core)] == core and len(names) == len(core) + 9
    assert sum(s.expect_s for s in stages) == 10 + 40 + 3 * (96 + 25) <= cfg.budget_s
    assert all(s.expect_s <= s.box_s for s in stages)
    train = OmegaConf.load(ROOT / cfg.train_config).train
    assert train.max_steps * train.global_batch * train.seq_len == 4_586_400
    overrides = {s.name: [a for a in s.cmd if a.startswith("model.")] for s in stages if s.name.startswith("train-")}
    expected = {"train-gca": [], "train-gca_random": ["model.retrieval=random"], "train-swa": ["model.arch=swa"]}
    assert overrides == expected
    for stage in stages[2:]:
        if stage.name.startswith("train-"):
            continue
        task = stage.cmd[stage.cmd.index("--task") + 1]
        keys = stage.cmd[stage.cmd.index("--out") + 2 :]
        assert {"device=cuda", "offload_mb=-1"} <= set(keys)
        checked = [k for k in keys if not k.startswith("device=")]  # this machine has no CUDA device to accept
        eval_cfg, _ = load_eval_config(None, checked, task=task)
        assert max(eval_cfg.lengths) == (262144 if not stage.name.startswith("ppl-") else 65536)
