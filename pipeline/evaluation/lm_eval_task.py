"""Data of the local lm-eval task ``gca_recall`` (``configs/eval/lm_eval/gca_recall.yaml``), made offline.

Each document is a passage of filler sentences (the evaluation's built-in word list, so no corpus or tokenizer
is needed) followed by the question ``Which sentence appeared above?`` with four candidate sentences: one copied
from early in the passage, three that never appeared. Picking the copied one needs the passage's far end, which
is what retrieval is for; a model that cannot look back scores chance (25%).

``python -m pipeline.evaluation.lm_eval_task [path]`` writes the JSON-lines file the task YAML names (run it from the
repository root, where lm-eval resolves the YAML's relative ``data_files`` path).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from data_prep.safe_write import write_text
from pipeline.evaluation.haystack import WORDS

DATA_FILE = Path("data/lm_eval/gca_recall.jsonl")
"""Where ``configs/eval/lm_eval/gca_recall.yaml`` reads the documents, relative to the working directory."""


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))).capitalize() + "."


def recall_docs(n_docs: int, sentences: int, seed: int = 0) -> list[dict[str, object]]:
    """``n_docs`` documents of ``sentences`` passage sentences each: ``passage``, ``choices`` (4), ``label``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        passage = [_sentence(rng) for _ in range(sentences)]
        decoys = [_sentence(rng) for _ in range(3)]
        label = rng.randrange(4)
        choices = decoys[:label] + [passage[rng.randrange(max(1, sentences // 4))]] + decoys[label:]
        docs.append({"passage": " ".join(passage), "choices": choices, "label": label})
    return docs


def write_recall_data(path: str | Path = DATA_FILE, n_docs: int = 100, sentences: int = 40, seed: int = 0) -> Path:
    """Write the task's documents as JSON lines to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(doc) + "\n" for doc in recall_docs(n_docs, sentences, seed))
    write_text(path, lines)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the documents of the local lm-eval task gca_recall.")
    parser.add_argument("path", nargs="?", default=str(DATA_FILE), help=f"output file (default {DATA_FILE})")
    parser.add_argument("--docs", type=int, default=100, help="documents (default 100)")
    parser.add_argument("--sentences", type=int, default=40, help="passage sentences per document (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_recall_data(args.path, args.docs, args.sentences, args.seed))


if __name__ == "__main__":
    main()
