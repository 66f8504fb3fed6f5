"""Reading a weighted mixture vs one dataset (``make bench-mixture``): tokens/s of the trainer's batches
(``RankBatches.next_step``) over three prepared datasets cut from one against that dataset alone, with the memory
each arm allocates while reading.

The input's training split is cut into three parts of about equal tokens (whole documents, in file order), each
written as a prepared dataset of its own (MDS shards as data prep writes them, same tokenizer, manifest and
``_COMPLETE``), so the arms read the same token data:

- ``one dataset``: ``data.path`` = the input, one order stream;
- ``mixture (sizes)``: ``data.sources`` = the three parts weighted by their tokens;
- ``mixture 0.5/0.3/0.2``: the same parts at those weights (the first part read 1.5 times, the last 0.6).

Each arm is built the way the trainer builds it (``pipeline.train.sources``: the config, ``check_mixture``,
``build_stream``, then ``RankBatches`` for rank 0 of 1) and reads ``--batches`` global batches of ``--batch``
sequences of ``--seq-len`` tokens: by default ``--epochs`` 10 of the input (a part's last, partial epoch costs a
whole decode and layout of its block, which over 10 epochs weighs little, and 10 epochs of 0.5/0.3/0.2 over thirds
end on whole epochs of every part). The arms alternate ``--repeats`` times. The construction of the stream is left
out of the time; the peak of memory allocated while reading (``tracemalloc``) is measured in one more, untimed, run
of each arm, which also warms the page cache. An arm's tokens/s is its median run; its ratio is the median over the
rounds of its tokens/s over one dataset's in the same round (a round's arms run back to back, so a change of the
load other jobs put on the machine between rounds cancels); the same with this process's CPU seconds
(``time.process_time``), which another job's load on the cores changes less.

    python -m pipeline.bench.mixture [--data data/default] [--seq-len 1024] [--batch 16] [--epochs 10 | --batches N]
        [--repeats 7] [--out bench_mixture.json]

The mixture's own work is per read-ahead (``pipeline.data.mixture.READ_AHEAD_TOKENS``: each source's stream
called once, writing its rows into the global batch) and per epoch of each source (a part holds a third of the
input, so it turns over its epochs three times as often); what it saves is the widening to int64, left to the copy
``RankBatches`` makes anyway. Both show most at the default 16 sequences of 1,024 tokens (the shape of ``make
bench-reader``) and on a small input at the paper's ``--batch 32 --seq-len 16384``, where a part holds a few
global batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from data_prep import format as fmt
from data_prep.safe_write import write_bytes, write_text
from data_prep.streaming_compat import ensure_streaming_importable
from pipeline.data.reader import MDSReader, RankBatches, eos_id_of
from pipeline.train.config import TrainConfig, load_config
from pipeline.train.metrics import processor
from pipeline.train.sources import build_stream, check_mixture

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/train/debug.yaml"
PARTS = ("part0", "part1", "part2")
DECLARED = (0.5, 0.3, 0.2)
ARMS = ("one dataset", "mixture (sizes)", "mixture 0.5/0.3/0.2")
TARGET = 0.95
"""The mixture's throughput should stay within 5% of one dataset's."""


def split_three(data: Path, split: str, out: Path) -> dict[str, int]:
    """Cut ``data``'s ``split`` into three prepared datasets ``out/part{0,1,2}`` of about a third of its tokens each
    (whole documents in file order, renumbered pieces; the shard size, compression and hashes of the input); the
    tokens of each."""
    ensure_streaming_importable()
    from streaming import MDSWriter

    manifest = fmt.read_manifest(str(data))
    reader = MDSReader(str(data), split, cache_dir=None)
    shard = json.loads((data / split / "index.json").read_text())["shards"][0]
    options = {key: shard[key] for key in ("size_limit", "hashes") if shard.get(key)}
    rows = [reader.sample(s, i) for s in range(reader.num_shards) for i in range(int(reader.samples_per_shard[s]))]
    total = sum(len(tokens) for tokens, _ in rows)
    written: dict[str, int] = {}
    start = 0
    for number, name in enumerate(PARTS):
        end, target, tokens = start, total * (number + 1) // len(PARTS), sum(written.values())
        while end < len(rows) and (number == len(PARTS) - 1 or tokens < target or rows[end][1] == rows[end - 1][1]):
            tokens += len(rows[end][0])
            end += 1
        root = out / name
        root.mkdir(parents=True)
        pieces: dict[int, int] = {}
        columns = fmt.mds_columns(manifest.token_dtype)
        with MDSWriter(out=str(root / split), columns=columns, compression=shard.get("compression"), **options) as w:
            for ids, doc in rows[start:end]:
                w.write({fmt.TOKENS: ids, fmt.DOC_ID: doc, fmt.PIECE: pieces.get(doc, 0)})
                pieces[doc] = pieces.get(doc, 0) + 1
        index = hashlib.sha256((root / split / "index.json").read_bytes()).hexdigest()
        stats = fmt.SplitStats(
            documents=len(pieces),
            pieces=end - start,
            tokens=sum(len(t) for t, _ in rows[start:end]),
            index_sha256=index,
        )
        for other in manifest.splits:  # the other splits (val) as they are
            if other != split and (data / other).is_dir():
                (root / other).mkdir()
                for path in (data / other).iterdir():
                    write_bytes(root / other / path.name, path.read_bytes())
        for tokenizer in (fmt.TOKENIZER_FILENAME, "tokenizer.json"):
            if (data / tokenizer).is_file():
                write_bytes(root / tokenizer, (data / tokenizer).read_bytes())
        part = dataclasses.replace(
            manifest,
            splits={**manifest.splits, split: stats},
            config={"source": f"pipeline.bench.mixture: part {number} of {data}"},
        )
        text = part.to_json()
        write_text(root / fmt.MANIFEST_FILENAME, text)
        write_text(root / fmt.COMPLETE_MARKER, hashlib.sha256(text.encode()).hexdigest() + "\n")
        written[name] = stats.tokens
        start = end
    return written


def arm_config(
    arm: str, data: Path, parts: dict[str, Path], sizes: dict[str, int], args: Any, work: Path
) -> TrainConfig:
    """The train config of ``arm``: the debug config with the benchmark's sequence length, batches and data."""
    overrides = [
        f"run_dir={work / 'run'}",
        f"train.seq_len={args.seq_len}",
        f"train.global_batch={args.batch}",
        f"train.micro_batch={args.batch}",
        f"train.max_steps={args.batches}",
        "schedule.warmup_steps=0",
        f"data.train_split={args.split}",
    ]
    if arm == "one dataset":
        return load_config(CONFIG, [*overrides, f"data.path={data}"])
    weights = [sizes[name] for name in PARTS] if arm == "mixture (sizes)" else list(DECLARED)
    listed = ", ".join(
        f"{{path: {parts[name]}, label: {name}, weight: {w}, max_repeat: null}}" for name, w in zip(PARTS, weights)
    )
    return load_config(CONFIG, [*overrides, f"data.path={parts[PARTS[0]]}", f"data.sources=[{listed}]"])


