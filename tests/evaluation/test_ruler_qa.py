"""RULER's QA tasks on local SQuAD / HotpotQA files made here: the decoded sample holds the question's own documents
among numbered distractors from the same file (checked against the JSON read independently), the score is
``string_match_part``, bad files and missing keys are one-line errors, and a run goes end to end."""

import json
import re

import numpy as np
import pytest

from data_prep.schema import ConfigError
from pipeline.data.qa_task import load_qa
from pipeline.evaluation import ruler
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.run import run_eval
from pipeline.evaluation.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
WORDS = "amber basalt cedar delta ember fjord granite harbor island juniper kestrel lagoon meadow".split()


def _paragraph(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n)).capitalize() + "."


def _squad(path, articles: int = 4, paragraphs: int = 5):
    rng = np.random.default_rng(0)
    data = []
    for a in range(articles):
        paras = []
        for p in range(paragraphs):
            context = f"Paragraph {a}-{p}. " + _paragraph(rng, int(rng.integers(5, 40)))
            qas = [
                {
                    "question": f"What is item {a}-{p}?",
                    "answers": [{"text": f"answer {a}-{p}"}, {"text": f"alt {a}-{p}"}],
                },
                {"question": f"Is there a {a}-{p}?", "answers": [], "is_impossible": True},
            ]
            paras.append({"context": context, "qas": qas})
        data.append({"title": f"t{a}", "paragraphs": paras})
    path.write_text(json.dumps({"version": "v2.0", "data": data}))
    return path


def _hotpot(path, items: int = 6):
    rng = np.random.default_rng(1)
    data = []
    for i in range(items):
        context = [[f"Title {i}-{k}", [_paragraph(rng, 6), " " + _paragraph(rng, 4)]] for k in range(4)]
        context.append(["Shared", ["Every item carries this paragraph."]])
        data.append({"question": f"Which {i}?", "answer": f"hotpot {i}", "context": context})
    path.write_text(json.dumps(data))
    return path


def _documents(text: str) -> tuple[str, list[tuple[int, str]], str]:
    """(what precedes the first document, [(number, document)], what follows the last) of a decoded prompt."""
    found = list(re.finditer(r"Document (\d+):\n(.*?)\n\n(?=Document \d+:\n|\n)", text, flags=re.S))
    return text[: found[0].start()], [(int(m.group(1)), m.group(2)) for m in found], text[found[-1].end() :]


def _sample(name, length, s, files, source="builtin"):
    sources = {"data": TokenSource(source, TOK, 0), "noise": TokenSource("noise", TOK, 0)}
    grid = ruler.RulerGrid([name], [length], 1, seed=0, qa_files=files)
    return ruler.build_ruler_sample(
        name,
        sources,
        TOK,
        length=length,
        rng=ruler.sample_rng(grid, name, length, s),
        chunk_size=16,
        qa_files=files,
    )


@pytest.mark.parametrize("length", [1024, 2048, 8192])
def test_squad_sample_holds_its_paragraph_among_numbered_distractors(tmp_path, length):
    raw = json.loads(_squad(tmp_path / "squad.json").read_text())
    paragraphs = [p for a in raw["data"] for p in a["paragraphs"]]
    contexts = [p["context"] for p in paragraphs]
    asked = set()
    for s in range(6):
        sample = _sample("ruler_qa_squad", length, s, {"squad": str(tmp_path / "squad.json")})
        assert len(sample.ids) == length and sample.answer_start % 16 == 1
        text = TOK.decode(sample.ids[: sample.answer_start].tolist())
        before, documents, after = _documents(text)
        question = re.fullmatch(r"\n.*\n\nQuestion: (.*) Answer:", after, flags=re.S).group(1)
        (qa,) = [q for p in paragraphs for q in p["qas"] if q["question"] == question]
        gold = next(p["context"] for p in paragraphs if qa in p["qas"])
        assert not qa.get("is_impossible") and sample.answers == tuple(a["text"] for a in qa["answers"])
        assert [n for n, _ in documents] == list(range(1, len(documents) + 1))
        texts = [d for _, d in documents]
        assert gold in texts and set(texts) <= set(contexts) and len(set(texts)) == len(texts)
        article = next(a for a in raw["data"] if qa in [q for p in a["paragraphs"] for q in p["qas"]])
        if length >= 2048:  # the article's other paragraphs fit, and come first among the distractors
            assert {p["context"] for p in article["paragraphs"]} <= set(texts)
        assert before.endswith("The documents:\n\n")
        pad = len(TOK.encode(before[: before.index("Answer the question")]))
        if len(texts) < len(contexts):  # the documents fill the context: the pad is shorter than any left out
            assert pad < max(len(TOK.encode(f"Document 99:\n{c}\n\n")) for c in contexts if c not in texts)
        answer = TOK.decode(sample.ids[sample.answer_start : sample.answer_start + sample.answer_len].tolist())
        assert answer.startswith(" " + sample.answers[0])
        assert sample.answer_len == max(len(TOK.encode(" " + a)) for a in sample.answers)
        asked.add(question)
    assert len(asked) > 1  # the question is drawn per sample
    if length == 8192:
        assert len(texts) == len(contexts)  # every paragraph fits; the rest is the haystack's text


