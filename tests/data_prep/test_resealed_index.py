"""A dataset ``index.json``, ``manifest.json`` or tokenizer someone edited: one line naming the file and the field,
never a traceback from the code that uses the value (issue 64, findings 1 and 7).

``data_prep.safe_files.parse_index`` reads an index through ``data_prep.json_file`` (nesting bounded before the
parse) and takes every field of every shard with its type and range checked; ``read_manifest`` does the same for the
manifest. These are the units; tests/pipeline/test_resealed_inputs.py resealed whole datasets for the trainer.
"""

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from data_prep import format as fmt
from data_prep.dataset_tokenizer import SENTENCEPIECE, TokenizerFiles, folder_tokenizer, manifest_mismatch
from data_prep.safe_files import UnsafeDatasetError, parse_index, read_followed

SHARD = {
    "column_encodings": ["int", "int", "ndarray:uint16"],
    "column_names": ["doc_id", "piece", "tokens"],
    "column_sizes": [8, 8, None],
    "compression": "zstd",
    "format": "mds",
    "hashes": ["xxh64"],
    "raw_data": {"basename": "shard.00000.mds", "bytes": 3968, "hashes": {"xxh64": "b12446589b8adf7c"}},
    "samples": 29,
    "size_limit": 4096,
    "version": 2,
    "zip_data": {"basename": "shard.00000.mds.zstd", "bytes": 1076, "hashes": {"xxh64": "707c1375101ce319"}},
}
"""One shard entry as streaming's MDSWriter writes it for data prep's columns."""
WHERE = "data/train/index.json"


def refused(raw: bytes | str) -> str:
    """The one-line message `parse_index` refuses ``raw`` with."""
    with pytest.raises(UnsafeDatasetError) as info:
        parse_index(raw.encode() if isinstance(raw, str) else raw, WHERE)
    message = str(info.value)
    assert message.startswith(f"{WHERE}: ") and "\n" not in message and len(message) < 400, message
    return message


def index(**fields: object) -> str:
    """An index of one shard whose fields are `SHARD`'s with ``fields`` replacing them (None: removed)."""
    shard = {k: v for k, v in {**SHARD, **fields}.items() if v is not ...}
    return json.dumps({"shards": [shard], "version": 2})


def test_a_shard_as_data_prep_writes_it_parses():
    assert parse_index(index().encode(), WHERE)["shards"][0]["samples"] == 29


def test_200000_deep_nesting_is_refused_before_the_parse():
    started = time.perf_counter()
    message = refused("[" * 200_000 + "]" * 200_000)
    assert "nested 200000 deep" in message, message
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"samples": 1e30}, "field 'shards[0].samples' is 1e+30, expected an integer in [0, 4294967295]"),
        ({"samples": 10**30}, "field 'shards[0].samples' is 1000000000000000000000000000000, expected an integer"),
        ({"samples": None}, "field 'shards[0].samples' is null, expected an integer"),
        ({"samples": -1}, "field 'shards[0].samples' is -1, expected an integer in [0, 4294967295]"),
        ({"raw_data": [1]}, "field 'shards[0].raw_data' is [1], expected an object"),
        ({"raw_data": {**SHARD["raw_data"], "bytes": "9"}}, "field 'shards[0].raw_data.bytes' is \"9\""),
        ({"column_names": None}, "field 'shards[0].column_names' is null, expected a list"),
        ({"column_sizes": [8, 8]}, "field 'shards[0].column_names' does not give one name, encoding and size"),
        ({"hashes": [1]}, "field 'shards[0].hashes' is not a list of hash names"),
        ({"format": "json"}, "field 'shards[0].format' is \"json\", expected one of mds"),
        ({"extra": 1}, "field 'shards[0].extra' is not one an MDS shard has"),
        ({"size_limit": ...}, "field 'shards[0].size_limit' is missing"),
    ],
    ids=[
        "1e30",
        "10**30",
        "null",
        "negative",
        "raw-list",
        "bytes-string",
        "names-null",
        "sizes",
        "hashes",
        "format",
        "unknown",
        "missing",
    ],
)
def test_each_field_of_a_shard_is_checked(fields, expected):
    assert expected in refused(index(**fields))


