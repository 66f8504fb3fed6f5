"""``--task ruler``: every task's samples read back as RULER defines them (decoded and checked independently), the
scorer gives hand-computed scores, streaming agrees with a whole-sequence forward, and a killed run resumes."""

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.schema import ConfigError
from pipeline.data.retrieval_tasks import Codec, TaskShape, build_task
from pipeline.evaluation import ruler
from pipeline.evaluation.haystack import NOISE, TokenSource
from pipeline.evaluation.passkey import predict_answer
from pipeline.evaluation.resume import SampleLog
from pipeline.evaluation.run import run_eval
from pipeline.evaluation.runtime import StreamBudget
from pipeline.evaluation.tokenizer import ByteTokenizer

DEMO_YAML = Path(__file__).resolve().parents[2] / "configs" / "demo" / "demo.yaml"
TOK = ByteTokenizer()
CODEC = Codec(TOK.encode, TOK.decode)
S = 16


def _filler(length: int, seed: int) -> np.ndarray:
    return TokenSource("builtin", TOK, seed).window(length, np.random.default_rng(seed)).astype(np.int64)


def _parts(sample) -> tuple[str, str, str]:
    """(the context before the question, the question, the answer) as text."""
    ids = sample.ids.tolist()
    question_start = sample.needle_start + sample.needle_len
    return (
        TOK.decode(ids[:question_start]),
        TOK.decode(ids[question_start : sample.answer_start]),
        TOK.decode(ids[sample.answer_start : sample.answer_start + sample.answer_len]),
    )


def _check_grid_layout(sample) -> None:
    assert sample.answer_start % S == 1  # the question's last token is a chunk's first
    assert sample.answer_start + sample.answer_len <= len(sample.ids)


@pytest.mark.parametrize("length", [1024, 4096, 16384])
def test_cwe_list_holds_the_common_words_as_asked(length):
    for seed in range(3):
        sample = build_task("cwe", _filler(length, seed), CODEC, np.random.default_rng(seed), chunk_size=S)
        _check_grid_layout(sample)
        text = TOK.decode(sample.ids[sample.needle_start : sample.needle_start + sample.needle_len].tolist())
        items = re.findall(r" (\d+)\. ([a-z]+)", text)
        assert "".join(f" {n}. {w}" for n, w in items) == text  # nothing but the numbered list
        assert [int(n) for n, _ in items] == list(range(1, len(items) + 1))
        counts = Counter(w for _, w in items)
        repeats = min(30, max(counts.values()))
        common = [w for w, k in counts.items() if k == repeats]
        assert len(common) == 10 and repeats >= 2
        assert max(k for w, k in counts.items() if w not in common) < repeats
        first_seen = list(dict.fromkeys(w for _, w in items if w in common))
        assert list(sample.answers) == first_seen
        _, question, answer = _parts(sample)
        assert (question + answer).endswith(
            " What are the 10 most common words in the list above? They are " + ", ".join(first_seen)
        )
        if length >= 16384:
            assert repeats == 30 and max(k for w, k in counts.items() if w not in common) == 3
        assert sample.needle_len > 0.9 * sample.answer_start  # the list fills the context


@pytest.mark.parametrize("length", [1024, 4096, 16384])
def test_fwe_text_has_the_asked_words_most_often_after_the_dots(length):
    for seed in range(3):
        sample = build_task("fwe", _filler(length, seed), CODEC, np.random.default_rng(seed), chunk_size=S)
        _check_grid_layout(sample)
        words = TOK.decode(sample.ids[sample.needle_start : sample.needle_start + sample.needle_len].tolist()).split()
        ranked = Counter(words).most_common()
        assert ranked[0][0] == "..."
        assert [w for w, _ in ranked[1:4]] == list(sample.answers)
        counts = [k for _, k in ranked[:5]]
        assert counts == sorted(set(counts), reverse=True)  # strictly fewer at each rank: one right answer
        # Zipf's law with alpha 2: the k-th word floor(n / k^2 / zeta(2)) times for one n, so the n each count
        # allows, [count, count + 1) * k^2 * zeta(2), overlap for every rank.
        share = [1 / k**2 / (np.pi**2 / 6) for k in range(1, 6)]
        lows = [k / p for (_, k), p in zip(ranked, share)]
        highs = [(k + 1) / p for (_, k), p in zip(ranked, share)]
        assert max(lows) < min(highs)
        _, question, answer = _parts(sample)
        assert (question + answer).endswith("most frequent words above? They are " + ", ".join(sample.answers))


