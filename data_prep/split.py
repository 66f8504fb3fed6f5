"""Prep's train/val split: whole documents chosen by a hash of their text, or the tail of every document.

Two units (``val_unit``; ``manifest.json`` records the one used as ``val_split.unit``):

- ``documents``: a document goes to val when ``xxh64(text, seed=split_seed) < val_fraction x 2**64`` (`is_val`): a
  pure function of the text, so the split does not depend on file order, process count or slicing, exact duplicates
  share a split, and a document and all its pieces land in one split. A small corpus may draw no val document at
  all (8 documents at the default 0.01: 92% of the time), and a trainer with ``train.eval_every > 0`` then refuses
  to start. So when ``val_fraction > 0`` and no document hashes into val, the document with the lowest hash goes
  there instead (`ValSplit.fallback`), provided another document is left for train; that changes nothing where any
  document hashes into val (the lowest hash is then below the threshold already).
- ``tokens``: the last ``val_fraction`` of every document's text goes to val, the rest to train (`tail_start`). The
  cut is a point just before a space that follows a non-space, the point where prep cuts long documents into
  segments (``data_prep.tokenize.segments``): SentencePiece never merges across it, so the train part's ids followed
  by the val part's are the ids of the whole document, and no token of val is one that train holds. Both parts keep
  the document's id. A document of fewer than ``0.5 / val_fraction`` characters has no tail.

``auto`` (the default) keeps whole documents when they hold out within 2x of ``val_fraction`` of the corpus, and
takes tails when documents do not and tails come closer (five books at 0.01: one whole book is 20%, the tails 1%; a
corpus of short documents at ``val_fraction=1e-6`` keeps its one lowest-hash document, as tails would hold out
nothing). Tokens are not known before the tokenizer is trained on train text only, so shares are measured in
characters. `val_split` decides
with one hashing pass over all inputs before the tokenizer sees any text. The pass ends early once
`SETTLED_VAL_DOCUMENTS` documents have hashed into val and they hold within 2x of ``val_fraction`` of the text read so
far: a large corpus is then decided after about ``16 / val_fraction`` documents, its split unchanged. Otherwise it
reads to the end and decides on the whole corpus. Every slice of a sliced run makes the same pass over all inputs in
the same order, so every slice decides the same way and the merge equals a single run. ``val_unit=documents``
reads only until the first document that hashes into val (about ``1 / val_fraction`` documents); ``tokens`` reads
nothing ahead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import xxhash

from data_prep.config import PrepConfig
from data_prep.sources import SkipCounter, Source, iter_documents
from data_prep.tokenize import last_split_point

logger = logging.getLogger(__name__)

__all__ = ["SETTLED_VAL_DOCUMENTS", "ValSplit", "is_val", "tail_start", "val_split", "why_val_is_empty"]

SETTLED_VAL_DOCUMENTS = 16
"""Val documents after which ``val_unit=auto`` settles on whole documents, when they hold within 2x of
``val_fraction`` of the text read so far (the share of 16 documents of similar size is within ~25% of its mean)."""


def _hash(text: str, seed: int) -> int:
    return xxhash.xxh64_intdigest(text.encode("utf-8"), seed=seed)


def is_val(text: str, val_fraction: float, seed: int) -> bool:
    """Whether a document's hash falls below ``val_fraction`` (the document rule without the fallback).

    Hashing the content (not a position or a random draw) makes the split independent of file order and
    process count, and puts exact duplicates in the same split.
    """
    return _hash(text, seed) < val_fraction * 2.0**64


def tail_start(text: str, val_fraction: float) -> int:
    """Where the val tail of ``text`` begins under ``val_unit=tokens`` (``len(text)``: no tail).

    The tail is about ``val_fraction`` of the text: it starts at the last point before a space that follows a
    non-space within one tail length before ``len(text) x (1 - val_fraction)`` (so it holds 1x to 2x that share),
    or at that very character when there is none (a long run without spaces: the parts are still disjoint text).
    """
    size = round(val_fraction * len(text))
    if size == 0:
        return len(text)
    target = len(text) - size
    if target <= 0:
        return 0
    cut = last_split_point(text, max(target - size, 1), target + 1)
    return target if cut is None else cut


@dataclass(frozen=True)
class ValSplit:
    """The val rule of one prep run: which part of each document goes to val (`val_start`)."""

    fraction: float
    seed: int
    fallback: int | None = None
    """``documents``: the corpus's lowest document hash when no document hashed into ``fraction`` (see the module
    docstring)."""
    unit: str = "documents"
    """``documents`` (whole documents by hash) or ``tokens`` (the tail of every document)."""

    def val_start(self, text: str) -> int:
        """Where the val part of a document begins: ``text[:i]`` is train, ``text[i:]`` val (0: all of it is val)."""
        if self.unit == "tokens":
            return tail_start(text, self.fraction)
        digest = _hash(text, self.seed)
        return 0 if digest < self.fraction * 2.0**64 or digest == self.fallback else len(text)


@dataclass
class _Pass:
    """What the hashing pass saw: document and character counts of the corpus and of its documents hashed into val,
    and the lowest hash with the documents that share it (the fallback)."""

    documents: int = 0
    chars: int = 0
    val_documents: int = 0
    val_chars: int = 0
    lowest: int | None = None
    lowest_where: str = ""
    at_lowest: int = 0
    lowest_chars: int = 0
    tail_chars: int = 0
    """Characters the tails of the documents read would hold (`tail_start`)."""
    settled: bool = False
    """It ended early: ``auto`` settled on whole documents (see the module docstring)."""


def _within_2x(share: float, fraction: float) -> bool:
    return fraction / 2 <= share <= 2 * fraction


def _off_by(share: float, fraction: float) -> float:
    """How far a held-out share is from ``fraction``, as a factor (infinite for nothing held out)."""
    return max(share / fraction, fraction / share) if share > 0 else math.inf


def _hashing_pass(sources: list[Source], cfg: PrepConfig) -> _Pass:
    seen = _Pass()
    threshold = cfg.val_fraction * 2.0**64
    for doc in iter_documents(sources, SkipCounter(strict=cfg.strict, quiet=True)):
        if not doc.text.strip():
            continue  # empty documents are skipped by the tokenize pass too
        digest = _hash(doc.text, cfg.split_seed)
        seen.documents += 1
        seen.chars += len(doc.text)
        seen.tail_chars += len(doc.text) - tail_start(doc.text, cfg.val_fraction)
        if digest < threshold:
            seen.val_documents += 1
            seen.val_chars += len(doc.text)
            if cfg.val_unit == "documents":
                return seen  # the plain hash rule: no fallback needed, nothing more to measure
            share = seen.val_chars / seen.chars
            if seen.val_documents >= SETTLED_VAL_DOCUMENTS and _within_2x(share, cfg.val_fraction):
                seen.settled = True
                return seen
        if seen.lowest is None or digest < seen.lowest:
            seen.lowest, seen.lowest_where, seen.at_lowest, seen.lowest_chars = digest, doc.where, 1, len(doc.text)
        elif digest == seen.lowest:
            seen.at_lowest += 1  # exact duplicates: they all go to val, and train must keep a document
            seen.lowest_chars += len(doc.text)
    return seen


def val_split(sources: list[Source], cfg: PrepConfig) -> ValSplit:
    """The val rule for the corpus of ``sources`` (all inputs, also in a slice of a sliced run).

    Skipped records are counted by the tokenize pass, not here; under ``cfg.strict`` a malformed one stops the run
    here already, with the same error.
    """
    plain = ValSplit(cfg.val_fraction, cfg.split_seed)
    if cfg.val_fraction == 0:
        return plain
    tails = ValSplit(cfg.val_fraction, cfg.split_seed, unit="tokens")
    if cfg.val_unit == "tokens":
        return tails
    seen = _hashing_pass(sources, cfg)
    rule, held_out = plain, seen.val_chars
    if seen.val_documents == 0 and seen.lowest is not None and seen.documents > seen.at_lowest:
        rule, held_out = ValSplit(cfg.val_fraction, cfg.split_seed, fallback=seen.lowest), seen.lowest_chars
    share, tail_share = held_out / max(seen.chars, 1), seen.tail_chars / max(seen.chars, 1)
    if (
        cfg.val_unit == "auto"
        and not seen.settled
        and not _within_2x(share, cfg.val_fraction)
        and _off_by(tail_share, cfg.val_fraction) < _off_by(share, cfg.val_fraction)
    ):
        logger.info(
            "val_unit=auto: whole documents would hold out %.2g%% of the text (%d of %d documents), not within 2x of "
            "val_fraction=%s; holding out the last %s%% of every document instead (val_unit=tokens; "
            "val_unit=documents keeps whole documents)",
            100 * share,
            seen.val_documents or (seen.at_lowest if rule.fallback is not None else 0),
            seen.documents,
            cfg.val_fraction,
            f"{100 * cfg.val_fraction:.3g}",
        )
        return tails
    if rule.fallback is not None:
        logger.info(
            "no document of %d hashed into val_fraction=%s; the one with the lowest hash (%s%s) goes to val instead "
            "(whole documents are held out)",
            seen.documents,
            cfg.val_fraction,
            seen.lowest_where,
            f", and its {seen.at_lowest - 1} exact duplicate(s)" if seen.at_lowest > 1 else "",
        )
    return rule


def why_val_is_empty(unit: str, val_fraction: float) -> str:
    """Why a run with ``val_fraction > 0`` held nothing out, for the warning of a single run and of a merge."""
    if unit == "tokens":
        return (
            f"no document is long enough to have a tail ({0.5 / val_fraction:,.0f} characters or more), or "
            "min_tokens skipped those that are"
        )
    return "the corpus has no second document to hold out, or min_tokens skipped the one chosen"
