"""The per-split document-length histogram of manifest.json (`data_prep.format.LengthHistogram`).

Prep records, per split, documents and tokens by power-of-two document length and every document whose pieces lie
in more than one shard file, with its whole length. Both are held here against an independent count: each shard of
the written split read on its own with streaming's reader, its documents joined by ``doc_id``. The merge of a
sliced run sums the slices' bins and keeps their spanning documents (ids and shard files carry over unchanged);
an older manifest without the field reads as None; a corrupt one is one line naming the field; `bucket_tokens`
matches a naive count and refuses a bound the bins cannot express.
"""

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from data_prep import format as fmt
from data_prep.cli import slices_main
from data_prep.config import load_config
from data_prep.json_file import JsonFileError
from data_prep.merge import merge_slices, slice_dir, slices_root

SMALL = {"shard_size_bytes": 2048, "max_piece_tokens": 96}
"""Shards of ~2 KB and pieces of at most 96 tokens: most documents have several pieces and many cross a shard."""


def naive_bin(length: int) -> int:
    b = 0
    while 2 ** (b + 1) <= length:
        b += 1
    return b


def shard_documents(split_dir: Path, cache: Path) -> tuple[dict[int, int], dict[int, set[int]]]:
    """doc_id -> its length, and doc_id -> the shards holding its pieces, read shard by shard with streaming's own
    MDS reader (each shard's samples from that shard's file alone)."""
    from streaming import StreamingDataset

    ds = StreamingDataset(remote=str(split_dir), local=str(cache), shuffle=False, batch_size=1, validate_hash="xxh64")
    for i in range(len(ds)):
        ds[i]  # fetches and decompresses every shard into the cache
    lengths: dict[int, int] = {}
    shards: dict[int, set[int]] = {}
    for k, shard in enumerate(ds.shards):
        for j in range(shard.samples):
            sample = shard[j]
            doc_id = int(sample[fmt.DOC_ID])
            lengths[doc_id] = lengths.get(doc_id, 0) + len(sample[fmt.TOKENS])
            shards.setdefault(doc_id, set()).add(k)
    return lengths, shards


def expected_histogram(lengths: dict[int, int], shards: dict[int, set[int]]) -> fmt.LengthHistogram:
    bins = max((naive_bin(n) + 1 for n in lengths.values()), default=0)
    documents, tokens = [0] * bins, [0] * bins
    for n in lengths.values():
        documents[naive_bin(n)] += 1
        tokens[naive_bin(n)] += n
    spanning = {str(d): lengths[d] for d, where in shards.items() if len(where) > 1}
    return fmt.LengthHistogram(documents=documents, tokens=tokens, spanning_documents=spanning)


def assert_histograms_match(root: Path, manifest: fmt.Manifest, cache: Path) -> int:
    """Every split's recorded histogram equals the independent count; returns how many documents span shards."""
    spanning = 0
    for split, stats in manifest.splits.items():
        hist = stats.length_histogram
        assert hist is not None, split
        if not manifest.has_split(split):
            assert hist == fmt.LengthHistogram([], [], {}), split
            continue
        lengths, shards = shard_documents(root / split, cache / split)
        assert len(json.loads((root / split / "index.json").read_text())["shards"]) > 1, split
        assert hist == expected_histogram(lengths, shards), split
        assert (sum(hist.documents), sum(hist.tokens)) == (stats.documents, stats.tokens), split
        assert hist.documents[-1] > 0, "no trailing empty bins"
        spanning += len(hist.spanning_documents)
    return spanning


def test_prep_records_the_histogram_and_the_documents_that_cross_shards(run_prep, tmp_path):
    manifest = run_prep(**SMALL)
    assert assert_histograms_match(tmp_path / "out", manifest, tmp_path / "cache") >= 5, "documents cross shards"
    assert fmt.read_manifest(tmp_path / "out") == manifest
    assert manifest.to_json() == fmt.manifest_from_dict(json.loads(manifest.to_json())).to_json()


def test_tails_count_each_split_s_own_part(run_prep, tmp_path):
    """val_unit=tokens: one doc_id in both splits, each histogram counts the part in its split."""
    manifest = run_prep(val_fraction=0.1, val_unit="tokens", **SMALL)
    assert manifest.val_split.unit == "tokens"
    assert assert_histograms_match(tmp_path / "out", manifest, tmp_path / "cache") >= 1


