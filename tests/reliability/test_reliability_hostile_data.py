"""Hostile datasets in every reader (trainer, eval haystack, preflight; the slice merge in
tests/data_prep/test_merge.py): a dataset is never written to, shard names never leave the split directory, only
regular files are read, and each refusal is one line naming the file.

The reference for "never written" is the file system itself: a recursive listing of the dataset with each entry's
type, mode, size, mtime and sha256 (or link target) before and after, plus the bytes of any file a planted
symbolic link points at. Tests may run as root, where ``chmod a-w`` stops nothing, so the listing is what proves it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability_harness import REPO, overrides, train_ranks, write_dataset

from data_prep.safe_files import UnsafeDatasetError, UnsafeShardPathError
from pipeline.data.reader import EmptySplitError, MDSReader, ShardCorruptError
from pipeline.evaluation.haystack import TokenSource
from pipeline.evaluation.tokenizer import ByteTokenizer
from pipeline.train import preflight
from pipeline.train.trainer import main

pytestmark = pytest.mark.reliability


# -- helpers ---------------------------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything observable about ``root``: per entry its type and mode, size, mtime and content hash (regular
    files) or target (symbolic links). Symbolic links are not followed."""
    state: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                detail: object = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                detail = os.readlink(path)
            else:
                detail = None
            state[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, detail)
    return state


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (not hang) if the body blocks, e.g. on opening a FIFO."""

    def expire(*_: object) -> None:
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@contextmanager
def read_only(root: Path) -> Iterator[None]:
    """``chmod -R a-w`` for the body (restored after, so pytest can delete the tree)."""
    paths = [root, *root.rglob("*")]
    modes = {p: os.lstat(p).st_mode for p in paths if not p.is_symlink()}
    for p, mode in modes.items():
        os.chmod(p, mode & ~0o222)
    try:
        yield
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)


def all_samples(reader: MDSReader) -> list[tuple[list[int], int]]:
    return [
        (tokens.tolist(), doc)
        for s in range(reader.num_shards)
        for tokens, doc in (reader.sample(s, i) for i in range(int(reader.samples_per_shard[s])))
    ]


def set_shard_name(split_dir: Path, shard: int, raw: str, packed: str | None) -> None:
    index_path = split_dir / "index.json"
    index = json.loads(index_path.read_text())
    index["shards"][shard]["raw_data"]["basename"] = raw
    if packed is not None:
        index["shards"][shard]["zip_data"]["basename"] = packed
    index_path.write_text(json.dumps(index))


def eval_tokens(data: Path, n: int = 400) -> np.ndarray:
    return TokenSource(str(data), ByteTokenizer()).prefix(n)


# -- never written, even when it invites a write ------------------------------------------------------------


def test_symlinked_tmp_files_in_the_dataset_are_never_written_through(data_copy, tmp_path):
    """Every shard's decompression temp name (``shard.N.mds.tmp``, streaming's) and the raw name itself planted
    as links to a file of the user: training with validation and the eval reader work, the user's file and the
    dataset stay byte-identical, and no shard cache is created (shards are decoded in memory)."""
    victim = tmp_path / "bashrc"
    victim.write_bytes(b"export PATH=/usr/bin\n")
    for packed in data_copy.glob("*/shard.*.mds.zstd"):
        for name in (packed.name.replace(".zstd", ".tmp"), packed.name + ".tmp"):
            (packed.parent / name).symlink_to(victim)
    before = snapshot(data_copy)
    run = tmp_path / "run"
    assert (
        main(None, overrides(run, data_copy, **{"train.max_steps": 3, "train.eval_every": 1, "checkpoint.every": 0}))
        == 0
    )
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "eval"] == [1, 2, 3], "validation read the val split"
    assert len(eval_tokens(data_copy)) == 400
    assert victim.read_bytes() == b"export PATH=/usr/bin\n"
    assert snapshot(data_copy) == before
    assert not (run / "data_cache").exists(), "a local dataset is read without a cache"


def test_read_only_dataset_trains_and_evaluates_unchanged(data_copy, tmp_path):
    """``chmod -R a-w`` on the dataset: training (with validation) and the eval reader work, and -- as root may
    write anyway -- the recursive listing with sizes, mtimes and sha256 is identical afterwards."""
    before = snapshot(data_copy)
    with read_only(data_copy):
        assert (
            main(
                None,
                overrides(
                    tmp_path / "run", data_copy, **{"train.max_steps": 3, "train.eval_every": 3, "checkpoint.every": 0}
                ),
            )
            == 0
        )
        reader = MDSReader(str(data_copy), "val", str(tmp_path / "cache"))
        assert len(all_samples(reader)) > 0
        assert len(eval_tokens(data_copy)) == 400
        reader.close()
    after = snapshot(data_copy)
    assert {k: v[1:] for k, v in after.items()} == {k: v[1:] for k, v in before.items()}


def test_cache_inside_the_dataset_is_refused(data_copy, tmp_path):
    before = snapshot(data_copy)
    for cache in (data_copy, data_copy / "train" / "cache"):
        with pytest.raises(
            UnsafeDatasetError,
            match=rf"data cache {cache} lies inside the dataset .*set "
            r"data.cache_dir \(or run_dir\) to a directory outside",
        ):
            MDSReader(str(data_copy), "train", str(cache))
    assert snapshot(data_copy) == before


# -- names that leave the split, in every reader --------------------------------------------------------------

OUTSIDE = ["../../x.mds", "/tmp/gca-hostile-abs-x.mds", "sub/../../x.mds"]


@pytest.mark.parametrize("name", OUTSIDE)
def test_shard_names_outside_the_split_are_refused_by_every_reader(name, data_copy, tmp_path):
    """The same index check in the trainer's reader, the eval reader and preflight, before any file is opened
    or created: nothing appears outside the split (or anywhere)."""
    for split in ("train", "val"):
        set_shard_name(data_copy / split, 0, name, name + ".zstd")
    (data_copy / "x.mds.zstd").write_bytes((data_copy / "val" / "shard.00001.mds.zstd").read_bytes())
    before, outside = snapshot(tmp_path), Path(name if name.startswith("/") else "/x.mds")
    assert not outside.exists()
    message = rf"index\.json: shard 0 raw_data: shard file name '{name}' is not a plain relative path"
    with pytest.raises(UnsafeShardPathError, match=message):
        MDSReader(str(data_copy), "train", str(tmp_path / "cache"))
    with pytest.raises(UnsafeShardPathError, match=message):
        eval_tokens(data_copy)
    [line] = preflight.check_data(str(data_copy), "train", 64)
    assert line.startswith("data: ") and "is not a plain relative path" in line and "\n" not in line
    assert snapshot(tmp_path) == before, "no file created anywhere under the test dir"
    assert not outside.exists()


# -- only regular files --------------------------------------------------------------------------------------


def _plant(kind: str, path: Path, tmp_path: Path) -> None:
    """Replace ``path`` by a symbolic link to a valid copy of itself, a FIFO or a directory."""
    if kind == "symlink":
        target = tmp_path / "outside.zstd"
        target.write_bytes(path.read_bytes())  # valid bytes: only the link itself is wrong
        path.unlink()
        path.symlink_to(target)
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize(
    "kind,what", [("symlink", "a symbolic link"), ("fifo", "a FIFO"), ("directory", "a directory")]
)
def test_a_shard_that_is_not_a_regular_file_is_refused(kind, what, data_copy, tmp_path):
    """The trainer's reader, the eval reader and preflight refuse (one line naming the file and what it is)
    instead of following the link, blocking on the FIFO or failing inside streaming; nothing is written."""
    for split in ("train", "val"):
        _plant(kind, data_copy / split / "shard.00000.mds.zstd", tmp_path)
    before = snapshot(tmp_path)
    message = rf"{data_copy}/train/shard\.00000\.mds\.zstd is {what}, not a regular file"
    with deadline(30):
        reader = MDSReader(str(data_copy), "train", str(tmp_path / "cache"))
        reader.sample(1, 0)  # other shards still read
        with pytest.raises(UnsafeDatasetError, match=message):
            reader.sample(0, 0)
        reader.close()
        with pytest.raises(UnsafeDatasetError, match=message.replace("train", "val")):
            eval_tokens(data_copy)
        [line] = preflight.check_data(str(data_copy), "train", 64)
    assert line.startswith(f"data: {data_copy}/train/shard.00000.mds.zstd is {what}")
    assert snapshot(tmp_path) == before, "nothing created (no cache either), changed or removed"


def test_a_symlinked_subdirectory_is_refused(data_copy, tmp_path):
    """A name with a directory part (``sub/shard.mds``) is allowed, but ``sub`` may not be a link out."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "shard.00000.mds.zstd").write_bytes((data_copy / "train" / "shard.00000.mds.zstd").read_bytes())
    (data_copy / "train" / "sub").symlink_to(outside)
    set_shard_name(data_copy / "train", 0, "sub/shard.00000.mds", "sub/shard.00000.mds.zstd")
    reader = MDSReader(str(data_copy), "train", str(tmp_path / "cache"))
    with pytest.raises(UnsafeDatasetError, match=r"train/sub is not a real directory \(a symbolic link\?\)"):
        reader.sample(0, 0)


