"""Context parallelism is exact against one process: gloo ranks each run their span of one sequence with
``cp_loss``; the sum over ranks of the losses and of every parameter's gradient must equal one process's
``model(ids, labels).loss`` and its gradients, over a few AdamW steps (so later steps pick chunks with moved
weights), and the chunks every rank retrieves must be the ones one process retrieves, Gumbel noise included.

One spawn of three ranks runs every case (smaller groups on subgroups of the first ranks); the parent then
computes the single-process reference of each case and compares."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import tiny_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import model.gca as gca_module
from model import GCAForCausalLM
from model.context_parallel import cp_chunk_bounds, cp_loss, cp_span
from model.gca import RetrievalGroup
from model.lm import lm_loss

pytestmark = pytest.mark.dist

VOCAB = 64
STEPS = 3
WORLD = 3
SHAPES = dict(vocab_size=VOCAB, d_model=32, n_heads=2, n_kv_heads=2, ffn_hidden=64, chunk_size=4, window=6)


@dataclass(frozen=True)
class Case:
    name: str
    cp: int
    T: int
    groups: tuple[int, ...] = (2,)
    gumbel: bool = False
    top_k: int = 2
    batch: int = 1
    labels: str = "ids"
    """``ids``: labels are the inputs; ``masked``: every fifth label is -100; ``weighted``: random token weights."""
    recompute: bool = False
    """The CP ranks recompute every block in backward (the trainer's activation checkpointing), so the halo
    exchanges of the sliding windows run again inside the backward pass."""
    retrieval: str = "learned"
    """``random``: the random-retriever ablation, whose draw every rank takes from the one-process noise too."""
    rope: bool = False
    """``model.position=rope`` with landmarks hidden from tokens (a converted dense model): the halo keys carry
    their rotation and the extra hiding dimensions."""

    def model(self) -> GCAForCausalLM:
        torch.manual_seed(0)
        cfg = tiny_config(
            **SHAPES,
            groups=list(self.groups),
            top_k=self.top_k,
            gumbel_topk=self.gumbel,
            retrieval=self.retrieval,
            **(dict(position="rope", tokens_see_landmarks=False, qkv_bias=True) if self.rope else {}),
        )
        return GCAForCausalLM(cfg).train()

    def data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, VOCAB, (self.batch, self.T), generator=gen)
        labels = ids.clone()
        if self.labels == "masked":
            labels[:, ::5] = -100
        weights = torch.rand(self.batch, self.T, generator=gen) + 0.5 if self.labels == "weighted" else None
        return ids, labels, weights


CASES = [
    Case("cp1-gumbel", cp=1, T=30, gumbel=True),  # a group of one: the whole sequence, no exchange partner
    Case("cp2", cp=2, T=32),  # 8 chunks: 4 + 4
    Case(
        "cp2-gumbel-2groups-partial-masked", cp=2, T=30, groups=(1, 1), gumbel=True, top_k=3, batch=2, labels="masked"
    ),
    Case("cp3-uneven-gumbel", cp=3, T=32, gumbel=True),  # 8 chunks: 2 + 3 + 3
    Case("cp3-2groups-partial-weighted", cp=3, T=27, groups=(1, 1), labels="weighted"),  # 6 chunks + 3 tokens
    Case("cp3-recompute-gumbel", cp=3, T=32, groups=(1, 1), gumbel=True, recompute=True),
    Case("cp2-random-2groups", cp=2, T=32, groups=(1, 1), retrieval="random"),
    Case("cp3-rope-hidden-landmarks", cp=3, T=30, groups=(1, 1), rope=True),
    # 6 chunks: 2 + 2 + 2 with top_k 3: the last rank's rows (landmarks 3 and 4) see only other ranks' chunks.
    Case("cp3-remote-picks", cp=3, T=24, top_k=3),
]
REMOTE = CASES[-1]
SHORT = Case("short", cp=3, T=20)  # 5 chunks: 1 + 2 + 2, rank 0's 5 stream positions < window 6


Picks = dict[tuple[int, int], list[list[int]]]


def record_picks(log: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Callable:
    """Make the model log every retrieval it scores: (query chunk ids, picked chunk ids, weights); returns the
    real ``retrieve`` to restore."""
    real = gca_module.retrieve

    def spy(queries, keys, chunk, **kwargs):
        rows = real(queries, keys, chunk, **kwargs)
        log.append((chunk.clone(), rows.index.clone(), rows.weights.detach().clone()))
        return rows

    gca_module.retrieve = spy
    return real


def picks_of(log: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Picks:
    """(group, query chunk) -> the valid picks of every batch row; a chunk's n-th scoring belongs to group n."""
    picks: Picks = {}
    for chunk, index, weights in log:
        for i, c in enumerate(chunk.tolist()):
            g = sum(1 for key in picks if key[1] == c)
            picks[(g, c)] = [
                sorted(int(j) for j, w in zip(index[b, i], weights[b, i]) if w > 0) for b in range(len(index))
            ]
    return picks


def loss_of(model: GCAForCausalLM, case: Case) -> torch.Tensor:
    ids, labels, weights = case.data()
    if weights is None:
        out = model(ids, labels=labels).loss
        assert out is not None
        return out
    return lm_loss(model(ids).logits, labels, weights)


def recompute_blocks(model: GCAForCausalLM) -> None:
    """Wrap every layer (the entries of the model's layer lists) for recomputation in backward."""
    for layers in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for i, layer in enumerate(layers):
            if not isinstance(layer, RetrievalGroup):
                layers[i] = checkpoint_wrapper(layer)


def _run_case(case: Case, group: dist.ProcessGroup, rank: int, out: Path) -> None:
    model = case.model()
    if case.recompute:
        recompute_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels, weights = case.data()
    for step in range(STEPS):
        log: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        real = record_picks(log)
        torch.manual_seed(100 + step)  # the Gumbel noise: the same generator state as the single process
        loss = cp_loss(model, ids, labels, group, weights)
        loss.backward()
        gca_module.retrieve = real
        grads = {
            name.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        result = {"loss": loss.detach(), "grads": grads, "picks": picks_of(log)}
        torch.save(result, out / f"{case.name}-rank{rank}-step{step}.pt")
        for p in model.parameters():  # what the trainer does: sum the gradients over the CP group
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        opt.step()
        opt.zero_grad()


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        groups = {cp: dist.new_group(list(range(cp)), timeout=timedelta(seconds=60)) for cp in (1, 2, 3)}
        for case in CASES:
            if rank < case.cp:
                _run_case(case, groups[case.cp], rank, Path(out))
        ids, labels, _ = SHORT.data()
        try:
            cp_loss(SHORT.model(), ids, labels, groups[SHORT.cp])
        except ValueError as exc:
            Path(out, f"short-rank{rank}.txt").write_text(str(exc))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, (port, str(out)), nprocs=WORLD, start_method="spawn")
    return out


def rank_results(out: Path, case: Case, step: int) -> list[dict]:
    return [torch.load(out / f"{case.name}-rank{r}-step{step}.pt", weights_only=True) for r in range(case.cp)]


def test_spans_split_chunks_evenly_and_give_the_partial_chunk_to_the_last_rank():
    assert cp_chunk_bounds(32, 4, 3) == [0, 2, 5, 8]
    assert [cp_span(27, 4, 3, r) for r in range(3)] == [(0, 8), (8, 16), (16, 27)]
    assert [cp_span(30, 4, 2, r) for r in range(2)] == [(0, 16), (16, 30)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sum_over_ranks_matches_one_process(cp_runs, case):
    model = case.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        log: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        real = record_picks(log)
        torch.manual_seed(100 + step)
        loss = loss_of(model, case)
        loss.backward()
        gca_module.retrieve = real
        ranks = rank_results(cp_runs, case, step)

        cp_total = sum(r["loss"] for r in ranks)
        torch.testing.assert_close(cp_total, loss.detach(), rtol=1e-5, atol=0)
        for name, p in model.named_parameters():
            if case.retrieval == "random" and "query_norm" in name:  # random picks read no query
                assert p.grad is None and all(name not in r["grads"] for r in ranks), name
                continue
            assert p.grad is not None, name
            cp_grad = sum(r["grads"][name] for r in ranks)
            torch.testing.assert_close(cp_grad, p.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

        want = picks_of(log)
        for r, result in enumerate(ranks):  # each rank scores its rows once, and the row before its span
            for key, rows in result["picks"].items():
                assert rows == want[key], (step, r, key)
        covered = set().union(*(result["picks"] for result in ranks))
        assert covered == set(want)
        opt.step()
        opt.zero_grad()


def test_a_rank_whose_every_pick_lives_on_other_ranks(cp_runs):
    """Every one of the top-k picks the last rank of ``REMOTE`` reads is a chunk of rank 0 or 1 (chunks 0-3), both
    ranks serve some, and its loss and gradients are exact (``test_sum_over_ranks_matches_one_process``)."""
    bounds = cp_chunk_bounds(REMOTE.T, 4, REMOTE.cp)
    owner = {c: r for r in range(REMOTE.cp) for c in range(bounds[r], bounds[r + 1])}
    last = REMOTE.cp - 1
    for step in range(STEPS):
        picks = rank_results(cp_runs, REMOTE, step)[last]["picks"]
        # Chunks lo..hi-1 read the rows of landmarks lo-1..hi-2 (the rank also scores landmark hi-1, unread).
        read = range(bounds[last] - 1, bounds[last + 1] - 1)
        used = {j for (_, c), rows in picks.items() if c in read for row in rows for j in row}
        assert used and {owner[j] for j in used} == {0, 1}
        assert all(len(row) == REMOTE.top_k for (_, c), rows in picks.items() if c in read for row in rows)


def test_too_short_span_is_an_error_naming_the_sizes(cp_runs):
    for r in range(SHORT.cp):
        message = (cp_runs / f"short-rank{r}.txt").read_text()
        for part in ("cp=3", "20 tokens", "chunk_size=4", "window=6"):
            assert part in message
