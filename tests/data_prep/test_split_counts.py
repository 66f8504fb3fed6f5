"""`data_prep.format.split_count_mismatch`: the counts a manifest records, held against the split's ``index.json``.

Every dataset prep writes (single run, sliced and merged) passes; a count off by more than the index can pin
(pieces: 0; tokens: 3 bytes of length per piece, over the id width) is refused, for both token widths and every
width of a piece's stored length (1, 2 or 4 bytes).
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from data_prep import format as fmt
from data_prep.cli import slices_main
from data_prep.config import load_config
from data_prep.merge import merge_slices
from data_prep.safe_files import read_index
from data_prep.streaming_compat import ensure_streaming_importable


def mismatch(root: Path, split: str, manifest: fmt.Manifest, **counts: int) -> str | None:
    """`split_count_mismatch` for ``manifest`` with ``counts`` replacing the recorded ones of ``split``."""
    edited = dataclasses.replace(manifest.splits[split], **counts)
    manifest = dataclasses.replace(manifest, splits={**manifest.splits, split: edited})
    shards = read_index(root / split)[0]["shards"] if (root / split).exists() else []
    return fmt.split_count_mismatch(root, split, manifest, shards)


def slack(stats: fmt.SplitStats, token_dtype: str) -> int:
    """The most tokens the shard sizes leave open: 3 bytes of length per piece (1 to 4), over the id width."""
    return 3 * stats.pieces // np.dtype(token_dtype).itemsize


def assert_pinned(root: Path, manifest: fmt.Manifest) -> None:
    """The recorded counts pass; pieces one off, tokens beyond the slack, or documents above pieces do not."""
    for split, stats in manifest.splits.items():
        assert mismatch(root, split, manifest) is None, split
        over = slack(stats, manifest.token_dtype) + 1
        for tokens in (stats.tokens + over, stats.tokens - over):
            assert f"splits.{split}.tokens={tokens}, but the " in str(mismatch(root, split, manifest, tokens=tokens))
        pieces = stats.pieces + 1
        assert f"splits.{split}.pieces={pieces}, but " in str(mismatch(root, split, manifest, pieces=pieces))
        documents = stats.pieces + 1
        assert f"splits.{split}.documents={documents}" in str(mismatch(root, split, manifest, documents=documents))


def test_a_prepared_dataset_matches_its_index(run_prep, read_split, tmp_path):
    manifest = run_prep(max_piece_tokens=300)
    lengths = [len(sample[fmt.TOKENS]) for sample in read_split(tmp_path / "out" / "train")]
    assert min(lengths) < 256 <= max(lengths), "pieces with 1- and 2-byte stored lengths"
    assert manifest.splits["train"].pieces > manifest.splits["train"].documents, "some documents were cut"
    assert_pinned(tmp_path / "out", manifest)


def test_a_merged_dataset_matches_its_index(corpus, tmp_path):
    args = [f"output={tmp_path / 'merged'}", f"input=[{corpus[0]}]", "tokenizer.vocab_size=400", "progress=false"]
    args += ["val_fraction=0.2", "shard_size_bytes=16384"]
    assert slices_main(["tokenizer", *args]) == 0
    for i in range(2):
        assert slices_main(["slice", "--index", str(i), "--num-slices", "2", *args]) == 0
    assert_pinned(tmp_path / "merged", merge_slices(load_config(None, args), 2))


@pytest.mark.parametrize("token_dtype", ["uint16", "uint32"])
def test_every_length_width_and_token_width(token_dtype, tmp_path):
    ensure_streaming_importable()
    from streaming import MDSWriter

    lengths = [1, 255, 256, 65535, 65536, 70000, 3, 300]  # stored lengths of 1, 2 and 4 bytes
    with MDSWriter(out=str(tmp_path / "train"), columns=fmt.mds_columns(token_dtype), size_limit=1 << 18) as out:
        for doc_id, n in enumerate(lengths):
            out.write({fmt.TOKENS: np.ones(n, token_dtype), fmt.DOC_ID: doc_id, fmt.PIECE: 0})
    assert len(read_index(tmp_path / "train")[0]["shards"]) > 1
    stats = fmt.SplitStats(documents=len(lengths), pieces=len(lengths), tokens=sum(lengths), index_sha256="")
    info = fmt.TokenizerInfo("", 1, "bpe", True, 0, -1, 1, -1)
    manifest = fmt.Manifest(1, token_dtype, info, {"train": stats}, {}, [], {})
    assert_pinned(tmp_path, manifest)
    other = "uint32" if token_dtype == "uint16" else "uint16"
    wrong = mismatch(tmp_path, "train", dataclasses.replace(manifest, token_dtype=other))
    assert wrong == f"{tmp_path / 'manifest.json'} records token_dtype={other}, but {tmp_path}/train/index.json " + (
        f"lists shards of {token_dtype}"
    )


def test_a_split_recorded_empty_holds_no_counts(tmp_path):
    stats = fmt.SplitStats(documents=0, pieces=0, tokens=0, index_sha256=fmt.EMPTY_SPLIT_SHA256)
    info = fmt.TokenizerInfo("", 1, "bpe", True, 0, -1, 1, -1)
    manifest = fmt.Manifest(1, "uint16", info, {"val": stats}, {}, [], {})
    assert mismatch(tmp_path, "val", manifest) is None
    claimed = str(mismatch(tmp_path, "val", manifest, tokens=10**9))
    assert "records splits.val.tokens=1000000000, but the 0 shards" in claimed
    assert "records splits.val.documents=3, but" in str(mismatch(tmp_path, "val", manifest, documents=3))