def test_text_directory_with_a_link_or_fifo_is_refused(tmp_path):
    """Eval's text-directory source: a regular file is read, a link out of the directory or a FIFO refused."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world")
    assert len(eval_tokens(corpus, 5)) == 5
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    (corpus / "b.txt").symlink_to(secret)
    with pytest.raises(UnsafeDatasetError, match=rf"{corpus}/b.txt is a symbolic link, not a regular file"):
        eval_tokens(corpus, 5)
    (corpus / "b.txt").unlink()
    os.mkfifo(corpus / "c.txt")
    with deadline(30), pytest.raises(UnsafeDatasetError, match=rf"{corpus}/c.txt is a FIFO"):
        eval_tokens(corpus, 5)


# -- corrupt, empty, remote ------------------------------------------------------------------------------------


def test_shards_are_hash_checked_and_the_reader_gives_the_same_samples(data, data_copy, tmp_path):
    """The reader's samples equal streaming's own reader on the dataset; a flipped byte in a compressed shard is
    a ShardCorruptError naming the file (no write into the dataset on either path)."""
    from data_prep.streaming_compat import ensure_streaming_importable

    ensure_streaming_importable()
    from streaming import StreamingDataset

    ours = all_samples(MDSReader(str(data), "train", str(tmp_path / "cache")))
    theirs = StreamingDataset(
        remote=str(data / "train"), local=str(tmp_path / "streaming"), shuffle=False, batch_size=1
    )
    assert ours == [(theirs[i]["tokens"].tolist(), int(theirs[i]["doc_id"])) for i in range(theirs.num_samples)]
    packed = data_copy / "train" / "shard.00002.mds.zstd"
    raw = bytearray(packed.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    packed.write_bytes(bytes(raw))
    reader = MDSReader(str(data_copy), "train", str(tmp_path / "cache"))
    with pytest.raises(ShardCorruptError, match=rf"Checksum failure: {packed}: xxh64 "):
        reader.sample(2, 0)


def test_empty_split_is_one_clear_line(data_copy, tmp_path):
    """0 samples: the reader and preflight name the split and the fix instead of a streaming traceback."""
    import shutil

    from data_prep import format as fmt
    from data_prep.streaming_compat import ensure_streaming_importable

    ensure_streaming_importable()
    from streaming import MDSWriter

    shutil.rmtree(data_copy / "val")
    with MDSWriter(out=str(data_copy / "val"), columns=fmt.mds_columns("uint16"), compression="zstd", hashes=["xxh64"]):
        pass
    with pytest.raises(
        EmptySplitError,
        match=rf"data split {data_copy}/val holds no samples \(0 shards listed .*"
        "re-run data prep on more documents",
    ):
        MDSReader(str(data_copy), "val", str(tmp_path / "cache"))
    with pytest.raises(EmptySplitError, match="holds no samples"):
        eval_tokens(data_copy)
    assert preflight.check_data(str(data_copy), "train", 64) == []
    [line] = preflight.check_data(str(data_copy), "train", 64, val_split="val")
    assert line.startswith(f"data: {data_copy}/val holds no samples; re-run data prep")


class _FakeRemote:
    """streaming's downloader interface over a local directory standing for ``s3://bucket/ds``."""

    def __init__(self, root: Path, log: list[str]) -> None:
        self.root, self.log = root, log

    def download(self, remote: str, local: str, timeout: float) -> None:
        self.log.append(remote)
        Path(local).write_bytes((self.root / remote.removeprefix("s3://bucket/ds/")).read_bytes())

    def clean_up(self) -> None:
        pass


