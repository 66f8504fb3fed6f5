"""Token sources: built-in filler, text files, and an MDS split (read without writing into it)."""

import numpy as np
import pytest

from pipeline.evaluation.haystack import WORDS, TokenSource
from pipeline.evaluation.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def test_builtin_filler_is_seeded_and_unbounded():
    src = TokenSource("builtin", TOK, seed=1)
    a, b = src.window(5000, np.random.default_rng(0)), src.window(5000, np.random.default_rng(0))
    assert len(a) == 5000 and np.array_equal(a, b)
    text = TOK.decode(a.tolist())
    assert set(text.replace(".", " ").lower().split()[:-1]) <= set(WORDS)  # the last word may be cut
    assert "pass" not in text and "key" not in text  # never imitates the default needle
    assert len(src.prefix(200_000)) == 200_000


def test_text_files_and_directory(tmp_path):
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "a.txt").write_text("first file ")
    assert TOK.decode(TokenSource(str(tmp_path), TOK).prefix(100).tolist()) == "first file second file"
    files = f"{tmp_path / 'b.txt'},{tmp_path / 'a.txt'}"
    assert TOK.decode(TokenSource(files, TOK).prefix(6).tolist()) == "second"
    with pytest.raises(FileNotFoundError, match="is not a file, a directory, an MDS split"):
        TokenSource(str(tmp_path / "missing.txt"), TOK).prefix(10)


def test_mds_split(tmp_path):
    from helpers import write_mds_split

    split = tmp_path / "val"
    write_mds_split(split, [(0, 0, [1, 2, 3]), (0, 1, [4, 5]), (1, 0, [6, 7])])
    before = sorted(p.name for p in split.iterdir())
    for data in (split, tmp_path):  # the split itself, or a prepared-dataset dir (its val split)
        assert TokenSource(str(data), TOK).prefix(100).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert sorted(p.name for p in split.iterdir()) == before  # nothing decompressed into the source
