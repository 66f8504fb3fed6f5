"""Token sources for evaluation: the text a perplexity window or a passkey haystack is cut from.

``data`` is one of:
- ``builtin``: endless filler prose -- random sentences over a fixed word list below, seeded, no files at all, so
  a haystack of any length exists offline (the paper does not say what its 16M haystack is);
- ``noise``: RULER's noise haystack, ``NOISE`` repeated (no files);
- ``stdlib``: the Python standard library's source (the data-prep built-in corpus), real text of ~10M+ tokens;
- an MDS split directory (holding ``index.json``), or a prepared dataset directory (its ``val`` split);
- a text file, a comma-separated list of files, or a directory of text files (read recursively, sorted).
Documents are joined with the tokenizer's EOS when it has one.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
from collections.abc import Generator, Iterator
from pathlib import Path

import numpy as np

from data_prep.safe_files import read_regular, stat_regular
from pipeline.evaluation.tokenizer import ByteTokenizer, ModelTokenizer

log = logging.getLogger(__name__)

# Filler vocabulary: plain, frequent words. It avoids every word of the default needles and questions
# ("pass", "key", "number", "special", "magic", "value", "leads") so the haystack never imitates a needle.
WORDS = (
    "the a an of and to in on at by with from over under after before while during through across near far "
    "river mountain forest garden village city road bridge window door table chair letter story song morning "
    "evening night summer winter spring autumn rain wind snow sun moon star cloud field stone tree flower bird "
    "horse dog cat child teacher farmer sailor traveler merchant painter baker friend neighbor stranger family "
    "walked carried watched opened closed painted found lost remembered wrote sang built crossed followed "
    "waited listened smiled wondered gathered returned quiet bright old young small large warm cold green blue "
    "gray golden gentle slow quick happy tired early late long short soft loud distant hidden simple careful"
).split()

_POOL = 2048  # distinct sentences tokenized once per source; haystacks are random sequences of them
NOISE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""``data=noise``: the text RULER repeats as its "noise" haystack."""
UNBOUNDED = ("builtin", "noise")
"""Sources made up on the fly, of any length, with no files."""


def _sentence(rng: np.random.Generator) -> str:
    words = rng.choice(WORDS, size=int(rng.integers(6, 15)))
    return " " + " ".join(words).capitalize() + "."


