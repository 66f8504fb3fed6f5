"""Synthetic passkey retrieval mixed into pretraining (``data.needle_mix``), as in the paper's NIAH fine-tuning.

A chosen sequence keeps its book text as the haystack; a needle sentence holding a random 5-digit pass key is
inserted at a random depth, and the question followed by the answer closes the sequence. The loss is the plain
LM loss over everything (GCA-SPEC §4: haystack + needle + question + answer), so the model learns to fetch the
key from far back through retrieval.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"


class NeedleInserter:
    """Insert a passkey needle into token sequences.

    Args:
        tokenizer_path: the SentencePiece model the data was tokenized with.
        seq_len: length of the sequences it receives (and returns).
    """

    def __init__(self, tokenizer_path: str | Path, seq_len: int) -> None:
        import sentencepiece as spm

        if not Path(tokenizer_path).is_file():
            raise FileNotFoundError(f"data.needle_mix > 0 needs the tokenizer at {tokenizer_path}")
        self.sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
        self.seq_len = seq_len

    def parts(self, key: str) -> tuple[list[int], list[int], list[int]]:
        """Token ids of the needle, the question and the answer for pass key ``key``."""
        return (self.sp.encode(NEEDLE.format(key=key)), self.sp.encode(QUESTION), self.sp.encode(" " + key))

    def insert(self, seq: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Return ``seq`` with a needle at a random depth and question + answer at the end (same length).

        Raises:
            ValueError: the sequence is too short to hold the needle, question and answer.
        """
        key = str(int(rng.integers(10_000, 100_000)))
        needle, question, answer = self.parts(key)
        tail = question + answer
        room = self.seq_len - len(needle) - len(tail)
        if room < 1:
            raise ValueError(f"train.seq_len={self.seq_len} is too short for a passkey needle "
                             f"({len(needle) + len(tail)} tokens); set data.needle_mix=0")
        depth = int(rng.integers(0, room + 1))
        haystack = seq[:room]
        out = np.concatenate([haystack[:depth], needle, haystack[depth:], tail]).astype(seq.dtype)
        return out
