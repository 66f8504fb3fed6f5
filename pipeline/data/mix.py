"""The retrieval-task mix of pretraining (``data.retrieval_mix``): a share of the training sequences carries a
synthetic retrieval task written over its own real text.

The retrieval tasks are one source of the training mixture (``pipeline.data.mixture``): its schedule decides which
global sequences carry a task, in exactly the source's share of every prefix of the stream; ``data.retrieval_mix``'s
fraction is that share when the run reads one dataset. Which family, and every choice inside a sample, come from one
generator seeded with the run's seed and the sequence's key in its text source, so a sequence gets the same task on
any world size, after a resume and in a second run; the mix needs no state of its own beyond its settings, which a
checkpoint records (``RetrievalMix.describe``). The samples are built by
``pipeline.data.retrieval_tasks.build_task``, the builder the eval uses too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.dataset_tokenizer import SENTENCEPIECE, TokenizerFiles
from pipeline.data.retrieval_tasks import DEFAULT_SHAPE, FAMILIES, Codec, TaskSample, TaskShape, build_task

DRAWS = 32
"""Tries per sequence: names, keys and spots are drawn again when a sample does not fit, which only happens near
the shortest sequence length the dry run accepts (longer names or keys, a needle blocking an extra chunk)."""
DRY_RUN_SEEDS = 64
"""Samples per family built at construction: names and keys vary in length, so many layouts, not one."""


def tokenizer_codec(tokenizer: TokenizerFiles) -> Codec:
    """The ``Codec`` of a dataset's tokenizer as the trainer reads it (a SentencePiece model or a Hugging Face
    ``tokenizer.json``)."""
    codec = tokenizer.codec()
    return Codec(encode=codec.encode, decode=codec.decode)


def sentencepiece_codec(tokenizer: str | Path) -> Codec:
    """The ``Codec`` of a SentencePiece model file.

    Raises:
        FileNotFoundError: no such file.
    """
    if not Path(tokenizer).is_file():
        raise FileNotFoundError(f"the retrieval mix needs the tokenizer at {tokenizer}")
    return tokenizer_codec(TokenizerFiles(SENTENCEPIECE, Path(tokenizer).read_bytes()))


class RetrievalMix:
    """Write retrieval tasks into training sequences.

    Args:
        codec: the tokenizer the data was tokenized with.
        seq_len: length of the sequences it receives (and returns).
        chunk_size: the model's chunk size (tokens), which every layout aligns to.
        fraction: share of the sequences that get a task (recorded; the mixture's schedule applies it).
        families: weight per family (``retrieval_tasks.FAMILIES``) or variant; those of weight 0 are never drawn.
        shape: needles, values, queries, hops and chains per sample.
        variants: name -> (family, shape) of samples drawn under that name with a shape of their own.

    Raises:
        ValueError: an unknown family, a bad weight, or ``seq_len`` cannot hold a family's sample (checked at once
            with a dry run, so a training run stops before its first step).
    """

    def __init__(
        self,
        codec: Codec,
        *,
        seq_len: int,
        chunk_size: int,
        fraction: float,
        families: Mapping[str, float],
        shape: TaskShape = DEFAULT_SHAPE,
        variants: Mapping[str, tuple[str, TaskShape]] | None = None,
    ) -> None:
        self.variants = dict(variants or {})
        unknown = sorted(set(families) - set(FAMILIES) - set(self.variants))
        if unknown:
            raise ValueError(
                f"data.retrieval_mix.families: unknown {unknown}; the families are {list(FAMILIES)}"
                + (f" and the variants {list(self.variants)}" if self.variants else "")
            )
        bad = {name: w for name, w in families.items() if not w >= 0 or w == float("inf")}
        if bad:
            raise ValueError(f"data.retrieval_mix.families: weights must be finite and >= 0; got {bad}")
        self.families = [name for name in [*FAMILIES, *self.variants] if families.get(name, 0) > 0]
        if not self.families:
            raise ValueError(f"data.retrieval_mix.families={dict(families)} gives no family a weight above 0")
        total = sum(families[name] for name in self.families)
        self.probabilities = [families[name] / total for name in self.families]
        shape.check()
        self.codec, self.seq_len, self.chunk_size = codec, seq_len, chunk_size
        self.fraction, self.shape = fraction, shape
        for family in self.families:
            try:
                for seed in range(DRY_RUN_SEEDS):
                    self.insert(np.zeros(seq_len, dtype=np.int64), np.random.default_rng(seed), family)
            except ValueError as err:
                what = f"variant {family}" if family in self.variants else f"family {family}"
                raise ValueError(
                    f"train.seq_len={seq_len} is too short for the retrieval {what} "
                    f"(data.retrieval_mix, {self._shape_of(family)}): {err}"
                ) from None

    def describe(self) -> dict[str, Any]:
        """The settings that decide every mixed sequence; a checkpoint records them and a resume compares."""
        described = {
            "fraction": self.fraction,
            "families": dict(zip(self.families, self.probabilities)),
            "shape": asdict(self.shape),
        }
        if self.variants:  # only then: the settings of a mix without variants read as they always did
            described["variants"] = {
                name: {"family": family, "shape": asdict(shape)} for name, (family, shape) in self.variants.items()
            }
        return described

    def task_for(self, seq: np.ndarray, rng: np.random.Generator) -> TaskSample:
        """The task written over ``seq`` for the sequence whose own generator is ``rng`` (seeded by the caller from
        the sequence's key). The generator's first draw is skipped: it was the draw that picked the sequence when the
        mix was a random share, so a mix of every sequence (``fraction`` 1) writes the tasks it wrote then. One family
        alone is never drawn, so a single-family mix makes the draws the single-variant needle mix always made."""
        rng.random()
        family = self.families[0]
        if len(self.families) > 1:
            family = self.families[int(rng.choice(len(self.families), p=self.probabilities))]
        return self.insert(seq, rng, family)

    def insert(self, seq: np.ndarray, rng: np.random.Generator, family: str, depth: float | None = None) -> TaskSample:
        """A ``family`` (or variant) sample over a copy of ``seq``, drawn again up to ``DRAWS`` times when it does
        not fit.

        Raises:
            ValueError: the last draw's reason, when none fit.
        """
        for _ in range(DRAWS - 1):
            try:
                return self._build(seq, rng, family, depth)
            except ValueError:
                continue
        return self._build(seq, rng, family, depth)

    def _build(self, seq: np.ndarray, rng: np.random.Generator, name: str, depth: float | None) -> TaskSample:
        family, shape = self.variants.get(name, (name, self.shape))
        return build_task(family, seq, self.codec, rng, chunk_size=self.chunk_size, shape=shape, depth=depth)

    def _shape_of(self, name: str) -> str:
        family, shape = self.variants.get(name, (name, self.shape))
        fields = {
            "multikey": ("needles",),
            "multivalue": ("values",),
            "multiquery": ("needles", "queries"),
            "vt": ("chains", "hops"),
            "multihop": ("chains",),
        }.get(family, ())
        if name in self.variants:
            fields = (*fields, "value_kind")
        return ", ".join(f"{key}={getattr(shape, key)}" for key in fields) or "one needle"
