"""Data prep throughput (``make bench-prep``): prep's tokens/s against a raw SentencePiece batch encode of the same
texts, measured in one run on this machine, for 1 and N tokenizer processes; the tokenizer sample and training
times separately.

Phases, each timed on its own:

- tokenizer sample: reading the input and drawing the documents the tokenizer trains on (``tokenizer_sample``);
- tokenizer training: ``train_tokenizer`` on that sample;
- prep: a whole ``data_prep`` run with that tokenizer given (``tokenizer.model``, so nothing is trained): reading,
  val split, encoding, MDS shards (zstd, xxh64) and manifest, for each ``--procs`` value;
- raw encode: one ``encode(texts, num_threads=<all CPUs>, return_type="numpy")`` call on the texts prep encodes
  (every non-empty document, cut into prep's segments), read into memory before the clock starts.

The process imports streaming (prep's shard writer; 7-9 s on 2 cores) before any clock starts, so that the first
timed prep run does not pay for it.

The ratio is prep tokens/s over raw-encode tokens/s; each figure is the fastest of ``--repeats`` alternating runs
(the ``--procs`` settings in reverse order every other repeat). A shared machine's speed drifts by more than the
differences measured here, within seconds, so the report also gives the median over the repeats of each repeat's
own ratio (prep against the raw encode of the same repeat, a few seconds apart).

    python -m pipeline.bench.prep [--config configs/data/default.yaml] [--procs 1 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sentencepiece as spm

from data_prep import tokenize
from data_prep.config import load_config
from data_prep.errors import PrepError
from data_prep.safe_write import write_bytes
from data_prep.shard import main as prep
from data_prep.shard import tokenizer_sample
from data_prep.sources import SkipCounter, iter_documents, resolve_sources
from data_prep.split import val_split
from data_prep.streaming_compat import ensure_streaming_importable
from pipeline.train.metrics import processor


def bench(config: str | None, overrides: list[str], procs: list[int], repeats: int) -> dict[str, Any]:
    """Every phase of the module docstring: seconds and tokens/s of each, and the ratios."""
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="gca-bench-prep-"))
    try:
        base = [*overrides, "progress=false", "overwrite=true"]
        cfg = load_config(config, [*base, f"output={work / 'sample'}"])
        sources = resolve_sources(cfg)
        start = time.perf_counter()
        sample = list(tokenizer_sample(sources, cfg, val_split(sources, cfg)))
        sample_s = time.perf_counter() - start
        if cfg.tokenizer.model is None:
            start = time.perf_counter()
            model = tokenize.train_tokenizer(sample, cfg.tokenizer, cfg.num_proc)
            train_s: float | None = time.perf_counter() - start
        else:
            model, train_s = Path(cfg.tokenizer.model).read_bytes(), None
        write_bytes(work / "tokenizer.model", model)
        processor = spm.SentencePieceProcessor(model_proto=model)
        texts = [
            part
            for doc in iter_documents(sources, SkipCounter(strict=False, quiet=True))
            if doc.text.strip()
            for part in tokenize.segments(doc.text, tokenize.SEGMENT_CHARS)
        ]
        # A process's first prep imports streaming (7-9 s here: it pulls in torch and transformers); paid once
        # before the clock starts, so that no timed run includes it.
        ensure_streaming_importable()
        importlib.import_module("streaming")
        raw_times: list[float] = []
        prep_times: dict[int, list[float]] = {p: [] for p in procs}
        raw_tokens = prep_tokens = 0
        given = [o for o in base if not o.startswith(("tokenizer.vocab_size=", "tokenizer.model="))]
        for repeat in range(repeats):
            start = time.perf_counter()
            encoded = processor.encode(texts, num_threads=cores, return_type="numpy")
            raw_times.append(time.perf_counter() - start)
            raw_tokens = sum(len(ids) for ids in encoded)
            del encoded
            # Every other repeat in reverse, so that no setting always runs right after the raw encode: the order
            # must not be what tells the settings apart.
            for p in procs if repeat % 2 == 0 else procs[::-1]:
                run_cfg = load_config(
                    config,
                    [
                        *given,
                        "tokenizer.vocab_size=null",
                        f"tokenizer.model={work / 'tokenizer.model'}",
                        f"num_proc={p}",
                        f"output={work / f'out{p}'}",
                    ],
                )
                start = time.perf_counter()
                manifest = prep(run_cfg)
                prep_times[p].append(time.perf_counter() - start)
                prep_tokens = sum(s.tokens for s in manifest.splits.values())
        raw_s = min(raw_times)
        return {
            "cores": cores,
            "documents": len(sample),
            "sample_s": sample_s,
            "train_s": train_s,
            "raw_tokens": raw_tokens,
            "raw_s": raw_s,
            "prep_tokens": prep_tokens,
            "prep": {
                p: {
                    "seconds": min(t),
                    "ratio": (prep_tokens / min(t)) / (raw_tokens / raw_s),
                    "paired_ratio": statistics.median(
                        (prep_tokens / prep_s) / (raw_tokens / raw_i)
                        for prep_s, raw_i in zip(t, raw_times, strict=True)
                    ),
                    "encode_threads": tokenize.encode_threads(p),
                }
                for p, t in prep_times.items()
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/data/default.yaml", help="a data prep config (configs/data/)")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, len(os.sched_getaffinity(0))])
    parser.add_argument("--repeats", type=int, default=2, help="alternating timed runs of raw encode and prep")
    parser.add_argument("overrides", nargs="*", help="prep key=value overrides, e.g. input=books/")
    args = parser.parse_args(argv)
    try:
        r = bench(args.config, args.overrides, args.procs, args.repeats)
    except PrepError as exc:
        print(f"bench-prep: error: {exc}", file=sys.stderr)
        return 2
    train = "given (not trained)" if r["train_s"] is None else f"{r['train_s']:.1f} s"
    print(f"input: {args.config} {' '.join(args.overrides)}; measured on a {processor()}; fastest of {args.repeats}")
    print(f"tokenizer sample: {r['sample_s']:.1f} s ({r['documents']} documents); tokenizer training: {train}")
    raw_rate = r["raw_tokens"] / r["raw_s"]
    print(
        f"raw batch encode ({r['cores']} threads): {r['raw_tokens']:,} tokens in {r['raw_s']:.2f} s = "
        f"{raw_rate:,.0f} tokens/s"
    )
    for p, run in r["prep"].items():
        print(
            f"prep num_proc={p} ({run['encode_threads']} encode threads each): {r['prep_tokens']:,} tokens in "
            f"{run['seconds']:.2f} s = {r['prep_tokens'] / run['seconds']:,.0f} tokens/s, "
            f"{run['ratio']:.2f}x raw encode (median of the repeats' own ratios: {run['paired_ratio']:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