def test_hotpot_sample_holds_every_paragraph_of_its_question(tmp_path):
    raw = json.loads(_hotpot(tmp_path / "hotpot.json").read_text())
    for s in range(4):
        sample = _sample("ruler_qa_hotpot", 1024, s, {"hotpot": str(tmp_path / "hotpot.json")})
        _, documents, after = _documents(TOK.decode(sample.ids[: sample.answer_start].tolist()))
        question = re.search(r"Question: (.*) Answer:$", after).group(1)
        (item,) = [d for d in raw if d["question"] == question]
        texts = [d for _, d in documents]
        for title, sentences in item["context"]:
            assert f"{title}\n{''.join(sentences)}" in texts
        assert texts.count("Shared\nEvery item carries this paragraph.") == 1  # each distinct paragraph once
        assert sample.answers == (item["answer"],)


def test_qa_rows_score_string_match_part(tmp_path, tiny_model, monkeypatch):
    """A prediction holding the second of two reference answers scores 1 (RULER's QA metric), half by match_all."""
    files = {"squad": str(_squad(tmp_path / "squad.json"))}
    sources = {"data": TokenSource("builtin", TOK, 0), "noise": TokenSource("noise", TOK, 0)}
    grid = ruler.RulerGrid(["ruler_qa_squad", "niah_single_2"], [1024], 2, seed=0, qa_files=files)
    monkeypatch.setattr(ruler, "predict_answer", lambda model, sample, **kw: TOK.encode(sample.answers[-1]))
    rows = {r["task"]: r for r in ruler.evaluate_ruler(tiny_model, TOK, sources, grid)}
    qa = rows["ruler_qa_squad"]
    assert qa["string_match_part"] == 1.0 and qa["string_match_all"] == 0.5
    assert qa["metric"] == "string_match_part" and qa["score"] == 1.0 and qa["held_out"]
    assert rows["niah_single_2"]["metric"] == "string_match_all" and not rows["niah_single_2"]["held_out"]
    assert "| ruler_qa_squad (held out) | 100.0 |" in ruler.markdown_table(list(rows.values()))


def test_bad_qa_files_are_one_line_errors_naming_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{bad}: not a readable JSON file"):
        load_qa(bad, "squad")
    bad.write_text(json.dumps([{"question": "q"}]))
    with pytest.raises(ValueError, match=rf"{bad}: not a squad QA file \(no top-level \"data\" list\)"):
        load_qa(bad, "squad")
    with pytest.raises(ValueError, match=rf"{bad}: not a hotpot QA file \(a record without the field 'context'\)"):
        load_qa(bad, "hotpot")
    bad.write_text(
        json.dumps({"data": [{"paragraphs": [{"context": "x", "qas": [{"question": "q", "answers": []}]}]}]})
    )
    with pytest.raises(ValueError, match=rf"{bad}: no question with an answer in this squad file"):
        load_qa(bad, "squad")
    with pytest.raises(ValueError, match="cannot read the squad QA file"):
        load_qa(tmp_path / "missing.json", "squad")


def test_qa_keys_are_checked_before_any_work(tiny_export, tmp_path):
    with pytest.raises(
        ConfigError, match=r"ruler_tasks has ruler_qa_squad, which reads a local squad file: set qa_squad"
    ):
        run_eval(str(tiny_export), "ruler", tmp_path / "a", ["ruler_tasks=[ruler_qa_squad]"])
    with pytest.raises(ConfigError, match=r"qa_hotpot='nowhere.json' is not a file"):
        run_eval(str(tiny_export), "ruler", tmp_path / "b", ["ruler_tasks=[ruler_qa_hotpot]", "qa_hotpot=nowhere.json"])
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"ruler_qa_hotpot at length 2048: .*empty.json: no question with an answer"):
        run_eval(
            str(tiny_export),
            "ruler",
            tmp_path / "c",
            ["ruler_tasks=[ruler_qa_hotpot]", f"qa_hotpot={tmp_path}/empty.json"],
        )
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_qa_run_goes_end_to_end_and_resumes_with_the_same_file_only(tiny_export, tmp_path):
    squad = _squad(tmp_path / "squad.json")
    settings = ["lengths=[1024]", "samples=2", "progress=false", "ruler_tasks=[ruler_qa_squad]", f"qa_squad={squad}"]
    result = run_eval(str(tiny_export), "ruler", tmp_path / "out", settings)
    (row,) = result["results"]
    assert row["task"] == "ruler_qa_squad" and row["n"] == 2 and row["metric"] == "string_match_part"
    records = [json.loads(line) for line in (tmp_path / "out" / ruler.SAMPLES_FILE).read_text().splitlines()[1:]]
    assert [r["sample"] for r in records] == [0, 1] and all(r["answers"] for r in records)
    other = _squad(tmp_path / "other.json", articles=2)
    with pytest.raises(ConfigError, match="qa_squad"):
        run_eval(str(tiny_export), "ruler", tmp_path / "out", [*settings[:-1], f"qa_squad={other}"])
