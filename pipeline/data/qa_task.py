"""RULER's QA family: a question answered from documents, the gold ones among as many distractors as the sequence
holds, read from local SQuAD or HotpotQA files (nothing is downloaded).

A sample of ``length`` tokens is laid out like the other families of ``pipeline.data.retrieval_tasks`` (the
question's last token opens a chunk, the answer follows it): the question's own documents (SQuAD: the paragraph it
was asked on; HotpotQA: the ten paragraphs that come with it, two of them holding the supporting facts) and
distractor documents (SQuAD: first the other paragraphs of the question's article, as RULER takes them, then
paragraphs drawn at random from the rest of the file), shuffled and numbered, fill the context back to back up to
the question; the haystack's text pads what is left at the start (less than one document, or more when the file
has too few documents for the length). As in RULER, the documents are each file's distinct
paragraphs, the references are every answer given for the question, and a prediction is scored with
``string_match_part`` (any reference found in it). The trainer's mix never draws this family (held out).

Files (JSON, parsed with ``json``: no code is run):

- SQuAD v1.1 / v2.0 (``dev-v2.0.json``): ``{"data": [{"paragraphs": [{"context": str, "qas": [{"question": str,
  "answers": [{"text": str}, ...], "is_impossible": bool?}]}]}]}``; questions without an answer are left out.
- HotpotQA (``hotpot_dev_distractor_v1.json``): ``[{"question": str, "answer": str, "context": [[title,
  [sentence, ...]], ...]}, ...]``; a paragraph is its title, a newline and its sentences joined.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.needle import chunks_of
from pipeline.data.retrieval_tasks import Codec, TaskSample, question_spot

QA_FORMATS = ("squad", "hotpot")
MAX_ANSWER_TOKENS = 32
"""The most answer tokens a prediction decodes (RULER generates 32 tokens for QA)."""
INSTRUCTION = "Answer the question from the documents. Reply with the answer only, no other words."
HEADER = INSTRUCTION + "\n\nThe documents:\n\n"
DOCUMENT = "Document {number}:\n{text}\n\n"
QUESTION = "\n" + INSTRUCTION + "\n\nQuestion: {question} Answer:"
"""The texts around the documents (RULER's structure in the project's words); the answer follows as ``" " + ref``."""


@dataclass(frozen=True)
class QAQuestion:
    question: str
    answers: tuple[str, ...]
    """Every distinct reference answer, the first one written after the question in the sample's ids."""
    gold: tuple[int, ...]
    """Indices into ``QASet.documents`` of the documents that come with the question."""
    related: tuple[int, ...] = ()
    """SQuAD: the other paragraphs of the question's article, the first distractors (RULER's choice: the hardest
    ones)."""


@dataclass(frozen=True)
class QASet:
    """The questions of one file and its distinct paragraphs."""

    path: str
    documents: tuple[str, ...]
    questions: tuple[QAQuestion, ...]


def _malformed(path: Path, fmt: str, what: str) -> ValueError:
    layout = {
        "squad": '{"data": [{"paragraphs": [{"context": ..., "qas": [{"question": ..., "answers": [{"text": ...}]}]}]}]}',  # noqa: E501
        "hotpot": '[{"question": ..., "answer": ..., "context": [[title, [sentence, ...]], ...]}, ...]',
    }[fmt]
    return ValueError(f"{path}: not a {fmt} QA file ({what}); expected {layout}")


def _read_squad(path: Path, data: object) -> QASet:
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise _malformed(path, "squad", 'no top-level "data" list')
    index: dict[str, int] = {}
    questions = []
    try:
        for article in data["data"]:
            for paragraph in article["paragraphs"]:
                if not isinstance(paragraph["context"], str):
                    raise TypeError("context")
                index.setdefault(paragraph["context"], len(index))
            article_docs = list(dict.fromkeys(index[p["context"]] for p in article["paragraphs"]))
            for paragraph in article["paragraphs"]:
                doc = index[paragraph["context"]]
                related = tuple(d for d in article_docs if d != doc)
                for qa in paragraph["qas"]:
                    answers = tuple(dict.fromkeys(a["text"] for a in qa.get("answers", []) if a["text"].strip()))
                    if qa.get("is_impossible") or not answers:
                        continue
                    questions.append(QAQuestion(str(qa["question"]).strip(), answers, (doc,), related))
    except (KeyError, TypeError, AttributeError) as err:
        raise _malformed(path, "squad", f"a record without the field {err}") from None
    return QASet(str(path), tuple(index), tuple(questions))


def _read_hotpot(path: Path, data: object) -> QASet:
    if not isinstance(data, list):
        raise _malformed(path, "hotpot", "the top level is not a list")
    documents: list[str] = []
    index: dict[str, int] = {}
    questions = []
    try:
        for item in data:
            gold = []
            for title, sentences in item["context"]:
                text = f"{title}\n{''.join(sentences)}"
                if text not in index:
                    index[text] = len(documents)
                    documents.append(text)
                gold.append(index[text])
            answer = str(item["answer"]).strip()
            if answer:
                questions.append(QAQuestion(str(item["question"]).strip(), (answer,), tuple(dict.fromkeys(gold))))
    except (KeyError, TypeError, ValueError) as err:
        raise _malformed(path, "hotpot", f"a record without the field {err}") from None
    return QASet(str(path), tuple(documents), tuple(questions))