def test_aggregation_families_refuse_too_short_sequences():
    with pytest.raises(ValueError, match="no room for 2 rounds of 10 common words"):
        build_task("cwe", _filler(256, 0), CODEC, np.random.default_rng(0), chunk_size=S)
    with pytest.raises(ValueError, match="common_repeats=3 must exceed uncommon_repeats=3"):
        TaskShape(common_repeats=3).check()
    with pytest.raises(ValueError, match=r"value_kind='hex' is not one of \('number', 'uuid'\)"):
        TaskShape(value_kind="hex").check()
    with pytest.raises(ValueError, match=r"name_kind='number' is not one of \('word', 'uuid'\)"):
        TaskShape(name_kind="number").check()


NUMBER = re.compile(r"\b\d{5}\b")


UUID_TASKS = ("niah_single_3", "niah_multikey_2", "niah_multikey_3")
"""Tasks with UUIDs or a haystack made of needles (checked by their own test below)."""


@pytest.mark.parametrize("name", [n for n in ruler.SYNTHETIC_TASKS if n not in ("ruler_cwe", "ruler_fwe", *UUID_TASKS)])
def test_every_niah_and_vt_task_reads_back_as_ruler_defines_it(name):
    """Decoded, the context holds the task's needles (RULER's counts) and the answers are the asked ones."""
    task = ruler.RULER_TASKS[name]
    sources = {"data": TokenSource("builtin", TOK, 0), "noise": TokenSource("noise", TOK, 0)}
    grid = ruler.RulerGrid([name], [2048], 1, seed=3)
    for s in range(4):
        sample = ruler.build_ruler_sample(
            name, sources, TOK, length=2048, rng=ruler.sample_rng(grid, name, 2048, s), chunk_size=32
        )
        ids = sample.ids.tolist()
        answer = TOK.decode(ids[sample.answer_start : sample.answer_start + sample.answer_len])
        question_end = sample.answer_start
        context = TOK.decode(ids[: question_end - 48])  # the question is shorter than 48 bytes
        if task.noise:
            assert NOISE.strip() in context
        keys = NUMBER.findall(context)
        if task.family == "vt":
            statements = dict(re.findall(r" (\w+) = (\w+)\. ", context))
            (value,) = keys
            chain = [name for name, rhs in statements.items() if rhs == value]
            while next_names := [n for n, rhs in statements.items() if rhs == chain[-1]]:
                chain += next_names
            assert len(chain) == task.shape.hops + 1 and list(sample.answers) == chain
        else:
            expected = {"single": 1, "multikey": 4, "multivalue": 4, "multiquery": 4}[task.family]
            assert len(keys) == len(set(keys)) == expected
            assert set(sample.answers) <= set(keys)
            assert len(sample.answers) == {"single": 1, "multikey": 1, "multivalue": 4, "multiquery": 4}[task.family]
        assert answer.strip() == ", ".join(sample.answers)


def test_the_passkey_task_with_uuid_values_asks_what_niah_single_3_asks():
    """``--task passkey variant=multikey needles=1 queries=1 value_kind=uuid`` and RULER's niah_single_3 build the
    same sample from the same generator (one builder, two spellings); with number values the passkey task's needle
    says "numbers" again."""
    from pipeline.data.needle import NeedleSpec
    from pipeline.evaluation.passkey import build_sample

    sources = {"data": TokenSource("builtin", TOK, 0), "noise": TokenSource("noise", TOK, 0)}
    spec = NeedleSpec(variant="multikey", needles=1, queries=1, value_kind="uuid")
    for seed in range(3):
        asked = ruler.build_ruler_sample(
            "niah_single_3", sources, TOK, length=1024, rng=np.random.default_rng([seed, 7]), chunk_size=32
        )
        passkey = build_sample(
            sources["data"], TOK, spec, length=1024, depth=None, rng=np.random.default_rng([seed, 7]), chunk_size=32
        )
        assert (passkey.ids == asked.ids).all() and passkey.key == asked.key
        assert re.fullmatch(UUID, passkey.key)
    numbers = build_sample(
        sources["data"],
        TOK,
        NeedleSpec(variant="multikey"),
        length=1024,
        depth=None,
        rng=np.random.default_rng(0),
        chunk_size=32,
    )
    text = TOK.decode(numbers.ids[: numbers.answer_start].tolist())
    assert "special magic numbers for" in text and "uuid" not in text and re.fullmatch(r"\d{5}", numbers.key)


UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
NEEDLE_TEXT = {
    "niah_multikey_2": re.compile(r" One of the special magic numbers for ([A-Z][a-z]+) is (\d{5})\. "),
    "niah_multikey_3": re.compile(rf" One of the special magic uuids for ({UUID}) is ({UUID})\. "),
}


@pytest.mark.parametrize("name", UUID_TASKS)
@pytest.mark.parametrize("length", [1024, 4096])
def test_uuid_and_needle_haystack_tasks_read_back_as_ruler_defines_them(name, length):
    """niah_single_3: one UUID value among the data's text; niah_multikey_2/3: a context of needles only (names and
    values all distinct; words and numbers, or UUIDs), the asked one's value the answer. Parsed from the decoded
    text, independently of the builder."""
    sources = {"data": TokenSource("builtin", TOK, 0), "noise": TokenSource("noise", TOK, 0)}
    grid = ruler.RulerGrid([name], [length], 1, seed=5)
    depths = []
    for s in range(4):
        sample = ruler.build_ruler_sample(
            name, sources, TOK, length=length, rng=ruler.sample_rng(grid, name, length, s), chunk_size=32
        )
        assert len(sample.ids) == length
        text = TOK.decode(sample.ids[: sample.answer_start].tolist())
        before_question, question = text.split(" What is the special magic")
        (asked_name,) = set(re.findall(r" for (\S+?)(?:\?| is$)", question))
        answer = TOK.decode(sample.ids[sample.answer_start : sample.answer_start + sample.answer_len].tolist())
        assert answer.strip() == sample.key and sample.answers == (sample.key,)
        if name == "niah_single_3":
            needle = f" One of the special magic uuids for {asked_name} is {sample.key}. "
            assert re.fullmatch(UUID, sample.key) and needle in before_question
            assert re.findall(UUID, text) == [sample.key]
            assert re.fullmatch(r"[A-Z][a-z]+", asked_name)
            continue
        needles = list(NEEDLE_TEXT[name].finditer(before_question))
        pad = before_question[: needles[0].start()]
        assert "".join(m.group(0) for m in needles) == before_question[len(pad) :]  # nothing but needles after
        assert len(TOK.encode(pad)) < len(TOK.encode(needles[0].group(0)))  # the pad is shorter than one needle
        names = [m.group(1) for m in needles]
        values = [m.group(2) for m in needles]
        assert len(set(names)) == len(names) and len(set(values)) == len(values)
        assert len(needles) >= 2
        assert dict(zip(names, values))[asked_name] == sample.key
        assert set(sample.distractors) == set(values) - {sample.key}
        depths.append(names.index(asked_name) / (len(names) - 1))
    if name != "niah_single_3":
        assert max(depths) - min(depths) > 0.2  # the asked needle's place is drawn per sample


def test_scores_are_ruler_string_match_on_hand_made_predictions():
    refs = ("48213", "kalomi", "Terufa")
    assert ruler.match_all("48213 and KALOMI", refs) == pytest.approx(2 / 3)
    assert ruler.match_part("48213 and KALOMI", refs) == 1.0
    assert ruler.match_all("nothing", refs) == 0.0 and ruler.match_part("nothing", refs) == 0.0
    assert ruler.match_all("terufa, kalomi, 48213", refs) == 1.0
    assert ruler.postprocess("  a\x00b\tc \n") == "a\nb\nc"


