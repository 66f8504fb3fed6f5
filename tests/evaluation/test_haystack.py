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


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[str] = []

    def encode(self, text):
        self.encoded.append(text)
        return super().encode(text)


def test_documents_are_read_one_at_a_time(tmp_path):
    for name, text in (("a.txt", "first"), ("b.txt", "second file"), ("c.txt", "third")):
        (tmp_path / name).write_text(text)
    tok = CountingTokenizer()
    documents = TokenSource(str(tmp_path), tok).documents(filler_len=0)
    assert TOK.decode(next(documents).tolist()) == "first" and tok.encoded == ["first"]
    assert [TOK.decode(d.tolist()) for d in documents] == ["second file", "third"]


def test_documents_of_an_mds_split_and_of_the_builtin_filler(tmp_path):
    from helpers import write_mds_split

    write_mds_split(tmp_path / "val", [(0, 0, [1, 2, 3]), (0, 1, [4, 5]), (1, 0, [6, 7])])
    assert [d.tolist() for d in TokenSource(str(tmp_path), TOK).documents(filler_len=0)] == [[1, 2, 3, 4, 5], [6, 7]]
    one, again = (TokenSource("builtin", TOK, seed=1).documents(300) for _ in range(2))
    first, second = next(one), next(one)
    assert len(first) == len(second) == 300 and not np.array_equal(first, second)
    assert np.array_equal(next(again), first) and np.array_equal(next(again), second)  # seeded


def test_windows_cut_the_token_stream(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefg")
    (tmp_path / "b.txt").write_text("hijk")
    src = TokenSource(str(tmp_path), TOK)
    stream = src.prefix(100)
    assert [w.tolist() for w in src.windows(4, 10)] == [
        stream[i : i + 4].tolist() for i in range(0, len(stream) - 3, 4)
    ]
    assert [w.tolist() for w in src.windows(3, 2)] == [stream[:3].tolist(), stream[3:6].tolist()]
