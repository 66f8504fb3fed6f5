"""Causal chunk retrieval: score landmark queries against landmark keys, pick the top-R past chunks.

One function serves the batch, segment-wise and incremental paths, so they score identically (the
official code scored them differently). The query of chunk ``i`` (its landmark's hidden state, normalised by the
group's own RMSNorm) may select chunk ``j`` only if ``j < i``; the resulting row is used by the tokens of
chunk ``i + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Logit given to invalid picks before the softmax: finite (no NaN in all-invalid rows), exp() underflows to 0.
_INVALID_LOGIT = -1e9
Picks = dict[tuple[int, int], list[list[int]]]
"""Recorded retrievals: (group, query chunk id) -> for every batch row the chunk ids it picked (valid picks only)."""

# Scores per retrieval call without autograd (64 MB in fp32): a streamed step with hundreds of landmarks against
# millions of stored chunks would otherwise hold several GB of [queries, chunks] scores and masks at once.
_EVAL_SCORE_ELEMENTS = 1 << 24


@dataclass
class DeferredRow:
    """A row not scored yet: the normalised query of the last landmark of ``memory_only`` steps and its chunk.

    Keys appended later are invisible to it (chunk ids ``>= chunk``), so scoring it when a later step reads it
    picks what scoring it at once would have picked, at O(stored chunks) once instead of per streamed segment.
    """

    query: torch.Tensor
    """``[B, 1, d_model]``."""
    chunk: torch.Tensor
    """``[1]`` absolute chunk id of the landmark."""


@dataclass
class RetrievalRows:
    """Retrieved chunks per query chunk; invalid picks (fewer visible chunks than R) have weight exactly 0."""

    index: torch.Tensor
    """``[B, C, R]`` long, absolute chunk ids (0 where the pick is invalid)."""
    weights: torch.Tensor
    """``[B, C, R]`` fp32 softmax over the clean scores of the valid picks."""

    @staticmethod
    def empty(batch: int, top_k: int, device: torch.device) -> RetrievalRows:
        """The row of a chunk with nothing to retrieve yet (chunks 0 and 1)."""
        zeros = torch.zeros(batch, 1, top_k, device=device)
        return RetrievalRows(zeros.long(), zeros)

    def __getitem__(self, rows: slice) -> RetrievalRows:
        return RetrievalRows(self.index[:, rows], self.weights[:, rows])

    @staticmethod
    def cat(parts: list[RetrievalRows]) -> RetrievalRows:
        return RetrievalRows(torch.cat([p.index for p in parts], 1), torch.cat([p.weights for p in parts], 1))


@dataclass
class ChunkDocuments:
    """Which packed document each chunk belongs to (``model.retrieval_scope=document``), by absolute chunk id.

    Documents are counted by the end-of-document tokens before a position. Chunk ``i``'s query fetches for the
    tokens of chunk ``i + 1``, so it reads for the document of the token after its last one (``read``); chunk ``j``
    is a candidate for that document when its last token belongs to it (``key``). A chunk that ends with the
    end-of-document token therefore serves no later reader, and a chunk that straddles a boundary serves the
    document it ends in (it is still encoded as one unit).
    """

    read: torch.Tensor
    """``[B, C]`` long: end-of-document tokens up to and including chunk ``i``'s last token."""
    key: torch.Tensor
    """``[B, C]`` long: end-of-document tokens strictly before chunk ``j``'s last token."""

    @staticmethod
    def of_step(
        input_ids: torch.Tensor, eos_id: int, last_token: torch.Tensor, eos_before: torch.Tensor | None
    ) -> tuple[ChunkDocuments, torch.Tensor]:
        """The documents of the chunks a step completes, whose last tokens are at ``last_token`` (positions within
        ``input_ids [B, T]``), and the end-of-document count after the step (``eos_before``: the count before)."""
        eos = input_ids == eos_id
        count = eos.long().cumsum(1)
        if eos_before is not None:
            count = count + eos_before[:, None]
        read = count[:, last_token]
        return ChunkDocuments(read, read - eos[:, last_token].long()), count[:, -1]


