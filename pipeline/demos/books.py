"""The book collection of ``make demo-lm-gpu``: shards ``gutenberg-*.tar.xz`` of ``<id>.txt`` books, checked and
listed before any work, whole books held out by a seeded rule, then unpacked into a training folder and a held-out
folder (``python -m pipeline.demos.books --books DIR --holdout FILE --out DIR``).

Books are read member by member and written under names this module makes (``<id>.txt``), never extracted by the
names inside the archive. Their bytes are decoded as UTF-8 with invalid bytes replaced and CRLF line ends turned
into LF: prep reads text files as strict UTF-8 and would skip a book with one stray byte.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import re
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from data_prep.safe_write import write_text

SHARD_GLOB = "gutenberg-*.tar.xz"
MEMBER = re.compile(r"(\d+)\.txt")
TRAIN, HELDOUT = "train", "heldout"
INDEX = "index.json"


class BooksError(ValueError):
    """The books folder is unusable; the message names the folder or shard and what is wrong."""


@dataclass(frozen=True)
class Book:
    id: int
    shard: str
    bytes: int


def scan(books: Path) -> dict[int, Book]:
    """Every book of every shard in ``books``, by id, read through once (a truncated or corrupt shard fails here).

    Raises:
        BooksError: no such folder, no shard, a shard that is not a readable tar.xz, a member that is not a
            regular ``<id>.txt`` file, or one id in two places.
    """
    if not books.is_dir():
        raise BooksError(f"--books {books}: not a directory; give the folder holding {SHARD_GLOB}")
    shards = sorted(books.glob(SHARD_GLOB))
    if not shards:
        raise BooksError(f"--books {books}: holds no {SHARD_GLOB} shard")
    found: dict[int, Book] = {}
    for shard in shards:
        try:
            with tarfile.open(shard, mode="r:xz") as tar:
                for member in tar:
                    book = _book(shard, member)
                    if book.id in found:
                        raise BooksError(f"{shard}: book {book.id} is also in {found[book.id].shard}")
                    found[book.id] = book
        except (*_CORRUPT, OSError) as err:
            raise _unreadable(shard, err) from None
    if not found:
        raise BooksError(f"--books {books}: its shards hold no book")
    return found


_CORRUPT = (tarfile.TarError, lzma.LZMAError, EOFError)
"""What reading a damaged or truncated shard raises (an OSError while unpacking is a write into ``out``)."""


def _unreadable(shard: Path, err: BaseException) -> BooksError:
    return BooksError(f"{shard}: not a readable tar.xz shard ({type(err).__name__}: {err})")


def _book(shard: Path, member: tarfile.TarInfo) -> Book:
    match = MEMBER.fullmatch(member.name)
    if match is None or not member.isfile():
        raise BooksError(f"{shard}: member {member.name!r} is not a regular <id>.txt file")
    return Book(int(match.group(1)), shard.name, member.size)


def choose_holdout(
    books: dict[int, Book], count: int, min_bytes: int, long_count: int, long_min_bytes: int, seed: int
) -> dict:
    """Which books are never trained on, drawn before training: ``long_count`` books among those of at least
    ``long_min_bytes`` (the longest contexts need the longest books), then ``count`` among the rest of at least
    ``min_bytes``, each draw a ``random.Random(seed).sample`` of the sorted eligible ids.

    Raises:
        BooksError: too few eligible books, or none left to train on.
    """
    rng = random.Random(seed)
    long_pool = sorted(i for i, b in books.items() if b.bytes >= long_min_bytes)
    if len(long_pool) < long_count:
        raise BooksError(
            f"holdout_long={long_count}: only {len(long_pool)} books hold >= {long_min_bytes} bytes "
            "(holdout_long_min_bytes)"
        )
    long_ids = sorted(rng.sample(long_pool, long_count))
    pool = sorted(i for i, b in books.items() if b.bytes >= min_bytes and i not in long_ids)
    if len(pool) < count:
        raise BooksError(f"holdout={count}: only {len(pool)} more books hold >= {min_bytes} bytes (holdout_min_bytes)")
    ids = sorted(rng.sample(pool, count))
    if len(books) - count - long_count < 1:
        raise BooksError(f"holding out {count + long_count} of {len(books)} books leaves none to train on")
    return {
        "rule": (
            f"random.Random({seed}).sample of the sorted ids: {long_count} of the {len(long_pool)} books of >= "
            f"{long_min_bytes} bytes, then {count} of the {len(pool)} others of >= {min_bytes} bytes"
        ),
        "seed": seed,
        "books": ids,
        "long_books": long_ids,
        "bytes": {str(i): books[i].bytes for i in sorted([*ids, *long_ids])},
    }


def normalise(raw: bytes) -> str:
    """A book's text as prep and eval read it: UTF-8 (invalid bytes replaced), LF line ends."""
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n")


def unpack(books: Path, held_out: set[int], out: Path) -> dict:
    """Write every book of ``books`` to ``out/train/<id>.txt`` or, for ``held_out`` ids, ``out/heldout/<id>.txt``;
    returns (and writes to ``out/index.json``) the counts and bytes of both folders.

    One pass over the shards: the command line has read them all through (``scan``) and drawn ``held_out`` from
    what it found before this stage runs, so a second scan here would only repeat that decompression.

    Raises:
        BooksError: a member that is not a regular ``<id>.txt`` file, an unreadable shard, or a held-out id that
            no shard holds (found after the pass; ``index.json`` is then not written).
    """
    counts = {TRAIN: {"books": 0, "bytes": 0}, HELDOUT: {"books": 0, "bytes": 0}}
    for folder in counts:
        (out / folder).mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    for shard in sorted(books.glob(SHARD_GLOB)):
        try:
            with tarfile.open(shard, mode="r:xz") as tar:
                for member in tar:
                    book = _book(shard, member)
                    source = tar.extractfile(member)
                    assert source is not None, "_book accepts only regular files"
                    text = normalise(source.read())
                    folder = HELDOUT if book.id in held_out else TRAIN
                    write_text(out / folder / f"{book.id}.txt", text)
                    counts[folder]["books"] += 1
                    counts[folder]["bytes"] += len(text.encode("utf-8"))
                    seen.add(book.id)
        except _CORRUPT as err:
            raise _unreadable(shard, err) from None
    missing = sorted(held_out - seen)
    if missing:
        raise BooksError(f"held-out books {missing} are in no shard of {books}")
    write_text(out / INDEX, json.dumps(counts, indent=2) + "\n")
    return counts


def main(argv: list[str] | None = None) -> int:
    """The ``books`` stage: unpack ``--books`` into ``--out`` holding out the ids of ``--holdout`` (the JSON that
    ``choose_holdout`` returned)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--books", required=True)
    parser.add_argument("--holdout", required=True, help="JSON with 'books' and 'long_books' id lists")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    holdout = json.loads(Path(args.holdout).read_text())
    try:
        counts = unpack(Path(args.books), {*holdout["books"], *holdout["long_books"]}, Path(args.out))
    except BooksError as err:
        print(f"books: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
