"""Context parallelism (CP): one training sequence split across the ranks of a process group, exact against one
process.

The sequence's chunks are cut into contiguous spans, one per rank of the group (``cp_chunk_bounds``). Every rank
holds the whole ``input_ids`` and ``labels`` but runs the model on its own span only: the model's one code path
(``GCAForCausalLM._step``) treats the span as a streaming step that starts after ``lo * chunk_size`` tokens, and a
``ContextParallel`` context supplies from the peers what a ``StreamState`` would supply from earlier steps:

* sliding windows: every self-attention layer's keys/values of the previous rank's last ``window`` stream positions
  (what a ``KVCache`` would hold), point to point;
* retrieval: the landmark keys of every chunk (all-gathered, one vector per chunk), and the query of the landmark
  just before the span (from the previous rank), from which the row of the span's first chunk is scored;
* chunk memories: only the retrieved chunks' K/V, fetched from the ranks that own them with an all-to-all;
* Gumbel noise: every rank uses its rows of the draw one process makes for the whole sequence.

Every exchange is an autograd Function whose backward returns the gradient to the rank that owns the activation, so
the sum over ranks of ``cp_loss`` is the single-process loss and the sum over ranks of each parameter's gradient is
the single-process gradient (up to fp32 summation order). All ranks of a group run the same exchanges in the same
order, forward and backward, which is what keeps the blocking receives and the collectives from deadlocking.
Every rank of a group must get the same sample and hold the same torch RNG state (the Gumbel draw);
``model.retrieval_stats`` then describe the rank's own landmarks' rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.chunk_store import ChunkGather
from model.config import GCAConfig
from model.layers import KVCache
from model.retrieval import DeferredRow

if TYPE_CHECKING:
    from model.gca import GCAForCausalLM


def cp_chunk_bounds(n_tokens: int, chunk_size: int, cp: int) -> list[int]:
    """Chunk boundaries ``[lo_0 = 0, lo_1, ..., lo_cp]`` of ``cp`` contiguous spans over the ``ceil(n_tokens /
    chunk_size)`` chunks of a sequence, as equal as possible (sizes differ by at most one, the smaller ones first):
    rank ``r`` owns chunks ``[lo_r, lo_{r+1})``, so a trailing partial chunk belongs to the last rank."""
    n_chunks = -(-n_tokens // chunk_size)
    return [r * n_chunks // cp for r in range(cp + 1)]


def cp_span(n_tokens: int, chunk_size: int, cp: int, rank: int) -> tuple[int, int]:
    """The tokens ``[start, end)`` of ``rank``'s span (``cp_chunk_bounds``)."""
    bounds = cp_chunk_bounds(n_tokens, chunk_size, cp)
    return bounds[rank] * chunk_size, min(bounds[rank + 1] * chunk_size, n_tokens)


def check_cp_spans(cfg: GCAConfig, n_tokens: int, cp: int) -> None:
    """Raise ``ValueError`` unless every rank gets a chunk and every rank but the last spans at least ``window``
    stream positions: a rank takes its sliding-window halo from the previous rank alone."""
    bounds = cp_chunk_bounds(n_tokens, cfg.chunk_size, cp)
    for r, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        positions = (hi - lo) * (cfg.chunk_size + 1)  # every rank but the last holds whole chunks and landmarks
        if hi == lo or (r < cp - 1 and positions < cfg.window):
            raise ValueError(
                f"context parallelism cp={cp} over a sequence of {n_tokens} tokens with model.chunk_size="
                f"{cfg.chunk_size} gives rank {r} a span of {hi - lo} chunk(s) ({positions} stream positions), shorter "
                f"than model.window={cfg.window}: every rank but the last must cover the sliding window, since the "
                "next rank reads the window's keys and values from it alone; use fewer ranks or longer sequences"
            )