def retrieve(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_chunk: torch.Tensor,
    *,
    top_k: int,
    scale: float,
    gumbel: bool,
    grad: bool = True,
    uniform: torch.Tensor | None = None,
    random_picks: bool = False,
    query_doc: torch.Tensor | None = None,
    key_doc: torch.Tensor | None = None,
) -> RetrievalRows:
    """Select and weight the top-``top_k`` visible chunks for each query.

    Args:
        queries: ``[B, Cq, d_model]`` normalised landmark states.
        keys: ``[B, Cm, d_model]`` landmark keys of every chunk in memory.
        query_chunk: ``[Cq]`` absolute chunk id ``i`` of each query; chunks ``j < i`` are visible.
        top_k: ``R``.
        scale: score scale (``1/sqrt(d_model)`` in the paper).
        gumbel: perturb the selection with Gumbel noise (sampling without replacement from softmax(scores));
            the weights always use the clean scores.
        grad: when False the weights are detached (the stop-gradient ablation: the retriever is not trained).
        uniform: ``[B, Cq, max(Cm, top_k)]`` the uniform draw behind the Gumbel noise or the random picks (default:
            ``torch.rand`` here); context parallelism passes its rows of the draw one process makes for the whole
            sequence.
        random_picks: the random-retriever ablation (``model.retrieval=random``): ``top_k`` chunks uniformly at
            random without replacement among the visible ones, equal weights; nothing is scored and nothing learns
            (``queries``, ``scale``, ``gumbel`` and ``grad`` are unused).
        query_doc: ``[B, Cq]`` with ``key_doc`` ``[B, Cm]``: same-document retrieval (``ChunkDocuments``): chunk
            ``j`` is visible to query ``i`` only when also ``key_doc[j] == query_doc[i]``. None: every earlier chunk.
    """
    B, Cq, _ = queries.shape
    Cm = keys.shape[1]
    if not torch.is_grad_enabled() and Cq > 1 and B * Cq * max(Cm, top_k) > _EVAL_SCORE_ELEMENTS:
        # Rows are independent: slices of queries bound the transient scores whatever the memory size.
        step = max(1, _EVAL_SCORE_ELEMENTS // (B * max(Cm, top_k)))
        return RetrievalRows.cat(
            [
                retrieve(
                    queries[:, i : i + step],
                    keys,
                    query_chunk[i : i + step],
                    top_k=top_k,
                    scale=scale,
                    gumbel=gumbel,
                    grad=grad,
                    uniform=None if uniform is None else uniform[:, i : i + step],
                    random_picks=random_picks,
                    query_doc=None if query_doc is None else query_doc[:, i : i + step],
                    key_doc=key_doc,
                )
                for i in range(0, Cq, step)
            ]
        )
    visible = torch.arange(Cm, device=keys.device)[None, :] < query_chunk[:, None]  # [Cq, Cm]
    if query_doc is not None and key_doc is not None:
        visible = visible & (key_doc[:, None, :] == query_doc[:, :, None])  # [B, Cq, Cm]
    if Cm < top_k:  # pad with never-visible columns so every row has exactly R picks
        visible = F.pad(visible, (0, top_k - Cm), value=False)
    visible = visible.expand(B, Cq, -1)
    if random_picks:
        return _random_rows(visible, top_k, uniform)
    # Scores, noise, top-k and softmax in fp32 whatever the caller's autocast: under bf16 autocast the einsum ran
    # in bf16 (8 bits of mantissa), which changed the picked set of ~4% of rows and made the Gumbel noise coarse.
    with torch.autocast(keys.device.type, enabled=False):
        scores = torch.einsum("bqd,bmd->bqm", queries.float(), keys.float()) * scale  # [B, Cq, Cm]
        if Cm < top_k:
            scores = F.pad(scores, (0, top_k - Cm))
        with torch.no_grad():
            pick = scores.masked_fill(~visible, float("-inf"))
            if gumbel:
                noise = torch.rand_like(pick) if uniform is None else uniform.float()
                pick = pick - torch.log(-torch.log(noise.clamp(1e-10, 1.0 - 1e-7)))
            index = pick.topk(top_k, dim=-1).indices  # [B, Cq, R]
        valid = visible.gather(-1, index)
        logits = torch.where(valid, scores.gather(-1, index), torch.full_like(scores[..., :1], _INVALID_LOGIT))
        weights = torch.softmax(logits, dim=-1) * valid  # all-invalid rows become exactly 0
    if not grad:
        weights = weights.detach()
    return RetrievalRows(torch.where(valid, index, torch.zeros_like(index)), weights)


NEEDLE_QUERY, NEEDLE_CHUNK, NEEDLE_EACH = 2, 1, 3
"""Marks of a retrieval label row ``[C]`` (``needle_loss``): the landmarks whose retrievals serve a task's answer
(one per chunk that predicts answer tokens, so an answer longer than a chunk has several), and the chunks holding
the needles it asks for -- ``NEEDLE_CHUNK`` where the softmax mass on them as a set is the target,
``NEEDLE_EACH`` where every one of them is a target of its own (an answer copied out of several chunks, such as a
UUID over four, needs each of them among the top-k); every other chunk is 0."""


@dataclass
class NeedleLabels:
    """What a whole-sequence forward needs for ``needle_loss`` and what it collects: one term per retrieval group."""

    labels: torch.Tensor
    """``[B, C]`` int64 marks per chunk (``NEEDLE_QUERY``, ``NEEDLE_CHUNK``, else 0)."""
    terms: list[torch.Tensor] = field(default_factory=list)
    """Each group's summed loss over the labelled sequences."""

    def mean(self) -> torch.Tensor:
        """The loss per sequence of the batch (unlabelled ones count 0), averaged over the groups: a mean over rows,
        so that equal micro-batches average to the global batch's mean as the LM loss does."""
        return torch.stack(self.terms).mean() / self.labels.shape[0]


def needle_loss(queries: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor, *, scale: float) -> torch.Tensor:
    """The retriever's supervised loss on retrieval tasks whose needles are known: for each landmark ``q`` that
    ``labels`` marks as a query (``NEEDLE_QUERY``), the cross-entropy of the asked needles' chunks under the softmax
    of ``q``'s scores over *every* visible chunk ``j < q`` (not only its top-k): minus the log of the mass on the
    ``NEEDLE_CHUNK`` chunks as one set, and of each ``NEEDLE_EACH`` chunk's own probability, averaged over those
    targets (a set counts as one). A sequence's term is the mean over its query landmarks whose needles are
    visible, so it weighs one however many chunks its answer spans.

    The language-model loss reaches a score only through the chunks a row picked, so a needle the retriever does
    not pick yet gets no gradient from it (and none at all while the GCA output is zero, as after a dense
    conversion); this loss gives every needle score a gradient from the first step. An answer that spans several
    chunks is read through several retrievals (each chunk reads its own row), and each of them must fetch the
    needles: the question's row alone is not enough for the values written after the answer's first chunk.

    Args:
        queries: ``[B, C, d_model]`` normalised landmark states of chunks ``0 .. C-1`` (a whole sequence).
        keys: ``[B, Cm, d_model]`` landmark keys of chunks ``0 .. Cm-1``.
        labels: ``[B, >= C]`` marks per chunk; query landmarks without a visible needle chunk contribute nothing.
        scale: the retrieval score scale.

    Returns:
        The summed loss over the labelled sequences (fp32 scalar).
    """
    C, Cm = queries.shape[1], keys.shape[1]
    labels = labels[:, :C]
    with torch.autocast(keys.device.type, enabled=False):
        scores = torch.einsum("bcd,bmd->bcm", queries.float(), keys.float()) * scale  # [B, C, Cm]
        visible = torch.arange(Cm, device=keys.device)[None, :] < torch.arange(C, device=keys.device)[:, None]
        in_set = visible[None] & (labels[:, :Cm] == NEEDLE_CHUNK)[:, None, :]  # [B, C, Cm]
        each = visible[None] & (labels[:, :Cm] == NEEDLE_EACH)[:, None, :]
        has_set = in_set.any(-1)
        targets = has_set.float() + each.sum(-1)  # [B, C]: the set counts as one target
        used = (labels == NEEDLE_QUERY) & (targets > 0)
        # An unused row scores every chunk on both sides: its term is exactly 0 with a zero (not NaN) gradient.
        unused = ~used[..., None]
        every = torch.logsumexp(scores.masked_fill(~(visible[None] | unused), float("-inf")), -1)
        set_mass = torch.logsumexp(scores.masked_fill(~(in_set | unused), float("-inf")), -1)
        log_likelihood = torch.where(has_set, set_mass, 0.0) + (scores * each).sum(-1)
        row = torch.where(used, every - log_likelihood / targets.clamp_min(1), 0.0)
        per_sequence = row.sum(-1) / used.sum(-1).clamp_min(1)
        return per_sequence.sum()


def _random_rows(visible: torch.Tensor, top_k: int, uniform: torch.Tensor | None) -> RetrievalRows:
    """``top_k`` visible chunks per row uniformly without replacement (the top-k of i.i.d. uniform draws among the
    visible ones is a uniform subset), each valid pick weighted 1 / (valid picks)."""
    draw = torch.rand(visible.shape, device=visible.device) if uniform is None else uniform
    index = draw.masked_fill(~visible, -1.0).topk(top_k, dim=-1).indices  # invisible columns rank last
    valid = visible.gather(-1, index)
    weights = valid.float() / valid.sum(-1, keepdim=True).clamp_min(1)
    return RetrievalRows(torch.where(valid, index, torch.zeros_like(index)), weights)


def record_picks(picks: Picks | None, group: int, rows: RetrievalRows, chunk: torch.Tensor) -> None:
    """Add ``rows`` (scored for the query chunk ids ``chunk``) to ``picks`` unless it is None; invalid picks
    (weight 0: fewer visible chunks than top-k) are left out. The one recorder of ``StreamState.picks`` and
    ``GCAForCausalLM.picks``."""
    if picks is None:
        return
    # One transfer each, then plain lists: per-element tensor indexing cost ~10 us a pick.
    index, used = rows.index.tolist(), (rows.weights > 0).tolist()
    for i, query_chunk in enumerate(chunk.tolist()):
        picks[(group, query_chunk)] = [[j for j, u in zip(index[b][i], used[b][i]) if u] for b in range(len(index))]


@torch.no_grad()
def retrieval_stats(rows: RetrievalRows, query_chunk: torch.Tensor) -> dict[str, torch.Tensor]:
    """Telemetry of one group's retrieval, over the rows that retrieved anything: mean entropy of the weights
    (nats; ``log R`` = uniform) and mean weighted distance in chunks from the reading chunk ``i + 1`` back to the
    retrieved chunks (at least 2, since chunk ``i + 1`` reads chunks ``j < i``).

    Masked sums rather than a boolean-mask selection, so that nothing waits for the device inside the training
    step; the means are NaN when no row retrieved anything (the caller knows when that can happen, from shapes).
    """
    w = rows.weights  # [B, C, R]
    used = (w > 0).any(-1).float()
    n_used = used.sum()
    entropy = -(w * w.clamp_min(1e-12).log()).sum(-1)
    distance = ((query_chunk[None, :, None] + 1 - rows.index).float() * w).sum(-1)
    return {"entropy": (entropy * used).sum() / n_used, "distance": (distance * used).sum() / n_used}
