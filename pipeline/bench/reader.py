"""Trainer reader throughput (``make bench-reader``): ``MDSReader``, which checks and decodes every shard in memory,
against the path it replaced, measured in one run on the same dataset and printed as a ratio, with the bytes each
path wrote (``/proc/self/io``). Then the two data orders the trainer can cut sequences in, over the same reader
and number of sequences: the block order (``pipeline/data/order.py``, the default) against the window order it
replaced, tokens/s and the peak of memory allocated while reading (``tracemalloc``), as ratios.

The baseline, `DiskCacheReader`, is the reader as it was before shards were decoded in memory: each shard's
checked, decompressed bytes written into a cache directory and every sample read back from that file by
streaming's own shard reader (one open, seek and read per sample). Both paths read every sample of the split in
shard order, ``--epochs`` times; the two alternate ``--repeats`` times and the fastest run of each counts.

    python -m pipeline.bench.reader [--data data/default] [--split train] [--epochs 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import functools
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from data_prep import format as fmt
from data_prep.safe_write import write_bytes
from pipeline.data.order import BlockShuffledSequences
from pipeline.data.reader import MDSReader, PackedSequences, eos_id_of

_KEEP_FILES = 4
"""Shard files the baseline kept in its cache, as the old reader did."""


def io_counters() -> dict[str, int]:
    """This process's I/O counters from ``/proc/self/io`` (``wchar``: bytes passed to write calls; ``write_bytes``:
    bytes sent toward storage), or an empty dict where the file does not exist."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    return {key: int(value) for key, value in (line.split(": ") for line in text.splitlines())}


class DiskCacheReader(MDSReader):
    """The baseline: ``MDSReader``'s checked shard bytes written to ``cache`` and each sample read back from the
    file by streaming's shard reader, the last ``_KEEP_FILES`` files kept (see the module docstring)."""

    def __init__(self, root: str, split: str, cache: Path) -> None:
        super().__init__(root, split, cache_dir=None)
        self.cache = cache
        self._files: OrderedDict[int, None] = OrderedDict()
        self._file_readers = []
        for shard in self.shards:
            on_disk = copy.copy(shard)
            on_disk.dirname = str(cache)
            self._file_readers.append(on_disk)

    def sample(self, shard: int, index: int) -> tuple[np.ndarray, int]:
        if shard in self._files:
            self._files.move_to_end(shard)
        else:
            reader = self.shards[shard]
            [(raw, packed)] = reader.file_pairs
            path = self.cache / raw.basename
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(path, self._raw_bytes(raw, packed, reader.compression))
            self._files[shard] = None
            while len(self._files) > _KEEP_FILES:
                old, _ = self._files.popitem(last=False)
                (self.cache / self.shards[old].file_pairs[0][0].basename).unlink(missing_ok=True)
        sample = self._file_readers[shard][int(index)]
        return np.asarray(sample[fmt.TOKENS]), int(sample[fmt.DOC_ID])


def read_all(reader: MDSReader, epochs: int) -> int:
    """Read every sample of ``reader`` in shard order ``epochs`` times; the number of tokens read."""
    tokens = 0
    for _ in range(epochs):
        for shard in range(reader.num_shards):
            for i in range(int(reader.samples_per_shard[shard])):
                tokens += len(reader.sample(shard, i)[0])
    return tokens


def time_path(make: Any, epochs: int) -> dict[str, float]:
    """One timed pass of a fresh reader from ``make()``: seconds, tokens/s, and bytes written meanwhile."""
    before, start = io_counters(), time.perf_counter()
    reader = make()
    tokens = read_all(reader, epochs)
    seconds = time.perf_counter() - start
    after = io_counters()
    return {
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "wchar": after.get("wchar", 0) - before.get("wchar", 0),
        "write_bytes": after.get("write_bytes", 0) - before.get("write_bytes", 0),
    }