def test_remote_dataset_reads_through_the_node_cache(data, data_copy, tmp_path, monkeypatch):
    """A remote dataset gives the same samples as the local one, each shard downloaded once into the node's cache
    (a second reader, and a second epoch, download nothing); a damaged cached copy is fetched again; a traversal
    name in a remote index is refused after downloading only the index, creating nothing."""
    from streaming.base.storage.download import CloudDownloader

    fetched: list[str] = []
    monkeypatch.setattr(CloudDownloader, "get", classmethod(lambda cls, url=None: _FakeRemote(data_copy, fetched)))
    local = all_samples(MDSReader(str(data), "train", str(tmp_path / "a")))
    remote = MDSReader("s3://bucket/ds", "train", str(tmp_path / "b"))
    assert all_samples(remote) == local
    shards = sorted(f for f in fetched if f.endswith(".zstd"))
    assert fetched[0] == "s3://bucket/ds/train/index.json" and len(shards) == remote.num_shards == len(fetched) - 1
    fetched.clear()
    remote.close()
    assert all_samples(remote) == all_samples(MDSReader("s3://bucket/ds", "train", str(tmp_path / "b"))) == local
    assert fetched == ["s3://bucket/ds/train/index.json"], "shards come from the node cache once fetched"
    [cache] = (tmp_path / "b").iterdir()
    assert stat.S_IMODE(os.lstat(cache).st_mode) == 0o700 and sorted(p.name for p in cache.iterdir()) == sorted(
        s.removeprefix("s3://bucket/ds/train/") for s in shards
    )
    damaged = cache / "shard.00001.mds.zstd"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"x")
    fetched.clear()
    assert all_samples(MDSReader("s3://bucket/ds", "train", str(tmp_path / "b"))) == local
    assert fetched == ["s3://bucket/ds/train/index.json", "s3://bucket/ds/train/shard.00001.mds.zstd"]
    set_shard_name(data_copy / "train", 0, "../../x.mds", None)
    fetched.clear()
    with pytest.raises(UnsafeShardPathError, match=r"s3://bucket/ds/train/index.json: shard 0 raw_data"):
        MDSReader("s3://bucket/ds", "train", str(tmp_path / "c"))
    assert fetched == ["s3://bucket/ds/train/index.json"]
    assert list((tmp_path / "c").iterdir()) == []