def make_batches(cfg: TrainConfig, cache: Path) -> RankBatches:
    """Rank 0 of 1's batches of ``cfg``'s training data, built as the trainer builds them."""
    mixture = check_mixture(cfg)
    stream, _ = build_stream(cfg, mixture, eos_id_of(cfg.data.path), str(cache))
    return RankBatches(
        stream, global_batch=cfg.train.global_batch, micro_batch=cfg.train.micro_batch, rank=0, world_size=1
    )


def read(make: Callable[[], RankBatches], batches: int, trace: bool = False) -> dict[str, Any]:
    """``batches`` steps of a fresh ``make()``: wall and CPU seconds, tokens, tokens per second of each, the
    sequences per source, and with ``trace`` the peak bytes allocated meanwhile (slower: not timed)."""
    rank = make()
    sources: list[np.ndarray] = []
    tokens = 0
    if trace:
        tracemalloc.start()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        tokens += sum(int(t.numel()) for t in rank.next_step())
        sources.append(rank.step_sources)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    out: dict[str, Any] = {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / max(cpu_seconds, 1e-9),
    }
    if trace:
        out["peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    out["sequences_per_source"] = np.bincount(np.concatenate(sources)).tolist()
    return out


def bench(data: Path, args: Any) -> dict[str, Any]:
    """Every arm's median run and peak memory, and the ratios to one dataset (module docstring)."""
    work = Path(tempfile.mkdtemp(prefix="gca-bench-mixture-"))
    try:
        sizes = split_three(data, args.split, work)
        parts = {name: work / name for name in PARTS}
        total = sum(sizes.values())
        if args.batches is None:
            args.batches = max(1, int(args.epochs * total) // (args.seq_len * args.batch))
        configs = {arm: arm_config(arm, data, parts, sizes, args, work) for arm in ARMS}
        makers = {arm: functools.partial(make_batches, cfg, work / "cache") for arm, cfg in configs.items()}
        peaks = {arm: read(make, args.batches, trace=True) for arm, make in makers.items()}
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        for _ in range(args.repeats):
            for arm, make in makers.items():
                runs[arm].append(read(make, args.batches))
        arms = {}
        base = runs["one dataset"]
        for arm in ARMS:
            arms[arm] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[arm]),
                "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in runs[arm]),
                # Each round's arms ran back to back: the ratio within a round cancels the load other jobs put on
                # the machine when it changes between rounds.
                "ratio": statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs[arm], base)),
                "cpu_ratio": statistics.median(
                    r["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] for r, b in zip(runs[arm], base)
                ),
                "tokens_per_s_runs": [r["tokens_per_s"] for r in runs[arm]],
                "tokens": runs[arm][0]["tokens"],
                "seconds": statistics.median(r["seconds"] for r in runs[arm]),
                "peak_bytes": peaks[arm]["peak_bytes"],
                "peak_ratio": peaks[arm]["peak_bytes"] / max(1, peaks["one dataset"]["peak_bytes"]),
                "sequences_per_source": runs[arm][0]["sequences_per_source"],
            }
        return {
            "data": str(data),
            "split": args.split,
            "part_tokens": sizes,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "batches": args.batches,
            "repeats": args.repeats,
            "processor": processor(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "arms": arms,
            "target_ratio": TARGET,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{result['batches']} global batches of {result['batch']} x {result['seq_len']} tokens from "
        f"{result['data']}/{result['split']} (parts of {', '.join(f'{t:,}' for t in result['part_tokens'].values())} "
        f"tokens), median of {result['repeats']}, {result['processor']}"
    )
    print(f"{'arm':<22} {'tokens/s':>14} {'ratio':>7} {'tokens/CPU-s':>14} {'ratio':>7} {'peak MiB':>9} {'ratio':>7}")
    for arm, r in result["arms"].items():
        print(
            f"{arm:<22} {r['tokens_per_s']:>14,.0f} {r['ratio']:>6.3f}x {r['tokens_per_cpu_s']:>14,.0f} "
            f"{r['cpu_ratio']:>6.3f}x {r['peak_bytes'] / 2**20:>9.1f} {r['peak_ratio']:>6.2f}x"
        )
    worst = min(r["ratio"] for arm, r in result["arms"].items() if arm != "one dataset")
    verdict = "ok" if worst >= result["target_ratio"] else "BELOW TARGET"
    print(f"mixture / one dataset throughput: {worst:.3f}x at worst (target >= {result['target_ratio']}x): {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/default", help="a prepared dataset (data prep's output)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16, help="sequences per global batch")
    parser.add_argument("--epochs", type=float, default=10.0, help="passes over the input per run (sets --batches)")
    parser.add_argument("--batches", type=int, default=None, help="global batches per run instead of --epochs")
    parser.add_argument("--repeats", type=int, default=7, help="alternating timed runs of each arm")
    parser.add_argument("--out", help="write the result as JSON here too")
    args = parser.parse_args(argv)
    data = Path(args.data)
    if not (data / fmt.MANIFEST_FILENAME).is_file() or not (data / args.split / "index.json").is_file():
        print(
            f"bench-mixture: error: no prepared dataset with a {args.split} split at {data} (run make prep)",
            file=sys.stderr,
        )
        return 2
    result = bench(data.resolve(), args)
    print_table(result)
    if args.out:
        write_text(Path(args.out), json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
