"""Synthetic passkey retrieval mixed into pretraining (``data.needle_mix``), as in the paper's NIAH fine-tuning.

A chosen sequence keeps its text as the haystack; a needle sentence holding a random 5-digit pass key overwrites
it at a random depth, and the question followed by the answer is written near the end. The loss is the plain LM
loss over everything, so the model learns to fetch the key from far back through retrieval.

The layout follows the model's chunks, as the paper's data does: the needle never
straddles two chunks, and the question's last token is the first token of a chunk, so the first answer token
is predicted by a chunk whose retrieval was triggered by the landmark of the chunk holding the question. The
evaluation (``pipeline/evaluation/passkey.py``) builds its samples the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NEEDLE = " The pass key is {key}. "
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"


def move_answer_whitespace(
    question: list[int], answer: list[int], decode: Callable[[list[int]], str]
) -> tuple[list[int], list[int]]:
    """Move the answer's leading tokens that decode to pure whitespace (the space before the digits) to the end
    of the question, keeping at least one answer token.

    They are the same for every key, so leaving them in the answer would make its first token trivially
    predictable; after the move the first answer token is the first digit. Returns new lists.
    """
    question, answer = list(question), list(answer)
    while len(answer) > 1 and not decode(answer[:1]).strip():
        question.append(answer.pop(0))
    return question, answer


@dataclass(frozen=True)
class NeedlePlacement:
    needle_start: int
    question_start: int
    answer_start: int
    """The answer's first token; the token before it (the question's last) is the first token of a chunk."""


def place_needle(
    length: int, chunk_size: int, needle_len: int, question_len: int, answer_len: int, depth: float
) -> NeedlePlacement:
    """Chunk-aligned positions for a needle at ``depth`` in [0, 1] of the room before the question.

    Raises:
        ValueError: the sequence cannot hold the needle, the question and the answer.
    """
    S = chunk_size
    answer_start = (length - answer_len - 1) // S * S + 1  # the last chunk start that leaves room for the answer
    question_start = answer_start - question_len
    room = question_start - needle_len  # latest possible needle start
    if question_start < 0 or room < 0:
        raise ValueError(
            f"a sequence of {length} tokens cannot hold a passkey needle ({needle_len} tokens), question "
            f"({question_len}) and answer ({answer_len}) with chunk_size={S}"
        )
    start = int(round(depth * room))
    if needle_len <= S and start % S + needle_len > S:
        start = start // S * S + S - needle_len  # shift left so the needle ends with its chunk, never straddles
    return NeedlePlacement(needle_start=start, question_start=question_start, answer_start=answer_start)


class NeedleInserter:
    """Insert a passkey needle into token sequences.

    Args:
        tokenizer_path: the SentencePiece model the data was tokenized with.
        seq_len: length of the sequences it receives (and returns).
        chunk_size: the model's chunk size (tokens), which the layout aligns to.
    """

    def __init__(self, tokenizer: str | Path | bytes, seq_len: int, chunk_size: int) -> None:
        """``tokenizer``: a SentencePiece model file, or its bytes (as the trainer reads it from a dataset)."""
        import sentencepiece as spm

        if isinstance(tokenizer, bytes):
            self.sp = spm.SentencePieceProcessor(model_proto=tokenizer)
        elif Path(tokenizer).is_file():
            self.sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
        else:
            raise FileNotFoundError(f"data.needle_mix > 0 needs the tokenizer at {tokenizer}")
        self.seq_len, self.chunk_size = seq_len, chunk_size

    def parts(self, key: str) -> tuple[list[int], list[int], list[int]]:
        """Token ids of the needle, the question and the answer for pass key ``key`` (the answer's leading
        whitespace tokens moved into the question, ``move_answer_whitespace``)."""
        needle, question, answer = (self.sp.encode(t.format(key=key)) for t in (NEEDLE, QUESTION, ANSWER))
        question, answer = move_answer_whitespace(question, answer, self.sp.decode)
        return needle, question, answer

    def insert(self, seq: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, slice]:
        """Return a copy of ``seq`` with a needle at a random depth and question + answer near the end, and the
        positions of the answer tokens."""
        key = str(int(rng.integers(10_000, 100_000)))
        needle, question, answer = self.parts(key)
        where = place_needle(len(seq), self.chunk_size, len(needle), len(question), len(answer), rng.random())
        out = seq.copy()
        out[where.needle_start : where.needle_start + len(needle)] = needle
        out[where.question_start : where.answer_start] = question
        answer_span = slice(where.answer_start, where.answer_start + len(answer))
        out[answer_span] = answer
        return out, answer_span