# -- several readers, killed readers ---------------------------------------------------------------------------


def _read_all(data: str, cache: str, results: Any) -> None:
    """One "rank": its own reader over the whole split, the digest of what it read."""
    reader = MDSReader(data, "train", cache)
    results.put((os.getpid(), _digest(all_samples(reader))))


def _digest(samples: list[tuple[list[int], int]]) -> str:
    return hashlib.sha256(json.dumps(samples).encode()).hexdigest()


def test_two_readers_at_once_share_nothing_and_clean_up(data, tmp_path):
    """Two processes (two ranks of one node) reading the whole split at the same time with the same cache_dir:
    both get exactly what a reader in this process gets, the dataset is unchanged, and nothing is written."""
    import multiprocessing

    expected = _digest(all_samples(MDSReader(str(data), "train", str(tmp_path / "ref"))))
    before, cache = snapshot(data), tmp_path / "shared_cache"
    ctx = multiprocessing.get_context("fork")  # the children share this process's imports: no 10 s torch import
    results = ctx.Queue()
    procs = [ctx.Process(target=_read_all, args=(str(data), str(cache), results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len({pid for pid, _ in got}) == 2 and [digest for _, digest in got] == [expected] * 2
    assert snapshot(data) == before
    assert not cache.exists()


# -- slow: two ranks, read-only data with planted links, then the eval CLI -------------------------------------


@pytest.mark.slow
@pytest.mark.dist
def test_two_ranks_train_and_eval_on_a_hostile_read_only_dataset(tmp_path):
    """torchrun with 2 ranks (one shared run_dir, no shard cache) trains with validation on a
    read-only dataset whose ``.tmp`` names link to a file of the user, then ``launch/eval.py`` computes
    perplexity on it; the user's file and the dataset are byte-identical afterwards."""
    data = write_dataset(tmp_path / "data")
    victim = tmp_path / "bashrc"
    victim.write_bytes(b"alias ll='ls -l'\n")
    for packed in data.glob("*/shard.*.mds.zstd"):
        (packed.parent / packed.name.replace(".zstd", ".tmp")).symlink_to(victim)
    before = snapshot(data)
    run = tmp_path / "run"
    with read_only(data):
        result = train_ranks(
            2,
            overrides(
                run,
                data,
                **{"train.max_steps": 3, "train.eval_every": 3, "checkpoint.every": 0, "checkpoint.export": True},
            ),
        )
        assert result.returncode == 0, result.output[-3000:]
        out = tmp_path / "eval"
        cmd = [
            sys.executable,
            str(REPO / "launch/eval.py"),
            "--checkpoint",
            str(run / "export"),
            "--task",
            "ppl",
            "--out",
            str(out),
            "lengths=[64]",
            "score_len=32",
            "ppl_documents=windows",
            "samples=1",
            f"data={data}",
            "progress=false",
        ]
        ev = subprocess.run(
            cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads((out / "ppl.json").read_text())["results"][0]["documents"] == 1
    assert victim.read_bytes() == b"alias ll='ls -l'\n"
    assert snapshot(data) == before
    assert not (run / "data_cache").exists()