def fastest_of(repeats: int, runs: dict[str, Callable[[], dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each of ``runs`` timed ``repeats`` times, alternating: per name, the record of its fastest run."""
    best: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for name, timed in runs.items():
            run = timed()
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    return best


def print_table(first: str, columns: list[tuple[str, str, int, str]], rows: dict[str, dict[str, float]]) -> None:
    """``rows`` under a header: the row's name under ``first``, then each column ``(key, label, width, format)`` of
    its record."""
    print(f"{first:<12} " + " ".join(f"{label:>{width}}" for _, label, width, _ in columns))
    for name, record in rows.items():
        print(f"{name:<12} " + " ".join(f"{record[key]:>{width}{fmt}}" for key, _, width, fmt in columns))


def bench(data: str, split: str, epochs: int, repeats: int) -> dict[str, dict[str, float]]:
    """The fastest of ``repeats`` alternating runs of each path (``memory``: MDSReader; ``disk_cache``: the
    baseline), each a dict of `time_path`."""
    work = Path(tempfile.mkdtemp(prefix="gca-bench-reader-"))
    try:
        return fastest_of(
            repeats,
            {
                "disk_cache": lambda: time_path(
                    lambda: DiskCacheReader(data, split, Path(tempfile.mkdtemp(dir=work))), epochs
                ),
                "memory": lambda: time_path(lambda: MDSReader(data, split, cache_dir=None), epochs),
            },
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def time_order(make: Any, sequences: int, batch: int) -> dict[str, float]:
    """``sequences`` sequences from a fresh stream of ``make()``, ``batch`` at a time (a global batch): seconds,
    tokens/s and the peak bytes allocated meanwhile (the shards' decoded bytes, the block or window, the batch),
    the reader's construction left out of both."""
    stream, tokens = make(), 0
    tracemalloc.start()
    start = time.perf_counter()
    for _ in range(sequences // batch):
        seqs, _ = stream.next(batch)
        tokens += seqs.size
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "tokens": tokens, "peak_bytes": peak}


def bench_orders(
    data: str, split: str, epochs: int, repeats: int, seq_len: int, batch: int
) -> dict[str, dict[str, float]]:
    """The fastest of ``repeats`` alternating runs of each data order over ``epochs`` passes of the split."""
    reader = MDSReader(data, split, cache_dir=None)
    eos = eos_id_of(data)
    tokens = read_all(reader, 1)
    sequences = max(batch, epochs * tokens // seq_len)
    makers = {
        "window": lambda: PackedSequences(
            MDSReader(data, split, cache_dir=None), seq_len=seq_len, seed=0, shuffle=True, window=64, eos_id=eos
        ),
        "blocks": lambda: BlockShuffledSequences(
            MDSReader(data, split, cache_dir=None), seq_len=seq_len, seed=0, block_mib=64, eos_id=eos
        ),
    }
    return fastest_of(
        repeats, {name: functools.partial(time_order, make, sequences, batch) for name, make in makers.items()}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/default", help="a prepared dataset (data prep's output)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the split per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating timed runs of each path")
    parser.add_argument("--seq-len", type=int, default=1024, help="sequence length of the data-order comparison")
    parser.add_argument("--batch", type=int, default=16, help="sequences per global batch of that comparison")
    args = parser.parse_args(argv)
    if not (Path(args.data) / args.split / "index.json").is_file():
        print(f"bench-reader: error: no prepared split at {args.data}/{args.split} (run make prep)", file=sys.stderr)
        return 2
    best = bench(args.data, args.split, args.epochs, args.repeats)
    raw = (
        sum(int(s.file_pairs[0][0].bytes) for s in MDSReader(args.data, args.split, cache_dir=None).shards)
        * args.epochs
    )
    print(
        f"reader over {args.data}/{args.split}: {best['memory']['tokens']:,} tokens per run ({args.epochs} epochs, "
        f"{raw / 2**20:.1f} MiB of decompressed shards), fastest of {args.repeats}"
    )
    for record in best.values():
        record["wchar_mib"], record["write_bytes_mib"] = record["wchar"] / 2**20, record["write_bytes"] / 2**20
    columns = [("tokens_per_s", "tokens/s", 14, ",.0f"), ("seconds", "seconds", 9, ".2f")]
    mib = [("wchar_mib", "wchar MiB", 10, ".1f"), ("write_bytes_mib", "write_bytes MiB", 16, ".1f")]
    print_table("path", [*columns, *mib], best)
    print(f"memory / disk_cache throughput: {best['memory']['tokens_per_s'] / best['disk_cache']['tokens_per_s']:.2f}x")
    orders = bench_orders(args.data, args.split, args.epochs, args.repeats, args.seq_len, args.batch)
    print(
        f"data orders: {orders['blocks']['tokens']:,} tokens in sequences of {args.seq_len}, batches of "
        f"{args.batch}, fastest of {args.repeats}"
    )
    for record in orders.values():
        record["peak_mib"] = record["peak_bytes"] / 2**20
    print_table("order", [*columns, ("peak_mib", "peak MiB", 10, ".1f")], orders)
    print(
        f"blocks / window: throughput {orders['blocks']['tokens_per_s'] / orders['window']['tokens_per_s']:.2f}x, "
        f"peak memory {orders['blocks']['peak_bytes'] / orders['window']['peak_bytes']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