def cp_loss(
    model: GCAForCausalLM,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    weights: torch.Tensor | None = None,
    weight_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's share of the next-token loss of ``model(input_ids, labels)`` under context parallelism over
    ``group`` (``None``: the default group).

    Every rank of the group must pass the same ``input_ids``, ``labels`` (``[B, T]``, ``-100`` ignored) and
    ``weights`` and hold the same torch RNG state (the Gumbel top-k draws the same noise on every rank). The rank
    runs the model on its span only (``cp_span``) and returns the cross-entropy summed over its positions -- its
    last token is scored against the next rank's first label -- divided by the whole sequence's count of scored
    positions (with ``weights [B, T]``: ``sum(w * ce)`` over its positions divided by ``weight_norm``, by default
    ``sum(w)`` over the whole sequences' predicted positions, like ``model.lm.lm_loss``; every rank of the group
    must pass the same ``weight_norm``). Hence the sum over the group of the returned losses equals the single-
    process loss, and after ``backward()`` the sum over the group of each parameter's gradient equals the single-
    process gradient; summing the gradients (an all-reduce over the group) is the caller's job. The span runs
    through the module call (``model(span, cp=...)``), so the forward hooks of a wrapper such as FSDP2 run.
    """
    return cp_loss_and_token_losses(model, input_ids, labels, group, weights, weight_norm)[0]


def cp_loss_and_token_losses(
    model: GCAForCausalLM,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    weights: torch.Tensor | None = None,
    weight_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cp_loss` (the same share, the same gradients), and the unweighted cross-entropy of each position this rank
    scores ``[B, n]`` (fp32, detached; 0 at a ``-100`` label) with which of them are scored (``[B, n]`` bool).

    The ranks' spans partition the sequence, so summing these over the group gives each whole row's loss sum and
    scored count once, without a collective here."""
    cp = ContextParallel(model.cfg, input_ids.shape[1], group)
    start, end = cp.span
    logits = model(input_ids[:, start:end], cp=cp).logits
    targets = labels[:, start + 1 : end + 1]  # the last rank has one target fewer than tokens
    ce = F.cross_entropy(
        logits[:, : targets.shape[1]].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="none"
    )
    token_ce = ce.detach().view(targets.shape)
    if weights is None:
        return ce.sum() / (labels[:, 1:] != -100).sum(), token_ce, targets != -100
    norm = weights[:, 1:].sum() if weight_norm is None else weight_norm
    return (ce * weights[:, start + 1 : end + 1].flatten()).sum() / norm, token_ce, targets != -100


def _send_recv(
    group: dist.ProcessGroup | None,
    send: tuple[torch.Tensor, int] | None,
    recv: tuple[torch.Tensor, int] | None,
    tag: int,
) -> None:
    """Post ``send`` (a tensor and its destination's group rank) before blocking on ``recv`` (a buffer and its
    source): a chain of ranks that each send one way and receive from the other then never waits in a cycle."""
    work = None
    if send is not None:
        payload = send[0].contiguous()  # referenced until the send completes
        work = dist.isend(payload, group_dst=send[1], group=group, tag=tag)
    if recv is not None:
        dist.recv(recv[0], group_src=recv[1], group=group, tag=tag)
    if work is not None:
        work.wait()


class _ShiftTail(torch.autograd.Function):
    """Identity on ``x [B, n, ...]`` that sends its last ``n_send`` positions to the next rank and also returns what
    the previous rank sent (``[B, n_recv, ...]``; empty on the first rank).

    Backward sends the received part's gradient to the previous rank and adds the next rank's gradient of the sent
    positions to theirs. ``x`` passes through so that the node lies on every rank's backward path: the first rank
    receives nothing, yet must receive the gradient of what it sent.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, n_send: int, n_recv: int, cp: ContextParallel, tag: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.n_send, ctx.cp, ctx.tag = n_send, cp, tag
        received = x.new_empty(x.shape[0], 0 if cp.is_first else n_recv, *x.shape[2:])
        _send_recv(
            cp.group,
            None if cp.is_last else (x[:, x.shape[1] - n_send :], cp.rank + 1),
            None if cp.is_first else (received, cp.rank - 1),
            tag,
        )
        return x.view_as(x), received

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor, grad_received: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cp: ContextParallel = ctx.cp
        from_next = None if cp.is_last else grad_x.new_empty(grad_x.shape[0], ctx.n_send, *grad_x.shape[2:])
        _send_recv(
            cp.group,
            None if cp.is_first else (grad_received, cp.rank - 1),
            None if from_next is None else (from_next, cp.rank + 1),
            ctx.tag,
        )
        if from_next is not None:
            grad_x = grad_x.clone()
            grad_x[:, grad_x.shape[1] - ctx.n_send :] += from_next
        return grad_x, None, None, None, None


class _AllGatherSpans(torch.autograd.Function):
    """All-gather along dim 1 of every rank's ``[B, counts[r], ...]``; backward is the reduce-scatter (each rank gets
    the sum of every rank's gradient for its own part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], cp: ContextParallel) -> torch.Tensor:
        ctx.counts, ctx.cp = counts, cp
        own = x.transpose(0, 1).contiguous()  # all_to_all splits dim 0
        out = own.new_empty(sum(counts), *own.shape[1:])
        repeats = [cp.size] + [1] * (own.dim() - 1)
        dist.all_to_all_single(out, own.repeat(repeats), counts, [own.shape[0]] * cp.size, group=cp.group)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cp: ContextParallel = ctx.cp
        n = ctx.counts[cp.rank]
        parts = grad.transpose(0, 1).contiguous()
        out = parts.new_empty(cp.size * n, *parts.shape[1:])
        dist.all_to_all_single(out, parts, [n] * cp.size, ctx.counts, group=cp.group)
        return out.view(cp.size, n, *parts.shape[1:]).sum(0).transpose(0, 1), None, None


@dataclass
class _FetchPlan:
    """Who sends which chunk-memory rows to whom, for one retrieval."""

    served: torch.Tensor
    """``[m]`` rows of this rank's memory (flattened to ``[B * n, ...]``) that it sends, grouped by requester."""
    serve_counts: list[int]
    """Rows sent to each rank."""
    fetch_counts: list[int]
    """Rows received from each rank."""


class _FetchRows(torch.autograd.Function):
    """Send the rows ``plan.served`` of this rank's ``memory [B, n, ...]`` to the ranks that asked for them and
    return the rows this rank asked for (``[sum(fetch_counts), ...]``, in owner order); backward returns every
    fetched row's gradient to its owner, which accumulates them into its memory's gradient."""

    @staticmethod
    def forward(ctx: Any, memory: torch.Tensor, plan: _FetchPlan, cp: ContextParallel) -> torch.Tensor:
        ctx.plan, ctx.cp, ctx.shape = plan, cp, memory.shape
        rows = memory.flatten(0, 1)[plan.served]
        out = rows.new_empty(sum(plan.fetch_counts), *rows.shape[1:])
        dist.all_to_all_single(out, rows, plan.fetch_counts, plan.serve_counts, group=cp.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: _FetchPlan = ctx.plan
        rows = grad.new_empty(plan.served.numel(), *grad.shape[1:])
        dist.all_to_all_single(rows, grad.contiguous(), plan.serve_counts, plan.fetch_counts, group=ctx.cp.group)
        memory_grad = grad.new_zeros(ctx.shape[0] * ctx.shape[1], *grad.shape[1:]).index_add_(0, plan.served, rows)
        return memory_grad.view(ctx.shape), None, None


class _HaloCache(KVCache):
    """A layer's window into the previous rank: ``extend`` prepends the previous rank's last ``window`` keys/values
    (received when the layer runs) and sends this rank's own to the next rank. Nothing is kept: the span is the
    whole step."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self._cp = cp

    def extend(self, k: torch.Tensor, v: torch.Tensor, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        if window is None:
            raise ValueError("context parallelism needs sliding-window attention (window=None keeps everything)")
        D = k.shape[-1]
        kv, halo = self._cp.shift_tail(torch.cat([k, v], dim=-1), n_send=window, n_recv=window)
        return torch.cat([halo[..., :D], kv[..., :D]], dim=1), torch.cat([halo[..., D:], kv[..., D:]], dim=1)


class ContextParallel:
    """This rank's view of a sequence split over a CP group, threaded through ``GCAForCausalLM._step`` (see the
    module docstring). Raises ``ValueError`` (``check_cp_spans``) when a span is too short for the window."""

    def __init__(self, cfg: GCAConfig, n_tokens: int, group: dist.ProcessGroup | None = None) -> None:
        self.cfg, self.n_tokens, self.group = cfg, n_tokens, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        check_cp_spans(cfg, n_tokens, self.size)
        self.bounds = cp_chunk_bounds(n_tokens, cfg.chunk_size, self.size)
        self._tag = 0  # one per point-to-point exchange: its backward reuses it, so messages can never cross

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def span(self) -> tuple[int, int]:
        """This rank's tokens ``[start, end)``."""
        return cp_span(self.n_tokens, self.cfg.chunk_size, self.size, self.rank)

    @property
    def n_prev(self) -> int:
        """Tokens before the span: the step's ``StepLayout`` starts there."""
        return self.span[0]

    @property
    def n_landmarks(self) -> int:
        """Landmarks of the whole sequence (one per complete chunk); also its number of landmark keys."""
        return self.n_tokens // self.cfg.chunk_size

    def shift_tail(self, x: torch.Tensor, n_send: int, n_recv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, n, ...]`` (pass it on: backward adds the next rank's gradient for its last ``n_send`` positions)
        and the previous rank's last ``n_recv`` positions of the same tensor (empty on the first rank)."""
        self._tag += 1
        return _ShiftTail.apply(x, n_send, n_recv, self, self._tag)

    def halo_caches(self, n_layers: int) -> list[KVCache | None]:
        """One halo per self-attention layer, in the order the step runs them."""
        return [_HaloCache(self) for _ in range(n_layers)]

    def share_chunks(
        self, local: tuple[torch.Tensor, ChunkGather, ChunkGather] | None, x: torch.Tensor
    ) -> tuple[torch.Tensor, ChunkGather, ChunkGather] | None:
        """From the span's encoded chunks (``None`` when it closes none; ``x`` is the step's lower-layer output),
        the landmark keys of every chunk of the sequence ``[B, N, d_model]`` and the span's own chunk K/V, which
        ``gather_chunks`` reads; ``None`` when the sequence closes no chunk (nothing to read, as in one process)."""
        if self.n_landmarks == 0:
            return None
        if local is None:
            # An empty memory still joins the exchanges and their backward, so it must carry autograd like a real
            # one: slices of x do.
            B, S, H, D = x.shape[0], self.cfg.chunk_size, self.cfg.n_kv_heads, self.cfg.head_dim
            none = x[:, :0]
            local = (none, none.reshape(B, 0, S, H, D), none.reshape(B, 0, S, H, D))
        keys, k, v = local
        counts = [min(hi, self.n_landmarks) - lo for lo, hi in zip(self.bounds, self.bounds[1:])]
        return _AllGatherSpans.apply(keys, counts, self), k, v

    def previous_row(self, queries: torch.Tensor) -> tuple[torch.Tensor, DeferredRow | None]:
        """Pass the span's normalised landmark queries ``[B, n, d_model]`` on (the last one goes to the next rank)
        and return them with the row of the landmark just before the span, to be scored from the previous rank's
        query (``None`` on the first rank, whose first chunk reads nothing)."""
        queries, previous = self.shift_tail(queries, n_send=1, n_recv=1)
        if self.is_first:
            return queries, None
        return queries, DeferredRow(previous, torch.tensor([self.bounds[self.rank] - 1], device=queries.device))

    def gumbel_uniform(self, batch: int, device: torch.device) -> torch.Tensor:
        """The uniform draw behind one group's Gumbel top-k as one process makes it (``torch.rand_like`` over its
        ``[B, N, max(N, top_k)]`` scores); row ``i`` belongs to the landmark of chunk ``i``.

        Every rank draws the whole matrix and keeps its rows: with the same generator state on every rank that
        reproduces one process's noise exactly and leaves the generators where one process leaves them. The cost
        is a transient fp32 ``B * N * max(N, top_k)`` per group on every rank (1 GiB at B=1 and N=16K chunks, e.g.
        1M tokens of 64-token chunks) -- the size of one process's score matrix, which CP otherwise cuts by the
        group size; a counter-based draw addressable by row would avoid it but change the single-process noise.
        """
        n = self.n_landmarks
        return torch.rand(batch, n, max(n, self.cfg.top_k), device=device, dtype=torch.float32)

    def gather_chunks(
        self, mem_k: ChunkGather, mem_v: ChunkGather, index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``mem_k[batch, index]``, ``mem_v[batch, index]`` are in one process (``[B, C, R, S, H, D]``) for the
        absolute chunk ids ``index [B, C, R]``, from the span memories ``[B, n, S, H, D]`` of the ranks that own
        the chunks: every distinct (batch row, chunk) is fetched once, and only those."""
        B, n_local, D = index.shape[0], mem_k.shape[1], mem_k.shape[-1]
        # Chunk-major keys: sorted, the wanted rows come grouped by owner in rank order, as all_to_all lays them out.
        keyed = index * B + torch.arange(B, device=index.device)[:, None, None]
        wanted, where = torch.unique(keyed, return_inverse=True)
        upper = torch.tensor(self.bounds[1:], device=index.device)
        fetch_counts = torch.bincount(torch.bucketize(wanted // B, upper, right=True), minlength=self.size)
        serve_counts = torch.empty_like(fetch_counts)
        dist.all_to_all_single(serve_counts, fetch_counts, group=self.group)
        plan = _FetchPlan(wanted.new_empty(int(serve_counts.sum())), serve_counts.tolist(), fetch_counts.tolist())
        dist.all_to_all_single(plan.served, wanted, plan.serve_counts, plan.fetch_counts, group=self.group)
        plan.served = (plan.served % B) * n_local + plan.served // B - self.bounds[self.rank]  # rows of [B * n, ...]
        # A context-parallel step reads no ChunkStore: its memories are the span's encoder outputs, tensors.
        memory = torch.cat([cast(torch.Tensor, mem_k), cast(torch.Tensor, mem_v)], dim=-1)
        rows = _FetchRows.apply(memory, plan, self)[where]  # [B, C, R, S, H, 2D]
        return rows[..., :D], rows[..., D:]
