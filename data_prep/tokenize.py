"""Prep's tokenizers: train a SentencePiece model on a corpus sample, or take one (or a Hugging Face
``tokenizer.json``, ``data_prep.hf_tokenizer``), and encode documents in bounded segments.

A trained model is lossless: identity normalization, no dummy prefix, whitespace kept as-is, byte
fallback for unseen characters, so ``decode(encode(text)) == text`` for any text. Long documents are
encoded in segments of about `SEGMENT_CHARS` characters, cut just before a space that follows a
non-space character. SentencePiece never merges across such a point (it pre-splits words at whitespace),
so the concatenated segment encodings equal the encoding of the whole document for our models, while
the work per call stays bounded and a 50 MB document spreads over all processes. A Hugging Face tokenizer is cut
only where that is provably exact (`segmenter`).
"""

import hashlib
import io
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from data_prep import hf_tokenizer
from data_prep.config import TokenizerConfig
from data_prep.errors import ConfigError, InputError
from data_prep.format import TOKENIZER_FILENAME, TokenizerInfo

logger = logging.getLogger(__name__)

__all__ = [
    "SEGMENT_CHARS",
    "PrepTokenizer",
    "encode_segments",
    "encode_threads",
    "hf_prep_tokenizer",
    "last_split_point",
    "load_processor",
    "load_sentencepiece",
    "segmenter",
    "segments",
    "sentencepiece_prep_tokenizer",
    "tokenizer_info",
    "train_tokenizer",
]

SEGMENT_CHARS = 1 << 18
"""Target characters per encode call; each call's cost is bounded by this, not by the document length."""
_TRAIN_SENTENCE_BYTES = 8192
"""Documents are fed to the trainer as multi-line "sentences" of at most this many bytes, so that newline
pieces (``":\\n"``) can be learned; SentencePiece drops sentences over ``max_sentence_length``."""
_SPLIT_POINT = re.compile(r"(?<=\S) ")
_RFIND_TRIES = 64
"""Spaces `last_split_point` inspects one by one before scanning the rest of the window with `_SPLIT_POINT`."""