def test_merge_sums_the_bins_and_keeps_the_spanning_documents(corpus, run_prep, tmp_path, caplog):
    args = [f"output={tmp_path / 'merged'}", f"input=[{corpus[0]}]", "tokenizer.vocab_size=400", "progress=false"]
    args += ["val_fraction=0.2", *(f"{k}={v}" for k, v in SMALL.items())]
    assert slices_main(["tokenizer", *args]) == 0
    for i in range(3):
        assert slices_main(["slice", "--index", str(i), "--num-slices", "3", *args]) == 0
    cfg = load_config(None, args)
    (tmp_path / "tok.model").write_bytes((slices_root(cfg) / "tokenizer.model").read_bytes())
    merged = merge_slices(cfg, 3, keep_slices=True)
    assert assert_histograms_match(tmp_path / "merged", merged, tmp_path / "cache") >= 5

    single = run_prep(output=tmp_path / "single", tokenizer__model=tmp_path / "tok.model", **SMALL)
    for split in fmt.SPLITS:  # the same documents: the same bins (ids and shard cuts differ)
        a, b = merged.splits[split].length_histogram, single.splits[split].length_histogram
        assert a is not None and b is not None and (a.documents, a.tokens) == (b.documents, b.tokens), split

    # A slice written before prep recorded histograms: the merged split has none, and says why.
    old = slice_dir(cfg, 1)
    obj = json.loads((old / fmt.MANIFEST_FILENAME).read_text())
    del obj["splits"]["train"]["length_histogram"]
    reseal(old, obj)
    caplog.set_level(logging.WARNING, logger="data_prep.merge")
    again = merge_slices(load_config(None, [*args, "overwrite=true"]), 3)
    assert again.splits["train"].length_histogram is None
    assert again.splits["val"].length_histogram == merged.splits["val"].length_histogram
    assert any("train: slices 1 recorded no length histogram" in r.getMessage() for r in caplog.records)


def reseal(root: Path, obj: dict[str, Any]) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()  # as Manifest.to_json writes it
    (root / fmt.MANIFEST_FILENAME).write_bytes(data)
    (root / fmt.COMPLETE_MARKER).write_text(hashlib.sha256(data).hexdigest() + "\n")


# -- reading manifest.json --------------------------------------------------------------------------------------

_HIST = fmt.LengthHistogram(documents=[1, 0, 2, 1], tokens=[1, 0, 11, 9], spanning_documents={"7": 9, "12": 6})
_MANIFEST = fmt.Manifest(
    format_version=fmt.FORMAT_VERSION,
    token_dtype="uint16",
    tokenizer=fmt.TokenizerInfo("ab" * 32, 400, "bpe", True, 0, 1, 2, -1),
    splits={
        "train": fmt.SplitStats(4, 9, 21, "cd" * 32, length_histogram=_HIST),
        "val": fmt.SplitStats(0, 0, 0, fmt.EMPTY_SPLIT_SHA256, length_histogram=fmt.LengthHistogram([], [], {})),
    },
    skipped={},
    inputs=[],
    config={"output": "x"},
)


def test_the_json_layout_and_its_round_trip(tmp_path):
    obj = json.loads(_MANIFEST.to_json())
    assert obj["splits"]["train"]["length_histogram"] == {
        "documents": [1, 0, 2, 1],
        "tokens": [1, 0, 11, 9],
        "spanning_documents": {"7": 9, "12": 6},
    }
    assert obj["splits"]["val"]["length_histogram"] == {"documents": [], "tokens": [], "spanning_documents": {}}
    reseal(tmp_path, obj)
    assert fmt.read_manifest(tmp_path) == _MANIFEST
    assert (tmp_path / fmt.MANIFEST_FILENAME).read_text() == _MANIFEST.to_json(), "deterministic bytes"


@pytest.mark.parametrize("how", ["absent", "null"])
def test_a_manifest_from_before_the_histogram_reads(how, tmp_path):
    obj = json.loads(_MANIFEST.to_json())
    for split in obj["splits"].values():
        if how == "absent":
            del split["length_histogram"]
        else:
            split["length_histogram"] = None
    reseal(tmp_path, obj)
    manifest = fmt.read_manifest(tmp_path)
    assert all(s.length_histogram is None for s in manifest.splits.values())
    assert manifest.splits["train"].tokens == 21