_loaded: dict[tuple[str, str, int, int], QASet] = {}
_loaded_lock = threading.Lock()


def load_qa(path: str | Path, fmt: str) -> QASet:
    """The questions and documents of a local ``fmt`` file (``QA_FORMATS``), read once per process while the file
    is unchanged (a run builds every sample from it).

    Raises:
        ValueError: an unknown format; the file is missing, not JSON, not of that layout, or holds no question with
            an answer (the message names the file).
    """
    if fmt not in QA_FORMATS:
        raise ValueError(f"QA format {fmt!r} is not one of {QA_FORMATS}")
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as err:
        raise ValueError(f"{path}: cannot read the {fmt} QA file ({err.strerror})") from None
    key = (str(path.resolve()), fmt, stat.st_size, stat.st_mtime_ns)
    with _loaded_lock:
        if key in _loaded:
            return _loaded[key]
    try:
        data = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({str(err).splitlines()[0]})") from None
    qa = _read_squad(path, data) if fmt == "squad" else _read_hotpot(path, data)
    if not qa.questions:
        raise ValueError(f"{path}: no question with an answer in this {fmt} file")
    with _loaded_lock:
        _loaded[key] = qa
    return qa


def build_qa(qa: QASet, haystack: np.ndarray, codec: Codec, rng: np.random.Generator, *, chunk_size: int) -> TaskSample:
    """A QA sample of ``len(haystack)`` tokens: a question drawn from ``qa``, its documents and distractors as the
    module docstring says, written over ``haystack``.

    Raises:
        ValueError: the sequence cannot hold the question's own documents, the question and its answer.
    """
    length, S = len(haystack), chunk_size
    item = qa.questions[int(rng.integers(len(qa.questions)))]
    answer = codec.encode(" " + item.answers[0])
    answer_len = min(MAX_ANSWER_TOKENS, max(len(codec.encode(" " + ref)) for ref in item.answers))
    question = codec.encode(QUESTION.format(question=item.question))
    answer_start, question_start = question_spot(length, S, len(question), answer_len)
    header = codec.encode(HEADER)
    gold = set(item.gold)
    related = [item.related[k] for k in rng.permutation(len(item.related)).tolist()]
    others = related + [i for i in rng.permutation(len(qa.documents)).tolist() if i not in gold.union(related)]
    picked = _pick_documents(qa, codec, list(item.gold), others, question_start - len(header))
    if picked is None:
        raise ValueError(
            f"a sequence of {length} tokens with chunk_size={S} cannot hold the {len(gold)} document(s) of a "
            f"question from {qa.path} and the question itself"
        )
    order = [picked[k] for k in rng.permutation(len(picked)).tolist()]
    pieces = [codec.encode(DOCUMENT.format(number=n + 1, text=qa.documents[d])) for n, d in enumerate(order)]
    context = header + [t for piece in pieces for t in piece]
    if len(context) > question_start:  # a tokenizer that spells a smaller number with more tokens
        raise ValueError(f"the numbered documents of a question from {qa.path} outgrew their {question_start} tokens")
    start = question_start - len(context)
    out = haystack.copy()
    out[start:question_start] = context
    out[question_start:answer_start] = question
    written = answer[:answer_len]
    out[answer_start : answer_start + len(written)] = written
    offsets = np.cumsum([start + len(header)] + [len(p) for p in pieces]).tolist()
    gold_at = [k for k, d in enumerate(order) if d in gold]
    asked = frozenset(c for k in gold_at for c in chunks_of(offsets[k], len(pieces[k]), S))
    first = gold_at[0]
    return TaskSample(
        ids=out,
        family="qa",
        answer_start=answer_start,
        answer_len=answer_len,
        needle_start=offsets[first],
        needle_len=len(pieces[first]),
        room=question_start - len(pieces[first]),
        key=item.answers[0],
        answers=item.answers,
        asked_chunks=asked,
    )


def _pick_documents(qa: QASet, codec: Codec, gold: list[int], others: list[int], budget: int) -> list[int] | None:
    """The gold documents, then distractors in ``others``' order until the next one does not fit in ``budget``
    tokens with its numbering; ``None`` when the gold ones do not fit. A document's cost is counted with the
    largest number any document can get, so renumbering them in their final order cannot outgrow the budget (for
    tokenizers that do not spell fewer digits with more tokens; ``build_qa`` checks)."""
    picked: list[int] = []
    used = 0
    for k, doc in enumerate(gold + others):
        cost = len(codec.encode(DOCUMENT.format(number=len(qa.documents), text=qa.documents[doc])))
        if used + cost > budget:
            return None if k < len(gold) else picked
        picked.append(doc)
        used += cost
    return picked