def test_an_index_that_is_not_an_mds_index_is_one_line():
    assert "field 'shards' is null, expected a list" in refused('{"shards": null, "version": 2}')
    assert "the file is a list, expected an object" in refused("[]")
    assert "not valid JSON" in refused('{"shards": [NaN], "version": 2}')
    assert "not valid JSON" in refused(b"\xff\xfe")


def test_a_resealed_manifest_field_out_of_range_or_nested_deep_is_one_line(tmp_path):
    manifest = fmt.Manifest(
        format_version=fmt.FORMAT_VERSION,
        token_dtype="uint16",
        tokenizer=fmt.TokenizerInfo("ab" * 32, 64, "bpe", True, 0, -1, 1, -1),
        splits={"train": fmt.SplitStats(1, 1, 1, "cd" * 32)},
        skipped={},
        inputs=[],
        config={},
    )
    text = manifest.to_json()
    for old, new, expected in [
        ('"tokens": 1', '"tokens": 1e30', "field 'splits.train.tokens' is 1e+30, expected an integer"),
        ('"vocab_size": 64', '"vocab_size": null', "field 'tokenizer.vocab_size' is null, expected an integer"),
        (f'"sha256": "{"ab" * 32}"', '"sha256": []', "field 'tokenizer.sha256' is [], expected a string"),
        ('"splits": {', '"splits": {"x": ' + "[" * 200_000 + "]" * 200_000 + ", ", "JSON nested 200002 deep"),
    ]:
        assert old in text
        data = text.replace(old, new, 1).encode()
        (tmp_path / fmt.MANIFEST_FILENAME).write_bytes(data)
        (tmp_path / fmt.COMPLETE_MARKER).write_text(hashlib.sha256(data).hexdigest())  # resealed
        with pytest.raises(ValueError) as info:
            fmt.read_manifest(tmp_path)
        assert str(info.value).startswith(f"{tmp_path / fmt.MANIFEST_FILENAME}: {expected}"), str(info.value)
        assert "\n" not in str(info.value)


def test_the_tokenizer_is_held_to_the_manifest_by_kind_and_both_hashes(tmp_path):
    data = b"a sentencepiece model"
    info = fmt.TokenizerInfo(hashlib.sha256(data).hexdigest(), 64, "bpe", True, 0, -1, 1, -1)
    assert manifest_mismatch(tmp_path, info, TokenizerFiles(SENTENCEPIECE, data)) is None
    empty = hashlib.sha256(b"").hexdigest()
    line = str(manifest_mismatch(tmp_path, info, TokenizerFiles(SENTENCEPIECE, b"")))
    assert line.startswith(f"{tmp_path / 'tokenizer.model'} has sha256 {empty}, but ") and info.sha256 in line, line
    assert "is missing" in str(manifest_mismatch(tmp_path, info, None))
    hf = dataclasses.replace(info, type="hf")
    assert "is a sentencepiece tokenizer, but" in str(
        manifest_mismatch(tmp_path, hf, TokenizerFiles(SENTENCEPIECE, data))
    )


def test_an_empty_sentencepiece_model_is_refused_when_loaded_not_at_the_first_encode():
    with pytest.raises(ValueError, match=r"^tokenizer.model is not a SentencePiece model \(0 bytes, no pieces\)$"):
        TokenizerFiles(SENTENCEPIECE, b"").codec()


def test_a_tokenizer_the_user_names_is_read_from_a_regular_file_only(tmp_path):
    os.mkfifo(tmp_path / "tokenizer.model")  # a read would block forever
    with pytest.raises(UnsafeDatasetError, match=rf"^{tmp_path / 'tokenizer.model'} is a FIFO, not a regular file$"):
        folder_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").unlink()
    (tmp_path / "tokenizer.model").mkdir()
    with pytest.raises(UnsafeDatasetError, match="is a directory, not a regular file"):
        folder_tokenizer(tmp_path)
    assert read_followed(tmp_path / "missing") is None
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(UnsafeDatasetError, match="more than the 10 bytes read of it"):
        read_followed(tmp_path / "big", max_size=10)
    (tmp_path / "link").symlink_to(tmp_path / "big")  # an HF cache folder is links: followed
    assert read_followed(tmp_path / "link") == b"x" * 11
    assert folder_tokenizer(Path(tmp_path / "nothing")) is None
