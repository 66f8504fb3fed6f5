"""launch/report.py on real eval outputs (a tiny random export evaluated by launch/eval.py): the report's numbers
are the JSON's, its plots resolve, its examples are the samples files' decoded text; missing parts are named;
hostile files are one line naming them; the report is never written through a link."""

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _report(argv):
    spec = importlib.util.spec_from_file_location("launch_report", ROOT / "launch" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _copy(sp_eval_outputs, tmp_path, names=None):
    out = tmp_path / "eval"
    shutil.copytree(sp_eval_outputs[1], out)
    if names is not None:
        for path in out.iterdir():
            if path.name not in names:
                path.unlink()
    return out


def _row(report, label, after):
    """The cells of the table row of ``label`` in the first table after the line starting with ``after``."""
    lines = report[report.index(after) :].splitlines()
    row = next(line for line in lines if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in row.strip("|").split("|")][1:]


def test_the_report_holds_the_evals_numbers_plots_and_predictions(sp_eval_outputs, tmp_path):
    out = _copy(sp_eval_outputs, tmp_path)
    target = tmp_path / "elsewhere" / "run.md"  # the plots are linked relative to wherever the report goes
    target.parent.mkdir()
    assert _report([str(out), "--out", str(target)]) == 0
    report = target.read_text()
    label = str(out)

    ppl = json.loads((out / "ppl.json").read_text())["results"]
    context = [r for r in ppl if r["kind"] == "context"]
    whole = next(r for r in ppl if r["kind"] == "document")
    assert _row(report, label, "Perplexity of") == [f"{r['ppl']:.2f}" for r in [*context, whole]]
    recall = _row(report, label, "Far recall")
    for r, cell in zip(context, recall, strict=True):
        rates = " / ".join(f"{r[k]:.3f}" for k in ("far_recall", "far_recall_random", "far_recall_nearest"))
        assert cell == f"{rates} (n={r['far_recall_tokens']})"

    passkey = json.loads((out / "passkey.json").read_text())["results"]
    cells = []
    for length in sorted({r["length"] for r in passkey}):  # depths pooled, weighted by their samples
        mine = [r for r in passkey if r["length"] == length]
        n = sum(r["n"] for r in mine)
        hits, exact = (sum(r[k] * r["n"] for r in mine) / n for k in ("accuracy", "exact_match"))
        cells.append(f"{100 * hits:.0f}% ({100 * exact:.0f}%, n={n})")
    assert _row(report, label, "Passkey retrieval") == cells

    ruler = json.loads((out / "ruler.json").read_text())["results"]
    for r in ruler:
        assert _row(report, r["task"], "RULER-style") == [f"{100 * r['score']:.1f}"]

    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert sorted(Path(link).name for link in links) == ["passkey.png", "ppl.png", "ruler.png"]
    assert all((target.parent / link).resolve() == (out / Path(link).name).resolve() for link in links)

    samples = [json.loads(line) for line in (out / "passkey.samples.jsonl").read_text().splitlines()[1:]]
    for length in {s["length"] for s in samples}:
        first = next(s for s in samples if s["length"] == length)
        expected = f"| {first['key']} | {json.dumps(first['answer_text'])} | {json.dumps(first['predicted_text'])} |"
        assert expected in report
    for r in (json.loads(line) for line in (out / "ruler.samples.jsonl").read_text().splitlines()[1:]):
        if r["sample"] == 0:
            assert f"| {', '.join(r['answers'])} | {json.dumps(r['prediction'])} |" in report


def test_missing_parts_are_named(sp_eval_outputs, tmp_path, capsys):
    """A directory with ppl only: the report says which results and plots are absent; a directory with none of
    them, or no directory, is one line and exit 2."""
    out = _copy(sp_eval_outputs, tmp_path, names={"ppl.json"})
    assert _report([str(out)]) == 0
    report = (out / "report.md").read_text()
    assert f"| {out} |" in report and "| passkey.json, ruler.json |" in report
    assert "No directory holds passkey.json" in report and "No directory holds ruler.json" in report
    assert f"({out / 'ppl.png'} is missing: no plot.)" in report
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    for directory in (tmp_path / "empty", tmp_path / "absent"):
        assert _report([str(directory)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and str(directory) in err


@pytest.mark.parametrize(
    "name, text, says",
    [
        ("ppl.json", "{not json", "not valid JSON"),
        ("ppl.json", "[" * 100 + "]" * 100, "nested 100 deep"),
        ("ppl.json", '{"results": 5}', "field 'results' is 5, expected a list"),
        (
            "passkey.json",
            '{"results": [{"length": 256, "depth": 0.5, "accuracy": "all", "exact_match": 0, "n": 1}]}',
            "field 'results[0].accuracy' is \"all\"",
        ),
        (
            "ruler.json",
            '{"results": [{"task": "rm -rf", "length": 1, "score": 0, "n": 1}]}',
            "field 'results[0].task' is \"rm -rf\"",
        ),
        ("passkey.samples.jsonl", '{"settings": {}}\n{"length": 256}\n', "passkey.samples.jsonl:2: field 'depth'"),
    ],
)
def test_a_hostile_file_is_one_line_naming_it(sp_eval_outputs, tmp_path, capsys, name, text, says):
    out = _copy(sp_eval_outputs, tmp_path)
    (out / name).write_text(text)
    assert _report([str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out / name) in err and says in err, err
    assert not (out / "report.md").exists()


def test_the_report_is_never_written_through_a_link(sp_eval_outputs, tmp_path, capsys):
    out = _copy(sp_eval_outputs, tmp_path, names={"ppl.json"})
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.symlink(victim, out / "report.md")
    assert _report([str(out)]) == 2
    assert "symbolic link" in capsys.readouterr().err and victim.read_text() == "keep me"


def test_samples_written_before_the_text_was_kept_show_their_ids(sp_eval_outputs, tmp_path):
    """A passkey samples file of an earlier version (ids only; the eval resumes from it) still gives examples:
    the ids, marked as such."""
    out = _copy(sp_eval_outputs, tmp_path, names={"passkey.json", "passkey.samples.jsonl"})
    lines = (out / "passkey.samples.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines[1:]]
    for r in records:
        del r["answer_text"], r["predicted_text"]
    (out / "passkey.samples.jsonl").write_text("\n".join([lines[0], *map(json.dumps, records)]) + "\n")
    assert _report([str(out)]) == 0
    first = records[0]

    def shown(ids):  # brackets escaped, as markdown would read a link otherwise
        return "ids " + str(ids).replace("[", "\\[").replace("]", "\\]")

    assert f"| {shown(first['answer'])} | {shown(first['predicted'])} |" in (out / "report.md").read_text()
