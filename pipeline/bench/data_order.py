"""How many documents a global batch holds under each data order (``make bench-data-order``), at the paper's batch
(32 sequences of 16K tokens) on a split shaped like PG19 (28,602 books), against uniform random windows over the
concatenated split (the official code's sampler).

The split is synthetic and built in memory: document ``d``'s tokens are all ``d``, so a sequence's documents are its
distinct values. Document lengths are drawn (with replacement, seeded) from the files of ``--lengths-from`` (bytes
divided by ``--bytes-per-token``, about 4 for a 32K BPE on English), or from a log-normal of PG19's mean book
length when no folder is given. Documents are cut into pieces of at most 65,536 tokens and packed into shards of
64 MiB of uint16 tokens, as data prep does by default. The orders are the trainer's own classes
(``pipeline/data/order.py``, ``pipeline/data/reader.py``) reading that split.

Printed per order: documents per global batch (mean, min) and the share of a batch's documents found again in the
next batch.

    python -m pipeline.bench.data_order [--lengths-from DIR] [--documents 28602] [--seq-len 16384] [--batch 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.order import BlockShuffledSequences
from pipeline.data.reader import PackedSequences

EOS = 65535
PIECE_TOKENS = 65536
SHARD_BYTES = 1 << 26
TOKEN_BYTES = 2


class SyntheticSplit:
    """A reader over documents whose tokens are their ids (the interface ``MDSReader`` gives the orders)."""

    def __init__(self, lengths: np.ndarray) -> None:
        pieces = [
            (doc, min(PIECE_TOKENS, int(n) - start))
            for doc, n in enumerate(lengths)
            for start in range(0, int(n), PIECE_TOKENS)
        ]
        self.shards: list[list[tuple[int, int]]] = [[]]
        size = 0
        for doc, n in pieces:
            if size + n * TOKEN_BYTES > SHARD_BYTES and self.shards[-1]:
                self.shards.append([])
                size = 0
            self.shards[-1].append((doc, n))
            size += n * TOKEN_BYTES
        self.num_shards = len(self.shards)
        self.samples_per_shard = np.asarray([len(s) for s in self.shards], dtype=np.int64)
        self.shard_sizes = np.asarray([sum(n for _, n in s) * TOKEN_BYTES for s in self.shards], dtype=np.int64)

    def sample(self, shard: int, index: int) -> tuple[np.ndarray, int]:
        doc, n = self.shards[shard][index]
        return np.full(n, doc, dtype=np.uint16), doc

    def shard_tokens(self, shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        docs = np.asarray([doc for doc, _ in self.shards[shard]], dtype=np.int64)
        lengths = np.asarray([n for _, n in self.shards[shard]], dtype=np.int64)
        return np.repeat(docs, lengths).astype(np.uint16), lengths, docs


def document_lengths(folder: Path | None, documents: int, bytes_per_token: float, seed: int) -> np.ndarray:
    """``documents`` lengths in tokens, drawn from the files of ``folder`` (or PG19's mean book length)."""
    rng = np.random.default_rng(seed)
    if folder is None:
        return np.maximum(1, rng.lognormal(np.log(69_000), 0.8, documents)).astype(np.int64)
    sizes = np.asarray([p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()], dtype=np.float64)
    if not len(sizes):
        raise SystemExit(f"bench-data-order: error: no files under {folder}")
    return np.maximum(1, rng.choice(sizes, documents) / bytes_per_token).astype(np.int64)


def uniform_windows(lengths: np.ndarray, seq_len: int, batch: int, batches: int, seed: int) -> list[np.ndarray]:
    """The documents of ``batches`` batches of uniform random windows over the documents joined with EOS."""
    ends = np.cumsum(lengths + 1)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        starts = rng.integers(0, int(ends[-1]) - seq_len, batch)
        first = np.searchsorted(ends, starts, side="right")
        last = np.searchsorted(ends, starts + seq_len - 1, side="right")
        out.append(np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last)])))
    return out


def stream_batches(stream: Any, batch: int, batches: int) -> list[np.ndarray]:
    out = []
    for _ in range(batches):
        seqs, _ = stream.next(batch)
        out.append(np.unique(seqs[seqs != EOS]))
    return out


def summary(docs: list[np.ndarray]) -> dict[str, float]:
    counts = [len(d) for d in docs]
    again = [len(np.intersect1d(a, b)) / len(a) for a, b in zip(docs, docs[1:])]
    return {"mean": float(np.mean(counts)), "min": float(min(counts)), "again": float(np.mean(again))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths-from", type=Path, help="a folder of text files whose sizes give document lengths")
    parser.add_argument("--bytes-per-token", type=float, default=4.0)
    parser.add_argument("--documents", type=int, default=28_602, help="documents in the split (PG19 train: 28,602)")
    parser.add_argument("--seq-len", type=int, default=16_384)
    parser.add_argument("--batch", type=int, default=32, help="sequences per global batch")
    parser.add_argument("--batches", type=int, default=40, help="global batches measured per order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-mib", type=int, default=64, help="data.shuffle_block_mib of the block order")
    args = parser.parse_args(argv)
    if args.lengths_from is not None and not args.lengths_from.is_dir():
        print(f"bench-data-order: error: --lengths-from {args.lengths_from} is not a folder", file=sys.stderr)
        return 2
    lengths = document_lengths(args.lengths_from, args.documents, args.bytes_per_token, args.seed)
    split = SyntheticSplit(lengths)
    orders = {
        "uniform windows": uniform_windows(lengths, args.seq_len, args.batch, args.batches, args.seed),
        "blocks (default)": stream_batches(
            BlockShuffledSequences(split, seq_len=args.seq_len, seed=args.seed, block_mib=args.block_mib, eos_id=EOS),
            args.batch,
            args.batches,
        ),
        "window (before)": stream_batches(
            PackedSequences(split, seq_len=args.seq_len, seed=args.seed, shuffle=True, window=64, eos_id=EOS),
            args.batch,
            args.batches,
        ),
    }
    source = args.lengths_from or "a log-normal of mean 69K tokens"
    print(
        f"{args.documents:,} documents ({int(lengths.sum()):,} tokens, lengths from {source}), {split.num_shards} "
        f"shards of 64 MiB; {args.batches} global batches of {args.batch} x {args.seq_len} tokens"
    )
    print(f"{'order':<18} {'docs/batch':>10} {'min':>5} {'in next batch':>14}")
    for name, docs in orders.items():
        s = summary(docs)
        print(f"{name:<18} {s['mean']:>10.1f} {s['min']:>5.0f} {s['again']:>13.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
