"""Fixtures for data-prep tests: a small generated corpus in every supported format, and a prep runner."""

import gzip
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstd

from data_prep.config import load_config
from data_prep.format import Manifest
from data_prep.shard import main as prep_main
from data_prep.streaming_compat import ensure_streaming_importable
from pipeline.train.preflight import clean_stale_shm

ensure_streaming_importable()

# Accents, CJK, Greek, Cyrillic, an emoji, a tab and double spaces: the round trip must keep all of them.
_WORDS = (
    "the river ran past old mills and quiet farms while a train crossed the valley at dawn "
    "theorem proof lemma integral derivative matrix vector compute return value function class "
    "über café naïve résumé 北京 東京 γράμμα слово 🙂 tab\tinside  double  spaces"
).split(" ")


def _doc(rng: random.Random, words: int) -> str:
    lines = []
    while words > 0:
        n = min(words, rng.randint(3, 14))
        lines.append(("    " if rng.random() < 0.3 else "") + " ".join(rng.choice(_WORDS) for _ in range(n)))
        words -= n
    return "\n".join(lines) + ("\n" if rng.random() < 0.5 else "")


@pytest.fixture(autouse=True)
def _clean_streaming_shm() -> Iterator[None]:
    """Streaming leaves /dev/shm/NNNNNN_* after a crash, and its own cleaner misses prefixes other than 0."""
    # Only files no live process maps or holds: other jobs on the machine may be streaming right now.
    clean_stale_shm()
    yield
    clean_stale_shm()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A directory with txt, jsonl, jsonl.gz, jsonl.zst and parquet files, and the list of all its texts."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    texts: list[str] = []

    def make(n: int) -> list[str]:
        out = [_doc(rng, rng.randint(20, 400)) for _ in range(n)]
        texts.extend(out)
        return out

    (root / "books").mkdir()
    for i, text in enumerate(make(12)):
        (root / "books" / f"book{i:02d}.txt").write_text(text, encoding="utf-8")
    lines = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(make(40)))
    (root / "a.jsonl").write_text(lines, encoding="utf-8")
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in make(40))
    zst_lines = "".join(json.dumps({"text": t}) + "\n" for t in make(30))
    (root / "c.jsonl.zst").write_bytes(zstd.compress(zst_lines.encode()))
    pq.write_table(pa.table({"text": make(40), "n": list(range(40))}), root / "d.parquet")
    (root / "README.rst").write_text("not a corpus file; directory inputs skip unknown extensions\n")
    return root, texts


RunPrep = Callable[..., Manifest]


@pytest.fixture
def run_prep(corpus: tuple[Path, list[str]], tmp_path: Path) -> RunPrep:
    """``run_prep(output=..., **overrides)`` runs prep on the corpus with a small trained tokenizer."""

    def run(output: Path | None = None, inputs: list[str] | None = None, **overrides: object) -> Manifest:
        settings: dict[str, object] = {
            "tokenizer.vocab_size": 400,
            "val_fraction": 0.2,
            "progress": False,
            "shard_size_bytes": 16384,  # several shards even for a tiny corpus
        }
        settings.update({k.replace("__", "."): v for k, v in overrides.items()})
        if "tokenizer.model" in settings or "tokenizer.path" in settings:
            settings.pop("tokenizer.vocab_size")
        dotlist = [f"output={output or tmp_path / 'out'}", f"input={json.dumps(inputs or [str(corpus[0])])}"]
        dotlist += [f"{k}={v}" for k, v in settings.items()]
        return prep_main(load_config(None, dotlist))

    return run


ReadSplit = Callable[[Path], list[dict]]


@pytest.fixture
def read_split(tmp_path: Path) -> ReadSplit:
    """Read a split back the way the trainer will: StreamingDataset with remote=<split dir> and a tmp cache."""
    counter = iter(range(1_000_000))

    def read(split_dir: Path) -> list[dict]:
        from streaming import StreamingDataset

        cache = tmp_path / f"cache{next(counter)}"
        ds = StreamingDataset(
            remote=str(split_dir), local=str(cache), shuffle=False, batch_size=1, validate_hash="xxh64"
        )
        return [ds[i] for i in range(len(ds))]

    return read


def _join_documents(samples: list[dict]) -> dict[int, list[int]]:
    docs: dict[int, list[int]] = {}
    next_piece: dict[int, int] = {}
    for s in samples:
        doc_id, piece = int(s["doc_id"]), int(s["piece"])
        assert piece == next_piece.get(doc_id, 0), f"doc {doc_id}: piece {piece} out of order"
        next_piece[doc_id] = piece + 1
        docs.setdefault(doc_id, []).extend(s["tokens"].tolist())
    return docs


@pytest.fixture
def join_documents() -> Callable[[list[dict]], dict[int, list[int]]]:
    """doc_id -> the concatenated tokens of its pieces, checking that pieces are consecutive from 0."""
    return _join_documents