def test_rows_average_the_samples_scores(tiny_model, monkeypatch):
    """Predictions made by hand: per task one full answer, one half answer (multivalue), one empty."""
    sources = {"data": TokenSource("builtin", TOK, 0), "noise": TokenSource("noise", TOK, 0)}
    grid = ruler.RulerGrid(["niah_single_1", "niah_multivalue"], [512], 3, seed=0)
    made = {0: lambda a: ", ".join(a), 1: lambda a: ", ".join(a[: len(a) // 2] or ["x"]), 2: lambda a: ""}
    calls = []

    def predict(model, sample, **kwargs):
        text = made[len(calls) % 3](list(sample.answers))
        calls.append(text)
        return TOK.encode(text)

    monkeypatch.setattr(ruler, "predict_answer", predict)
    rows = ruler.evaluate_ruler(tiny_model, TOK, sources, grid)
    by_task = {r["task"]: r for r in rows}
    assert by_task["niah_single_1"]["string_match_all"] == pytest.approx(1 / 3)  # 1, 0 ("x"), 0
    assert by_task["niah_single_1"]["string_match_part"] == pytest.approx(1 / 3)
    assert by_task["niah_multivalue"]["string_match_all"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert by_task["niah_multivalue"]["string_match_part"] == pytest.approx(2 / 3)
    assert all(r["n"] == 3 and r["length"] == 512 for r in rows) and len(calls) == 6
    table = ruler.markdown_table(rows)
    assert "| niah_single_1 | 33.3 |" in table and "| niah_multivalue | 50.0 |" in table
    assert "| **mean** | 41.7 |" in table


def test_rows_count_the_fetched_needles_of_needle_tasks_only(tiny_model):
    """A needle task's row counts, per group, the samples whose question retrieval held the asked needle (as
    passkey's, ``passkey.retrieval_checks``); a word-list task, whose listed words are no needles, counts none."""
    sources = {"data": TokenSource("builtin", TOK, 0), "noise": TokenSource("noise", TOK, 0)}
    grid = ruler.RulerGrid(["niah_single_1", "ruler_cwe"], [1024], 2, seed=0)
    by_task = {r["task"]: r for r in ruler.evaluate_ruler(tiny_model, TOK, sources, grid)}
    assert by_task["niah_single_1"]["retrieval"]["g0"]["asked_needle"]["n"] == 2
    assert "retrieval" not in by_task["ruler_cwe"]


def test_a_several_needle_sample_records_whether_every_asked_needle_was_fetched(tiny_model):
    """``every_asked_needle``: the question's row holds all the asked needles' chunks (multivalue asks for all
    its values), beside ``asked_needle`` (one of them); a one-needle sample records only the latter. The rows
    read by the answer's later chunks are checked too."""
    from pipeline.evaluation.passkey import retrieval_checks

    sources = {"data": TokenSource("builtin", TOK, 0), "noise": TokenSource("noise", TOK, 0)}
    grid = ruler.RulerGrid(["niah_multivalue", "niah_single_2"], [1024], 1, seed=0)
    S = tiny_model.cfg.chunk_size
    multi, single = (
        ruler.build_ruler_sample(
            name, sources, TOK, length=1024, rng=ruler.sample_rng(grid, name, 1024, 0), chunk_size=S
        )
        for name in ("niah_multivalue", "niah_single_2")
    )
    row = multi.question_row(S)
    asked = sorted(multi.asked_chunks)
    assert len(asked) >= 4  # RULER's four values, each in chunks of its own
    other = next(c for c in range(row) if c not in multi.asked_chunks)
    assert retrieval_checks(multi, {(0, row): [asked]}, S) == {"g0": {"asked_needle": True, "every_asked_needle": True}}
    assert retrieval_checks(multi, {(0, row): [[*asked[1:], other]]}, S) == {
        "g0": {"asked_needle": True, "every_asked_needle": False}
    }
    assert retrieval_checks(multi, {(0, row): [[other]], (0, row - 1): [asked]}, S) == {
        "g0": {"asked_needle": False, "every_asked_needle": False}
    }
    one = single.question_row(S)
    assert retrieval_checks(single, {(0, one): [sorted(single.asked_chunks)]}, S) == {"g0": {"asked_needle": True}}

    # An answer longer than a chunk: each chunk that predicts answer tokens reads its own row, and
    # ``every_asked_needle_later`` says whether all of those after the question's held every asked needle too.
    readers = sorted({(multi.answer_start + i - 1) // S - 1 for i in range(multi.answer_len)})
    assert readers[0] == row and len(readers) >= 2
    later = {(0, r): [asked] for r in readers[1:]}
    assert retrieval_checks(multi, {(0, row): [asked], **later}, S)["g0"]["every_asked_needle_later"] is True
    later[(0, readers[-1])] = [asked[1:]]
    assert retrieval_checks(multi, {(0, row): [asked], **later}, S)["g0"]["every_asked_needle_later"] is False
    beyond = {(0, readers[-1] + 1): [[other]]}  # a row no answer token reads does not count
    assert retrieval_checks(multi, {(0, row): [asked], (0, readers[1]): [asked], **beyond}, S)["g0"][
        "every_asked_needle_later"
    ]


def _greedy_one_shot(model, ids: list[int], n: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_streamed_prediction_equals_a_whole_sequence_forward(tiny_model, tmp_path):
    sources = {"data": TokenSource("builtin", TOK, 1), "noise": TokenSource("noise", TOK, 1)}
    grid = ruler.RulerGrid(["niah_single_2"], [320], 1, seed=0)
    sample = ruler.build_ruler_sample(
        "niah_single_2",
        sources,
        TOK,
        length=320,
        rng=ruler.sample_rng(grid, "niah_single_2", 320, 0),
        chunk_size=tiny_model.cfg.chunk_size,
    )
    budget = StreamBudget(segment=37, offload_mb=0, offload_dir=str(tmp_path))  # every chunk to disk
    streamed = predict_answer(tiny_model, sample, budget=budget)
    expected = _greedy_one_shot(tiny_model, sample.ids[: sample.answer_start].tolist(), sample.answer_len)
    assert streamed == expected


SETTINGS = [
    "lengths=[300,400]",
    "samples=1",
    "segment=100",
    "progress=false",
    "ruler_tasks=[niah_single_1,niah_single_2]",
]


class Killed(Exception):
    """Stands for the run being killed between two samples."""


def _count(monkeypatch, kill_after: int | None = None) -> list[int]:
    calls: list[int] = []
    real = ruler.predict_answer

    def counting(model, sample, *args, **kwargs):
        if kill_after is not None and len(calls) == kill_after:
            raise Killed
        calls.append(len(sample.ids))
        return real(model, sample, *args, **kwargs)

    monkeypatch.setattr(ruler, "predict_answer", counting)
    return calls


def _scores(result: dict) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("seconds", "tokens_per_s")} for row in result["results"]]


def test_killed_ruler_run_resumes_without_recomputing(tiny_export, tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        calls = _count(m)
        whole = run_eval(str(tiny_export), "ruler", tmp_path / "whole", SETTINGS)
    assert len(calls) == 4  # 2 lengths x 2 tasks x 1 sample
    assert (tmp_path / "whole" / "ruler.png").read_bytes()[:4] == b"\x89PNG"
    errors = ruler.errors_table(whole["results"])  # the untrained model's answers are wrong: the table says why
    assert errors and "niah_single_2" in errors
    expected = (
        ruler.markdown_table(whole["results"]) + "\nWhy the wrong needle answers are wrong (docs/evaluation.md):\n\n"
    )
    assert (tmp_path / "whole" / "ruler.md").read_text() == expected + errors

    out = tmp_path / "killed"
    with monkeypatch.context() as m:
        _count(m, kill_after=1)
        with pytest.raises(Killed):
            run_eval(str(tiny_export), "ruler", out, SETTINGS)
    assert len((out / ruler.SAMPLES_FILE).read_text().splitlines()) == 1 + 1 and not (out / "ruler.json").exists()
    with monkeypatch.context() as m:
        calls = _count(m)
        resumed = run_eval(str(tiny_export), "ruler", out, SETTINGS)
    assert calls == [300, 400, 400]  # niah_single_2 at 300, then both at 400
    assert _scores(resumed) == _scores(whole)
    assert json.loads((out / "ruler.json").read_text())["results"] == resumed["results"]
    with pytest.raises(ConfigError, match="key_digits=5.*key_digits=6"):
        run_eval(str(tiny_export), "ruler", out, [*SETTINGS, "key_digits=6"])


def test_bad_ruler_settings_are_one_line_errors_before_any_work(tiny_export, tmp_path):
    with pytest.raises(ConfigError, match=r"ruler_tasks=\['niah_bogus'\]: need distinct names among .*unknown"):
        run_eval(str(tiny_export), "ruler", tmp_path / "a", ["ruler_tasks=[niah_bogus]"])
    with pytest.raises(ConfigError, match="ruler_tasks: ruler_cwe at length 256: .*no room for 2 rounds"):
        run_eval(str(tiny_export), "ruler", tmp_path / "b", ["lengths=[256]", "ruler_tasks=[ruler_cwe]"])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Only a few words.")
    with pytest.raises(ConfigError, match=rf"data={docs} holds 17 tokens, fewer than the 4096 haystack tokens"):
        run_eval(str(tiny_export), "ruler", tmp_path / "c", [f"data={docs}", "lengths=[256,4096]"])
    assert not any((tmp_path / name).exists() for name in "abc")


def test_sample_log_keys_ruler_records_by_task_length_and_sample(tmp_path):
    log = SampleLog(tmp_path / "x.jsonl", {"seed": 0}, key=ruler.sample_key)
    log.add({"task": "ruler_vt", "length": 8, "sample": 1, "string_match_all": 1.0})
    again = SampleLog(tmp_path / "x.jsonl", {"seed": 0}, key=ruler.sample_key)
    assert again.get(("ruler_vt", 8, 1))["string_match_all"] == 1.0 and again.get(("ruler_vt", 8, 0)) is None


def test_the_demo_report_shows_each_models_ruler_table(tmp_path):
    from pipeline.demos.demo_report import collect_ruler, write_report

    rows = {
        "gca": [
            {"task": "niah_single_1", "length": 1024, "score": 1.0, "n": 1},
            {"task": "ruler_cwe", "length": 1024, "score": 0.25, "n": 1},
        ],
        "baseline": [{"task": "niah_single_1", "length": 1024, "score": 0.0, "n": 1}],
    }
    for model, results in rows.items():
        (tmp_path / "eval" / model / "ruler").mkdir(parents=True)
        (tmp_path / "eval" / model / "ruler" / "ruler.json").write_text(json.dumps({"results": results}))
    assert [r["model"] for r in collect_ruler(tmp_path, ["gca", "baseline", "ablation"])] == ["gca", "gca", "baseline"]
    report = write_report(tmp_path, ["gca", "baseline"], {})
    gca, baseline = report.split("**gca**")[1].split("**baseline**")
    assert "| niah_single_1 | 100.0 |" in gca and "| ruler_cwe (held out) | 25.0 |" in gca
    assert "| **mean** | 62.5 |" in gca and "| niah_single_1 | 0.0 |" in baseline
    assert json.loads((tmp_path / "ruler.json").read_text())["results"][0]["model"] == "gca"


def test_the_demo_refuses_unknown_ruler_tasks_before_running():
    from pipeline.demos.demo import load_demo_config

    cfg, _ = load_demo_config(DEMO_YAML, [])
    assert cfg.ruler_lengths == [4096, 65536] and cfg.ruler_samples == 10  # 10 samples: a score of 80 means something
    with pytest.raises(ConfigError, match=r"'ruler_tasks' has a wrong value: \['niah_bogus'\] are not among"):
        load_demo_config(DEMO_YAML, ["ruler_tasks=[niah_single_1,niah_bogus]"])


def test_the_training_mix_holds_the_aggregation_families_out():
    from pipeline.data.mix import RetrievalMix

    for family in ("cwe", "fwe"):
        with pytest.raises(ValueError, match=rf"data\.retrieval_mix\.families: unknown \['{family}'\]"):
            RetrievalMix(CODEC, seq_len=1024, chunk_size=S, fraction=0.1, families={family: 1.0})


def test_the_command_line_runs_ruler_and_prints_its_rows(tiny_export, tmp_path, capsys):
    from pipeline.cli.eval import main

    args = ["--checkpoint", str(tiny_export), "--task", "ruler", "--out", str(tmp_path / "out")]
    assert main([*args, "lengths=[256]", "samples=1", "progress=false", "ruler_tasks=[niah_single_1]"]) == 0
    printed = capsys.readouterr().out
    assert "task=niah_single_1 family=single held_out=False length=256 string_match_all=" in printed
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "ruler.json",
        "ruler.md",
        "ruler.png",
        "ruler.samples.jsonl",
    ]
    assert main([*args, "ruler_tasks=[nope]"]) == 2
    assert "error: ruler_tasks=['nope']: need distinct names among" in capsys.readouterr().err