class TokenSource:
    """Tokens of one ``data`` spec for one tokenizer.

    Args:
        data: see the module docstring.
        tokenizer: encodes text sources (MDS splits are already token ids).
        seed: seeds the built-in filler.
    """

    def __init__(self, data: str, tokenizer: ModelTokenizer | ByteTokenizer, seed: int = 0) -> None:
        self.data, self.tokenizer, self.seed = data, tokenizer, seed
        self._cache = np.zeros(0, dtype=np.int64)
        self._exhausted = False
        if data == "builtin":
            rng = np.random.default_rng(seed)
            self._pool = [np.asarray(tokenizer.encode(_sentence(rng)), dtype=np.int64) for _ in range(_POOL)]
        elif data == "noise":
            self._pool = [np.asarray(tokenizer.encode(NOISE), dtype=np.int64)]
        else:
            self._documents = self._document_iter()

    @property
    def unbounded(self) -> bool:
        return self.data in UNBOUNDED

    def filler(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` tokens of built-in filler prose (``noise``: the noise text repeated)."""
        out: list[np.ndarray] = []
        have = 0
        while have < n:
            picks = rng.integers(0, len(self._pool), size=max(16, (n - have) // 8))
            for i in picks:
                out.append(self._pool[i])
                have += len(self._pool[i])
                if have >= n:
                    break
        return np.concatenate(out)[:n]

    def prefix(self, n: int) -> np.ndarray:
        """The first ``n`` tokens of the corpus (fewer if it is shorter)."""
        if self.unbounded:
            return self.filler(n, np.random.default_rng(self.seed))
        parts = [self._cache]
        have = len(self._cache)
        while have < n and not self._exhausted:
            doc = next(self._documents, None)
            if doc is None:
                self._exhausted = True
                break
            if self.tokenizer.eos_id is not None and have:
                parts.append(np.asarray([self.tokenizer.eos_id], dtype=np.int64))
                have += 1
            parts.append(doc)
            have += len(doc)
        self._cache = np.concatenate(parts)
        return self._cache[:n]

    def documents(self, filler_len: int) -> Generator[np.ndarray, None, None]:
        """The source's documents in order, each read only when asked for; ``builtin``: an endless run of seeded
        filler documents of ``filler_len`` tokens."""
        if self.unbounded:
            return (self.filler(filler_len, np.random.default_rng([self.seed, i])) for i in itertools.count())
        return self._document_iter()

    def windows(self, n: int, count: int) -> list[np.ndarray]:
        """The first ``count`` consecutive non-overlapping windows of ``n`` tokens of the token stream (documents
        joined as ``prefix`` joins them; fewer windows if the stream is shorter)."""
        stream = self.prefix(n * count)
        return [stream[i * n : (i + 1) * n] for i in range(len(stream) // n)]

    def window(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` consecutive tokens at a random offset.

        Raises:
            ValueError: the corpus holds fewer than ``n`` tokens.
        """
        if self.unbounded:
            return self.filler(n, rng)
        stream = self.prefix(4 * n)  # several windows' worth, so offsets vary between samples
        if len(stream) < n:
            raise ValueError(
                f"data={self.data} holds {len(stream)} tokens, fewer than the {n} haystack tokens this "
                "length needs; use shorter lengths or data=builtin (unbounded filler)"
            )
        start = int(rng.integers(0, len(stream) - n + 1))
        return stream[start : start + n]

    def _document_iter(self) -> Generator[np.ndarray, None, None]:
        path = Path(self.data)
        if self.data == "stdlib":
            from data_prep.builtin import corpus_files

            yield from self._text_docs(corpus_files("python_stdlib")[1])
        elif (path / "index.json").is_file():
            yield from _mds_docs(path)
        elif (path / "val" / "index.json").is_file():
            yield from _mds_docs(path / "val")
        elif path.is_dir():
            files = _directory_files(path)
            if not files:
                raise FileNotFoundError(f"data={self.data}: the directory holds no files")
            yield from self._text_docs(files, inside=True)
        else:
            files = [Path(p) for p in self.data.split(",")]
            for p in files:
                if not p.is_file():
                    raise FileNotFoundError(
                        f"data={self.data}: {p} is not a file, a directory, an MDS split, 'builtin' or 'stdlib'"
                    )
            yield from self._text_docs(files)

    def _text_docs(self, files: list[Path], inside: bool = False) -> Iterator[np.ndarray]:
        """Documents of text files; ``inside``: files found in a directory, each read without following a
        symbolic link (named files are the user's choice and are read as named)."""
        for p in files:
            try:
                text = (read_regular(p.parent, p.name) if inside else p.read_bytes()).decode("utf-8")
            except UnicodeDecodeError:
                log.warning("data: skipping %s (not UTF-8 text)", p)
                continue
            if text:
                yield np.asarray(self.tokenizer.encode(text), dtype=np.int64)


def _directory_files(root: Path) -> list[Path]:
    """The non-hidden files below ``root``, sorted. A symbolic link (it may lead out of the directory), FIFO
    (a read that never returns) or device is refused with one line naming it."""
    files = []
    for path in sorted(root.rglob("*")):
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode) or path.name.startswith("."):
            continue
        if not stat.S_ISREG(mode):
            stat_regular(path.parent, path.name)  # raises UnsafeDatasetError naming the file and what it is
        files.append(path)
    return files


def _mds_docs(split: Path) -> Iterator[np.ndarray]:
    """Documents of an MDS split in order (pieces of one ``doc_id`` joined), read the way the trainer reads it:
    the index checked first, regular files only, each shard hash-checked and decoded in memory; nothing is written."""
    from pipeline.data.reader import MDSReader

    reader = MDSReader(str(split.parent), split.name, cache_dir=None)
    try:
        doc_id: int | None = None
        pieces: list[np.ndarray] = []
        for shard in range(reader.num_shards):
            for i in range(int(reader.samples_per_shard[shard])):
                tokens, doc = reader.sample(shard, i)
                if doc != doc_id and pieces:
                    yield np.concatenate(pieces)
                    pieces = []
                doc_id = doc
                pieces.append(tokens.astype(np.int64))
        if pieces:
            yield np.concatenate(pieces)
    finally:
        reader.close()
