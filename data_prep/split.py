"""Prep's train/val split: whole documents, chosen by a hash of each document's text.

A document goes to val when ``xxh64(text, seed=split_seed) < val_fraction x 2**64`` (`is_val`): a pure function of
the text, so the split does not depend on file order, process count or slicing, exact duplicates share a split,
and ``val_fraction`` is a share of documents, never of tokens (a document and all its pieces land in one split).

A small corpus may draw no val document at all (8 documents at the default 0.01: 92% of the time), and a trainer
with ``train.eval_every > 0`` then refuses to start. So when ``val_fraction > 0`` and no document hashes into val,
the document with the lowest hash goes there instead (`ValSplit.fallback`), provided another document is left for
train. That is still a pure function of the corpus, and it changes nothing where any document hashes into val (the
lowest hash is then below the threshold already). `val_split` finds it with a hashing pass over all inputs before
the tokenizer sees any text (which must never include val); the pass stops at the first document that hashes into
val, so on a large corpus it reads about ``1 / val_fraction`` documents. Every slice of a sliced run makes the same
pass over all inputs, so its merge still equals a single run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import xxhash

from data_prep.config import PrepConfig
from data_prep.sources import SkipCounter, Source, iter_documents

logger = logging.getLogger(__name__)

__all__ = ["ValSplit", "is_val", "val_split"]


def _hash(text: str, seed: int) -> int:
    return xxhash.xxh64_intdigest(text.encode("utf-8"), seed=seed)


def is_val(text: str, val_fraction: float, seed: int) -> bool:
    """Whether a document's hash falls below ``val_fraction`` (the rule without the fallback).

    Hashing the content (not a position or a random draw) makes the split independent of file order and
    process count, and puts exact duplicates in the same split.
    """
    return _hash(text, seed) < val_fraction * 2.0**64


@dataclass(frozen=True)
class ValSplit:
    """The val rule of one prep run: `is_val`, plus the documents whose hash is ``fallback``."""

    fraction: float
    seed: int
    fallback: int | None = None
    """The corpus's lowest document hash when no document hashed into ``fraction`` (see the module docstring)."""

    def __call__(self, text: str) -> bool:
        digest = _hash(text, self.seed)
        return digest < self.fraction * 2.0**64 or digest == self.fallback


def val_split(sources: list[Source], cfg: PrepConfig) -> ValSplit:
    """The val rule for the corpus of ``sources`` (all inputs, also in a slice of a sliced run).

    Reads documents only until one hashes into ``cfg.val_fraction``. Skipped records are counted by the tokenize
    pass, not here; under ``cfg.strict`` a malformed one stops the run here already, with the same error.
    """
    plain = ValSplit(cfg.val_fraction, cfg.split_seed)
    if cfg.val_fraction == 0:
        return plain
    lowest: tuple[int, str] | None = None
    documents = at_lowest = 0
    for doc in iter_documents(sources, SkipCounter(strict=cfg.strict, quiet=True)):
        if not doc.text.strip():
            continue  # empty documents are skipped by the tokenize pass too
        digest = _hash(doc.text, cfg.split_seed)
        if digest < cfg.val_fraction * 2.0**64:
            return plain
        documents += 1
        if lowest is None or digest < lowest[0]:
            lowest, at_lowest = (digest, doc.where), 1
        elif digest == lowest[0]:
            at_lowest += 1  # exact duplicates: they all go to val, and train must keep a document
    if lowest is None or documents - at_lowest < 1:
        return plain
    logger.info(
        "no document of %d hashed into val_fraction=%s; the one with the lowest hash (%s%s) goes to val instead "
        "(documents, not tokens, are split)",
        documents,
        cfg.val_fraction,
        lowest[1],
        f", and its {at_lowest - 1} exact duplicate(s)" if at_lowest > 1 else "",
    )
    return ValSplit(cfg.val_fraction, cfg.split_seed, fallback=lowest[0])