def segments(text: str, max_chars: int = SEGMENT_CHARS, cut_hard: bool = True) -> list[str]:
    """Cut ``text`` into consecutive pieces of about ``max_chars`` characters at safe split points.

    A safe point is just before a space preceded by a non-space. A stretch of ``max_chars`` characters
    without one (base64, CJK text) is cut hard; for our lossless models the decoded text is still exact.
    Without ``cut_hard`` such a stretch runs on to the next safe point instead (a hard cut splits a
    pre-token of a Hugging Face byte-level BPE, whose ids then differ from the whole text's).
    """
    if len(text) <= max_chars:
        return [text]
    out: list[str] = []
    start = 0
    while len(text) - start > max_chars:
        window_end = start + max_chars
        # the last safe point in the second half of the window keeps segments between max/2 and max chars
        cut = last_split_point(text, start + max_chars // 2, window_end)
        if cut is None and not cut_hard:
            later = _SPLIT_POINT.search(text, window_end)
            if later is None:
                break
            cut = later.start()
        if cut is None:
            cut = window_end
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def last_split_point(text: str, lo: int, hi: int) -> int | None:
    """The index of the last safe split point (a space after a non-space) with ``lo <= index < hi``, or None.

    ``str.rfind`` walks back from ``hi`` in C, so a window costs the characters after its last safe point, not a
    Python-level match object for every space in it (that was ~0.3 s of the main thread on 7.7 MB of books). A long
    run of spaces falls back to the pattern over what is left of the window, which gives the same index.
    """
    end = hi
    for _ in range(_RFIND_TRIES):
        index = text.rfind(" ", lo, end)
        if index < 1:  # none, or at the text's start, where no character precedes it
            return None
        if not text[index - 1].isspace():
            return index
        end = index
    cut = None
    for m in _SPLIT_POINT.finditer(text, lo, end):
        cut = m.start()
    return cut


Processor = spm.SentencePieceProcessor | hf_tokenizer.HFEncoder
_encode_pools = threading.local()
"""Each encode thread's own one-thread SentencePiece pool (see `encode_segments`)."""


def load_sentencepiece(model_proto: bytes) -> spm.SentencePieceProcessor:
    """A SentencePiece processor from a serialized model (RuntimeError when it is not one)."""
    return spm.SentencePieceProcessor(model_proto=model_proto)


def load_processor(model_proto: bytes) -> Processor:
    """The encoder of a serialized SentencePiece model, or of a Hugging Face ``tokenizer.json``."""
    if hf_tokenizer.is_tokenizer_json(model_proto):
        return hf_tokenizer.HFEncoder(model_proto)
    return load_sentencepiece(model_proto)


def segmenter(model_proto: bytes) -> Callable[[str], list[str]]:
    """How prep cuts a document for this tokenizer: `segments` for SentencePiece; for a ``tokenizer.json``,
    segments without hard cuts where `hf_tokenizer.segment_safe` allows, else the whole document."""
    if not hf_tokenizer.is_tokenizer_json(model_proto):
        return partial(segments, max_chars=SEGMENT_CHARS)
    unsafe = hf_tokenizer.segment_safe(json.loads(model_proto))
    if unsafe is not None:
        logger.info("encoding each document in one call: segments could encode differently (%s)", unsafe)
        return lambda text: [text]
    return partial(segments, max_chars=SEGMENT_CHARS, cut_hard=False)


def encode_threads(num_proc: int, requested: int = 0) -> int:
    """Batch-encode threads for each of ``num_proc`` processes: ``requested`` when set, else the CPUs this
    process may run on divided among the processes (at least 1). SentencePiece's own default (-1) is every core
    in every process: ``num_proc`` x cores threads."""
    if requested:
        return requested
    return max(1, len(os.sched_getaffinity(0)) // num_proc)


def encode_segments(processor: Processor, texts: list[str]) -> list[np.ndarray]:
    """Encode the texts in one single-threaded SentencePiece batch call, each to a uint32 id array (numpy output
    skips building Python ints). A Hugging Face tokenizer's ``encode_batch`` picks its own threads
    (``RAYON_NUM_THREADS``).

    The call runs on a SentencePiece thread pool of one thread that belongs to the calling thread and serves its
    later calls too: without one, every batch call starts a native thread of its own, and encoding the built-in
    corpus in 107 calls on fresh threads took 4-6% more CPU time than on one reused thread (fastest and median of 8
    alternating runs on one core).
    """
    if isinstance(processor, hf_tokenizer.HFEncoder):
        return processor.encode(texts)
    pool = getattr(_encode_pools, "pool", None)
    if pool is None:
        pool = _encode_pools.pool = spm.ThreadPool(1)
    return [
        ids.astype(np.uint32, copy=False)
        for ids in processor.encode(texts, num_threads=1, thread_pool=pool, return_type="numpy")
    ]


def tokenizer_info(model_proto: bytes, trained: bool) -> TokenizerInfo:
    """Describe a serialized SentencePiece model for the manifest."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    model_type = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()
    return TokenizerInfo(
        sha256=hashlib.sha256(model_proto).hexdigest(),
        vocab_size=sp.get_piece_size(),
        model_type=model_type,
        trained=trained,
        unk_id=sp.unk_id(),
        bos_id=sp.bos_id(),
        eos_id=sp.eos_id(),
        pad_id=sp.pad_id(),
    )


@dataclass(frozen=True)
class PrepTokenizer:
    """What a prep run tokenizes with: the bytes its encoder loads (`load_processor`), the files it writes beside the
    splits, and the manifest's description."""

    model: bytes
    """A serialized SentencePiece model or a ``tokenizer.json``."""
    files: dict[str, bytes]
    info: TokenizerInfo


def sentencepiece_prep_tokenizer(model_proto: bytes, trained: bool) -> PrepTokenizer:
    """A SentencePiece model, written as ``tokenizer.model``."""
    return PrepTokenizer(model_proto, {TOKENIZER_FILENAME: model_proto}, tokenizer_info(model_proto, trained))


def hf_prep_tokenizer(path: str) -> PrepTokenizer:
    """``tokenizer.type=hf``: the folder's ``tokenizer.json`` (and ``tokenizer_config.json`` when there is one),
    read once and copied beside the splits byte for byte.

    Raises:
        ConfigError: the folder's files cannot be read or parsed (one line naming ``tokenizer.path``).
    """
    files, tokenizer = hf_tokenizer.read_folder(path)
    written = {hf_tokenizer.TOKENIZER_JSON: files.tokenizer_json}
    if files.config is not None:
        written[hf_tokenizer.TOKENIZER_CONFIG] = files.config
    info = TokenizerInfo(**hf_tokenizer.describe(files, tokenizer))
    logger.info(
        "Hugging Face tokenizer %s: %s, %d ids, eos %d, bos %d",
        path,
        info.model_type,
        info.vocab_size,
        info.eos_id,
        info.bos_id,
    )
    return PrepTokenizer(files.tokenizer_json, written, info)


def _training_sentences(texts: Iterable[str], budget_bytes: int) -> Iterator[str]:
    used = 0
    for text in texts:
        buf: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            encoded = len(line.encode("utf-8"))
            if size + encoded > _TRAIN_SENTENCE_BYTES and buf:
                yield "".join(buf)
                buf, size = [], 0
            # a single line longer than the limit is cut; the trainer would drop it otherwise
            while encoded > _TRAIN_SENTENCE_BYTES:
                head = line[: _TRAIN_SENTENCE_BYTES // 4]
                yield head
                used += len(head.encode("utf-8"))
                line = line[len(head) :]
                encoded = len(line.encode("utf-8"))
            buf.append(line)
            size += encoded
            used += encoded
        if buf:
            yield "".join(buf)
        if used >= budget_bytes:
            return


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig, num_threads: int) -> bytes:
    """Train a lossless SentencePiece model with byte fallback on ``texts``.

    Args:
        texts: the sample documents (the caller chooses them; training stops after ``cfg.sample_bytes``).
        cfg: the tokenizer config; ``cfg.vocab_size`` must be set.
        num_threads: SentencePiece trainer threads.

    Returns:
        The serialized model.

    Raises:
        ConfigError: SentencePiece rejected the settings (typically a vocab too large for the sample).
        InputError: ``texts`` held no text at all.
    """
    assert cfg.vocab_size is not None, "train_tokenizer needs tokenizer.vocab_size"
    writer = io.BytesIO()
    # SentencePiece turns an exception raised by the iterator into a RuntimeError of its own; keep the
    # original (an InputError naming file:line, say) and re-raise it instead.
    reader_errors: list[Exception] = []
    yielded = [0]

    def sentences() -> Iterator[str]:
        try:
            for sentence in _training_sentences(texts, cfg.sample_bytes):
                yielded[0] += 1
                yield sentence
        except Exception as exc:
            reader_errors.append(exc)
            raise

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=writer,
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            character_coverage=cfg.character_coverage,
            byte_fallback=True,
            # lossless: no NFKC, keep every space and newline, no leading "▁" invented at text starts
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=_TRAIN_SENTENCE_BYTES * 4,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=num_threads,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as exc:
        if reader_errors:
            raise reader_errors[0] from None
        if not yielded[0]:  # sentencepiece would only say "[!sentences_.empty()]"
            raise InputError(
                "no text to train the tokenizer on: every document is empty, skipped or in the val "
                "split; add input documents or lower val_fraction"
            ) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "training failed"
        raise ConfigError(
            f"bad value tokenizer.vocab_size={cfg.vocab_size}: sentencepiece: {first} "
            "(use a smaller vocab or a larger tokenizer.sample_bytes)"
        ) from None
    # The proto records the thread count, which does not change the learned pieces; clearing it makes the
    # model file (and its hash in the manifest) a function of the data and settings alone.
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(writer.getvalue())
    proto.trainer_spec.ClearField("num_threads")
    model = proto.SerializeToString()
    pieces = spm.SentencePieceProcessor(model_proto=model).get_piece_size()
    logger.info("trained a %s tokenizer with %d pieces", cfg.model_type, pieces)
    return model
