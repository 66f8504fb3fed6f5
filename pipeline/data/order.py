"""The training data order: a fresh shuffle of the whole split every epoch, in blocks that fit in memory.

Each epoch ``e`` of the split:

1. the shards are permuted (generator seeded with ``(seed, e)``) and cut, in that order, into *blocks*: runs of
   consecutive shards whose decoded size stays within ``data.shuffle_block_mib`` (a shard larger than that is a
   block alone). A block's tokens are what a rank holds in memory, so the budget bounds the reader's memory;
2. within a block, the *segments* (the consecutive pieces of one document inside one shard; a document spread over
   shards is one segment per shard) are permuted, joined with the tokenizer's EOS after each, and cut into sequences
   of ``seq_len`` tokens; the last partial sequence of a block is left out this epoch (another tail the next);
3. the block's sequences are permuted and emitted; then the next block, then epoch ``e + 1``.

So every epoch draws another order of documents and of sequences over the whole split (for a corpus that fits one
block: a uniform permutation of all of it), the sequence boundaries move between epochs, and a global batch holds
sequences from as many documents as uniform sampling would, unlike a short window of consecutive text. Which
sequence comes at global index ``i`` is a pure function of the seed, the split and ``i``: the state is four
integers that resume exactly, on any number of ranks. The retrieval mix keys its draws on ``i``.

Designs this follows: Megatron's sample index (documents shuffled, then packed, then samples shuffled), streaming's
block shuffles (``py1b``/``py1br``: a permutation within blocks of shards, which bounds what a reader holds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

MIB = 1 << 20
ORDER = "blocks"
"""The ``order`` a state of this stream records (`PackedSequences` states record none: ``window``)."""


@dataclass
class _Block:
    """One block of one epoch, laid out."""

    joined: np.ndarray
    """The block's documents in this epoch's order, each followed by EOS (the dataset's token dtype)."""
    sequence_order: np.ndarray
    """The block's sequences in the order they are emitted (their positions in `joined`, in sequences)."""
    sequences: np.ndarray
    """`joined` cut into its whole sequences, ``[len(sequence_order), seq_len]`` (a view)."""


class BlockShuffledSequences:
    """The global training sequence stream in the order of the module docstring: ``next(n)`` returns the next
    ``n`` sequences and their global indices.

    Args:
        reader: an ``MDSReader`` (``num_shards``, ``shard_sizes``, ``shard_tokens``).
        seq_len: tokens per sequence.
        seed: data-order seed.
        block_mib: the decoded shard bytes one block may span.
        eos_id: token joined after every segment (``None``/negative: none).
        bucket: keep only the documents whose whole length ``L`` (tokens in this split) has ``low <= L < high``
            (``high`` None: no upper bound); ``(0, None)`` keeps all.
        spanning: the whole length of each document whose samples lie in more than one shard (data prep's
            ``length_histogram.spanning_documents``), which a block that holds one of its shards cannot count.
    """

    def __init__(
        self,
        reader: Any,
        *,
        seq_len: int,
        seed: int,
        block_mib: int,
        eos_id: int | None,
        bucket: tuple[int, int | None] = (0, None),
        spanning: Mapping[int, int] | None = None,
    ) -> None:
        self.reader, self.seq_len, self.seed, self.block_mib = reader, seq_len, seed, block_mib
        self.bucket, self.spanning = bucket, dict(spanning or {})
        self.eos_id = eos_id if eos_id is not None and eos_id >= 0 else None
        self.epoch = 0
        """The epoch of the last sequence emitted (0 before the first)."""
        self._block_index = 0
        self._taken = 0
        """Sequences of the current block already emitted."""
        self._consumed = 0
        """Sequences emitted since the start of the run: the global index of the next one."""
        self._emitted_this_epoch = 0
        self._block: _Block | None = None
        self._blocks_of = (-1, [np.zeros(0, dtype=np.int64)])

    @property
    def token_dtype(self) -> np.dtype:
        """The dataset's token dtype (``fill`` writes it without widening into an ``out`` of that dtype)."""
        return self.reader.token_dtype

    def blocks(self, epoch: int) -> list[np.ndarray]:
        """The shards of each block of ``epoch``, in the order they are read."""
        if self._blocks_of[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.reader.num_shards)
            sizes, budget = self.reader.shard_sizes, self.block_mib * MIB
            blocks: list[np.ndarray] = []
            current: list[int] = []
            size = 0
            for shard in order:
                if current and size + sizes[shard] > budget:
                    blocks.append(np.asarray(current, dtype=np.int64))
                    current, size = [], 0
                current.append(int(shard))
                size += int(sizes[shard])
            blocks.append(np.asarray(current, dtype=np.int64))
            self._blocks_of = (epoch, blocks)
        return self._blocks_of[1]

    def _layout(self, epoch: int, block: int) -> _Block:
        """Read the shards of block ``block`` of ``epoch`` and join its segments in this epoch's order. Holds the
        block's tokens twice while it joins them (the shards' arrays, then the joined one), once after."""
        tokens, slots, starts, lengths = [], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for slot, shard in enumerate(self.blocks(epoch)[block]):
            shard_tokens, sample_lengths, docs = self.reader.shard_tokens(int(shard))
            tokens.append(shard_tokens)
            if not len(docs):
                continue
            first = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])  # a segment starts where the doc id changes
            segment_starts = np.r_[0, np.cumsum(sample_lengths)[:-1]][first]
            segment_lengths = np.add.reduceat(sample_lengths, first)
            if self.bucket != (0, None):
                keep = self._in_bucket(docs[first], segment_lengths)
                first, segment_starts, segment_lengths = first[keep], segment_starts[keep], segment_lengths[keep]
            slots.append(np.full(len(first), slot, dtype=np.int64))
            starts.append(segment_starts)
            lengths.append(segment_lengths)
        slot_of, start_of, length_of = np.concatenate(slots), np.concatenate(starts), np.concatenate(lengths)
        rng = np.random.default_rng([self.seed, epoch, block])
        perm = rng.permutation(len(slot_of))
        eos = 0 if self.eos_id is None else 1
        joined = np.empty(int(length_of.sum()) + eos * len(perm), dtype=tokens[0].dtype)
        if eos:
            joined.fill(self.eos_id)  # every segment's tokens are written over it, leaving the EOS after each
        at = 0
        for segment in perm:
            begin, length = int(start_of[segment]), int(length_of[segment])
            joined[at : at + length] = tokens[int(slot_of[segment])][begin : begin + length]
            at += length + eos
        count = len(joined) // self.seq_len
        return _Block(
            joined=joined,
            sequence_order=rng.permutation(count),
            sequences=joined[: count * self.seq_len].reshape(count, self.seq_len),
        )

    def _in_bucket(self, docs: np.ndarray, segment_lengths: np.ndarray) -> np.ndarray:
        """Which segments belong to a document of the length bucket: a segment is its whole document within one
        shard, unless the document spans shards."""
        whole = segment_lengths.astype(np.int64)
        if self.spanning:
            spanning_ids = np.fromiter(self.spanning, dtype=np.int64, count=len(self.spanning))
            spans = np.isin(docs, spanning_ids)
            whole[spans] = [self.spanning[int(d)] for d in docs[spans]]
        low, high = self.bucket
        return (whole >= low) & (whole < high if high is not None else True)

    def _current_block(self) -> _Block:
        """The block the next sequence comes from, moving on past exhausted blocks and epochs."""
        while True:
            if self._block is None:
                if self._block_index >= len(self.blocks(self.epoch)):
                    self._next_epoch()
                    continue
                self._block = self._layout(self.epoch, self._block_index)
            if self._taken < len(self._block.sequence_order):
                return self._block
            self._block, self._block_index, self._taken = None, self._block_index + 1, 0

    def _next_epoch(self) -> None:
        if self._emitted_this_epoch == 0:
            raise ValueError(
                f"no block of the training split holds train.seq_len={self.seq_len} tokens (blocks of at most "
                f"data.shuffle_block_mib={self.block_mib} MiB of shards): raise data.shuffle_block_mib, lower "
                "train.seq_len, or prepare more data"
            )
        self.epoch, self._block_index, self._taken, self._emitted_this_epoch = self.epoch + 1, 0, 0, 0

    def next(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` sequences ``[n, seq_len]`` (int64) and their global indices ``[n]``."""
        out = np.empty((n, self.seq_len), dtype=np.int64)
        return out, self.fill(out, None)[0]

    def fill(self, out: np.ndarray, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Write the next sequences into rows ``rows`` of ``out`` (``None``: every row, in order); their global
        indices and epochs. A mixture's sources write straight into the global batch this way, with no copy of
        their own."""
        n = len(out) if rows is None else len(rows)
        epochs = np.empty(n, dtype=np.int64)
        done = 0
        while done < n:
            block = self._current_block()
            take = min(n - done, len(block.sequence_order) - self._taken)
            picked = block.sequences[block.sequence_order[self._taken : self._taken + take]]
            out[slice(done, done + take) if rows is None else rows[done : done + take]] = picked
            epochs[done : done + take] = self.epoch
            done, self._taken = done + take, self._taken + take
            self._emitted_this_epoch += take
        ids = np.arange(self._consumed, self._consumed + n, dtype=np.int64)
        self._consumed += n
        return ids, epochs

    def state_dict(self) -> dict[str, Any]:
        return {
            "order": ORDER,
            "epoch": self.epoch,
            "block": self._block_index,
            "taken": self._taken,
            "consumed": self._consumed,
            "emitted_this_epoch": self._emitted_this_epoch,
            "seq_len": self.seq_len,
            "block_mib": self.block_mib,
            "seed": self.seed,
            "shuffle": True,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("order", "window") != ORDER:
            raise ValueError(
                "cannot resume the data stream: the checkpoint was written with data.shuffle_scope=window (the "
                "order before each epoch was reshuffled); set data.shuffle_scope=window to resume it"
            )
        for key, mine in (("seq_len", self.seq_len), ("block_mib", self.block_mib), ("seed", self.seed)):
            if state[key] != mine:
                raise ValueError(
                    f"cannot resume the data stream: checkpoint has {key}={state[key]!r}, the config gives {mine!r} "
                    "(the sequence order would change)"
                )
        self.epoch, self._block_index = int(state["epoch"]), int(state["block"])
        self._taken, self._consumed = int(state["taken"]), int(state["consumed"])
        self._emitted_this_epoch = int(state["emitted_this_epoch"])
        self._block = None


def epochs_needed(split_tokens: int, documents: int, eos: bool, tokens_needed: int) -> float:
    """How many passes over a split of ``split_tokens`` tokens in ``documents`` documents (plus one EOS each when
    ``eos``) a run drawing ``tokens_needed`` tokens makes, at least (the block tails each epoch leaves out only add)."""
    return tokens_needed / max(1, split_tokens + (documents if eos else 0))