H = "splits.train.length_histogram"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h.update(documents="x"), f"field '{H}.documents' is \"x\", expected a list"),
        (lambda h: h["documents"].__setitem__(1, -1), f"field '{H}.documents[1]' is -1, expected an integer in [0, "),
        (lambda h: h["tokens"].__setitem__(0, 1.5), f"field '{H}.tokens[0]' is 1.5, expected an integer"),
        (lambda h: h["documents"].__setitem__(0, True), f"field '{H}.documents[0]' is true, expected an integer"),
        (lambda h: h["tokens"].append(0), f"field '{H}.tokens' has 5 bins but '{H}.documents' has 4"),
        (lambda h: h.update(documents=[0] * 65, tokens=[0] * 65), f"field '{H}.documents' has 65 bins, at most 64"),
        (lambda h: h["documents"].__setitem__(0, 2), f"field '{H}.documents' sums to 5, but 'splits.train.documents'"),
        (lambda h: h["tokens"].__setitem__(3, 10), f"field '{H}.tokens' sums to 22, but 'splits.train.tokens' is 21"),
        (lambda h: h.update(tokens=[1, 0, 15, 5]), f"field '{H}.tokens[2]' is 15, but 2 documents of 2**2 to 2**3-1"),
        (lambda h: h.pop("spanning_documents"), f"field '{H}.spanning_documents' is missing"),
        (lambda h: h.update(spanning_documents=[]), f"field '{H}.spanning_documents' is [], expected an object"),
        (lambda h: h["spanning_documents"].update(x=3), f"field '{H}.spanning_documents' has the key \"x\""),
        (lambda h: h["spanning_documents"].update({"-1": 3}), 'has the key "-1", expected a document id'),
        (lambda h: h["spanning_documents"].update({"07": 3}), 'has the key "07", expected a document id'),
        (lambda h: h["spanning_documents"].update({"3": 1}), f"field '{H}.spanning_documents.3' is 1, expected"),
        (lambda h: h["spanning_documents"].update({"3": 22}), f"field '{H}.spanning_documents.3' is 22, expected"),
        (lambda h: h["spanning_documents"].update({"3": "9"}), f"field '{H}.spanning_documents.3' is \"9\""),
        (lambda h: h["spanning_documents"].update({str(i): 2 for i in range(20, 23)}), "names 5 documents, but"),
    ],
)
def test_a_corrupt_histogram_is_one_line_naming_the_field(edit, message, tmp_path):
    obj = json.loads(_MANIFEST.to_json())
    edit(obj["splits"]["train"]["length_histogram"])
    with pytest.raises(JsonFileError) as raised:
        fmt.manifest_from_dict(obj)
    assert message in str(raised.value), str(raised.value)
    reseal(tmp_path, obj)
    with pytest.raises(ValueError) as read:
        fmt.read_manifest(tmp_path)
    line = str(read.value)
    assert "\n" not in line and line.startswith(str(tmp_path / fmt.MANIFEST_FILENAME)) and message in line, line
    assert line.endswith("; re-run prep"), line


def test_a_histogram_that_is_not_an_object_is_one_line():
    obj = json.loads(_MANIFEST.to_json())
    obj["splits"]["val"]["length_histogram"] = [1]
    with pytest.raises(JsonFileError, match=r"field 'splits\.val\.length_histogram' is \[1\], expected an object"):
        fmt.manifest_from_dict(obj)


# -- buckets ----------------------------------------------------------------------------------------------------


def histogram_of(lengths: list[int]) -> fmt.LengthHistogram:
    return expected_histogram(dict(enumerate(lengths)), {})


def test_length_bin():
    for n in [1, 2, 3, 4, 7, 8, 1000, 2**40 - 1, 2**40, 2**63 - 1]:
        assert fmt.length_bin(n) == naive_bin(n), n
    with pytest.raises(ValueError, match="at least 1 token, got 0"):
        fmt.length_bin(0)


def test_bucket_tokens_against_a_naive_count():
    rng = random.Random(0)
    lengths = [rng.choice([1, 2, 3, 5, 64, 65, 127, 128, 4095, 4096, 32767, 32768, 40000, 70000]) for _ in range(300)]
    lengths += [rng.randint(1, 200_000) for _ in range(300)]
    hist = histogram_of(lengths)
    bounds: list[int | None] = [None, 0, *(2**b for b in range(19))]
    checked = 0
    for low in bounds:
        for high in bounds:
            if low and high and low >= high:
                continue
            inside = [n for n in lengths if (low or 0) <= n and (not high or n < high)]
            assert fmt.bucket_tokens(hist, low, high) == (len(inside), sum(inside)), (low, high)
            assert [n for n in lengths if fmt.document_in_bucket(n, low, high)] == inside, (low, high)
            checked += 1
    assert checked > 200
    assert fmt.bucket_tokens(hist, 32768, None) == (
        sum(n >= 32768 for n in lengths),
        sum(n for n in lengths if n >= 32768),
    )
    assert fmt.bucket_tokens(histogram_of([]), 1, 1024) == (0, 0)


@pytest.mark.parametrize(
    ("low", "high", "message"),
    [
        (3, None, "min_tokens=3 is not a power of two"),
        (None, 100, "max_tokens=100 is not a power of two"),
        (1024, 32000, "max_tokens=32000 is not a power of two"),
        (-4, None, "min_tokens=-4 is not a power of two"),
        (4.0, None, "min_tokens=4.0 is not a power of two"),
        (True, None, "min_tokens=True is not a power of two"),
        (64, 64, "min_tokens=64 must be below max_tokens=64"),
        (128, 64, "min_tokens=128 must be below max_tokens=64"),
    ],
)
def test_a_bound_between_bins_is_refused_naming_it(low, high, message):
    hist = histogram_of([1, 100, 5000])
    with pytest.raises(ValueError, match=message):
        fmt.bucket_tokens(hist, low, high)
    with pytest.raises(ValueError, match=message):
        fmt.document_in_bucket(100, low, high)
