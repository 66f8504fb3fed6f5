"""What an eval writes for a reader: decoded text beside the ids in the samples files, the whole-document pass
labelled for what it streams, each result's config holding the keys of its task, far-recall rates with their count."""

import json
import re

import sentencepiece as spm
import yaml

from pipeline.cli.eval import main as eval_main
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.tokenizer import ModelTokenizer


def test_passkey_samples_hold_the_text_the_tokenizer_decodes(sp_eval_outputs):
    """Every passkey sample keeps its answer and prediction as ids and as text; the text is what SentencePiece
    itself (loaded here from the export's file, not through the eval) decodes from those ids."""
    export, out = sp_eval_outputs
    sp = spm.SentencePieceProcessor(model_file=str(export / "tokenizer.model"))
    records = [json.loads(line) for line in (out / "passkey.samples.jsonl").read_text().splitlines()[1:]]
    assert len(records) == 2 * 2 * 2  # lengths x depths x samples
    for r in records:
        assert r["answer_text"] == sp.decode(r["answer"]) and r["answer_text"].strip() == r["key"]
        assert r["predicted_text"] == sp.decode(r["predicted"])
    ruler = [json.loads(line) for line in (out / "ruler.samples.jsonl").read_text().splitlines()[1:]]
    assert len(ruler) == 2 * 2  # tasks x samples
    for r in ruler:  # the text as scored: decoded, outer whitespace stripped (RULER's postprocess)
        assert r["prediction"] == sp.decode(r["predicted"]).strip() and r["predicted"]


def test_ids_beyond_the_tokenizer_decode_as_replacement_characters(tmp_path):
    """A model's vocabulary may be larger than its tokenizer's, and an untrained model predicts any id: such an id
    decodes as U+FFFD (as the byte tokenizer does) instead of SentencePiece's IndexError ending the eval."""
    from helpers import train_test_tokenizer

    path = tmp_path / "tokenizer.model"
    path.write_bytes(train_test_tokenizer([f"The pass key is {i * 7919}." for i in range(200)], 300))
    sp = spm.SentencePieceProcessor(model_file=str(path))
    tok = ModelTokenizer(path)
    left, right = sp.encode("The pass"), sp.encode(" key is 42.")
    assert tok.decode([*left, sp.get_piece_size(), *right]) == sp.decode(left) + "\ufffd" + sp.decode(right)
    assert tok.decode([*left, *right]) == sp.decode([*left, *right])


def _ppl(export, out, *keys):
    args = ["--checkpoint", str(export), "--task", "ppl", "--out", str(out), "segment=128", "score_len=64"]
    assert eval_main([*args, *keys]) == 0


def test_the_whole_document_pass_is_labelled_for_what_it_streams(tiny_export, tmp_path, capsys):
    """The progress bar of the whole-document pass names it, not a context length it did not use (it used to read
    ``ppl L=512``, the longest document's length); with ``ppl_documents=windows`` it streams windows and says so."""
    _ppl(tiny_export, tmp_path / "documents", "lengths=[256,384]", "progress=true")
    bars = capsys.readouterr().err
    assert set(re.findall(r"ppl L=(\d+)", bars)) == {"256", "384"}
    assert "ppl whole documents" in bars
    _ppl(tiny_export, tmp_path / "windows", "lengths=[256]", "progress=true", "ppl_documents=windows", "data=noise")
    assert "ppl whole windows" in capsys.readouterr().err


def test_each_result_records_only_its_own_tasks_keys(sp_eval_outputs, tmp_path):
    """``ppl.json`` holds no passkey or RULER key (and ``passkey.json`` no ppl or RULER one), and what it holds is
    enough: rerunning from the recorded config alone gives the same rows."""
    export, out = sp_eval_outputs
    ppl = json.loads((out / "ppl.json").read_text())
    passkey_or_ruler = {"depths", "variant", "needle", "question", "key_digits", "ruler_tasks", "qa_squad", "restart"}
    assert not set(ppl["config"]) & passkey_or_ruler
    assert "progress" not in ppl["config"]
    assert ppl["config"]["lengths"] == [256, 512] and ppl["config"]["score_len"] == 64
    assert set(ppl["config"]) < {f.name for f in EvalConfig.__dataclass_fields__.values()}
    passkey = json.loads((out / "passkey.json").read_text())["config"]
    assert not set(passkey) & {"score_len", "ppl_documents", "document_ppl", "ruler_tasks", "qa_hotpot"}
    assert passkey["depths"] == [0, 1] and passkey["variant"] == "single"
    config = tmp_path / "ppl.yaml"
    config.write_text(yaml.safe_dump(ppl["config"]))
    args = ["--checkpoint", str(export), "--task", "ppl", "--out", str(tmp_path / "again"), "--config", str(config)]
    assert eval_main([*args, "progress=false"]) == 0
    again = json.loads((tmp_path / "again" / "ppl.json").read_text())
    assert [r["nll"] for r in again["results"]] == [r["nll"] for r in ppl["results"]]


def test_every_far_recall_rate_is_printed_with_its_count(tiny_export, tmp_path, capsys):
    """The printed rows put the count a rate is a fraction of beside each far-recall rate (a rate of 2 tokens is
    no rate of 2,000), the count being the row's ``far_recall_tokens`` in ``ppl.json``."""
    _ppl(tiny_export, tmp_path, "lengths=[256,384]", "progress=false", "document_ppl=false")
    printed = capsys.readouterr().out.splitlines()
    rows = json.loads((tmp_path / "ppl.json").read_text())["results"]
    assert len(rows) == 2
    for row, line in zip(rows, printed):
        for key in ("far_recall", "far_recall_random", "far_recall_nearest"):
            assert re.search(rf"\b{key}=\S+ \(n={row['far_recall_tokens']}\)", line), (key, line)
