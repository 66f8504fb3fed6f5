"""The GCA language model (DRT architecture), top to bottom.

Paper: Hu et al., "Efficient Length-Generalizable Attention via Causal Retrieval for Long-Context Language
Modeling", ICML 2025. Algorithm as implemented: docs/design.md.

Tokens are cut into chunks of ``S`` tokens and a learned landmark vector is appended to every chunk. Lower layers
are sliding-window decoder layers (ALiBi, or RoPE with ``model.position=rope``). A bidirectional chunk encoder turns
each chunk into a landmark key and a K/V memory. Upper layers come in retrieval groups: at the start of a group, the
landmark of chunk ``i`` scores the keys of chunks ``j < i`` and keeps the top ``R``; every token of chunk ``i + 1``
then reads those chunks with Grouped Cross Attention -- one softmax per chunk, mixed by the retrieval weights, which
receive the LM loss gradient (that is what trains the retriever). Each upper layer is ``a = x + SWA(norm(x)); y =
GCA(a); out = a + MLP(norm(a + y))`` (the GCA output never joins the residual).

One code path serves training (a whole sequence at once) and streaming (segments or single tokens with a
``StreamState``), so batch, segment-wise and incremental decoding give the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.gca import gca_attention
from model.chunk_store import ChunkGather, ChunkStore
from model.config import ConfigError, GCAConfig
from model.context_parallel import ContextParallel
from model.layers import (
    ChunkEncoder,
    DecoderLayer,
    KVCache,
    RMSNorm,
    SlidingWindowAttention,
    SwiGLU,
    WindowPositions,
    window_positions,
)
from model.layout import StepLayout
from model.lm import CausalLM
from model.retrieval import (
    ChunkDocuments,
    DeferredRow,
    NeedleLabels,
    Picks,
    RetrievalRows,
    needle_loss,
    record_picks,
    retrieval_stats,
    retrieve,
)
from model.stream import StreamState

# Logit elements per GCA operator call when no gradient is needed (about 64 MB in fp32).
_EVAL_SLICE_ELEMENTS = 1 << 24


@dataclass
class RetrievedMemory:
    """The chunk memories one group reads, gathered once and shared by the group's layers."""

    k: torch.Tensor  # [B, C, H, R, S, D]: per head, a chunk's R memories are contiguous (the operator's layout)
    v: torch.Tensor  # [B, C, H, R, S, D]
    weights: torch.Tensor  # [B, C, R]


class GroupedCrossAttention(nn.Module):
    """Each token attends to the R chunks retrieved for its chunk, one softmax per chunk, weighted sum."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.gca_output_bias)

    def forward(self, a: torch.Tensor, memory: RetrievedMemory | None, layout: StepLayout) -> torch.Tensor:
        B, L, _ = a.shape
        cfg = self.cfg
        if memory is None:  # nothing encoded yet: every read is empty
            return self.wo(a.new_zeros(B, L, cfg.n_heads * cfg.head_dim))
        P, C = cfg.chunk_size + 1, layout.n_chunks
        q = self.wq(self.norm(a))  # [B, L, HQ*D]
        # Align the step to chunk boundaries: `lead` positions of the first chunk came in earlier steps.
        q = F.pad(q, (0, 0, layout.lead, C * P - layout.lead - L))
        q = q.view(B * C, P, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # [B*C, HQ, S+1, D]
        R, S = memory.k.shape[3], memory.k.shape[4]
        k = memory.k.flatten(0, 1)  # [B*C, H, R, S, D], no copy
        v = memory.v.flatten(0, 1)
        w = memory.weights.reshape(B * C, R)
        # Without autograd nothing is kept for backward, so long inputs are read in slices of chunks: the
        # operator's transient [chunks, HQ, R, S+1, S] logits then stay bounded whatever the input length.
        step = B * C if torch.is_grad_enabled() else max(1, _EVAL_SLICE_ELEMENTS // (cfg.n_heads * R * P * S))
        parts = [
            gca_attention(
                q[i : i + step],
                k[i : i + step],
                v[i : i + step],
                w[i : i + step],
                softmax_off_by_one=cfg.softmax_off_by_one,
                backend=cfg.gca_backend,
            )
            for i in range(0, B * C, step)
        ]
        o = torch.cat(parts) if len(parts) > 1 else parts[0]  # [B*C, HQ, S+1, D]
        o = o.transpose(1, 2).reshape(B, C * P, -1)[:, layout.lead : layout.lead + L]  # [B, L, HQ*D]
        return self.wo(o)


class UpperLayer(nn.Module):
    """``a = x + SWA(norm(x)); y = GCA(a); out = a + MLP(norm(a + y))``."""

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = SlidingWindowAttention(cfg)
        self.gca = GroupedCrossAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None,
        memory: RetrievedMemory | None,
        layout: StepLayout,
        pos: WindowPositions | None = None,
    ) -> torch.Tensor:
        a = x + self.attn(self.attn_norm(x), cache, pos)
        y = self.gca(a, memory, layout)
        return a + self.mlp(self.mlp_norm(a + y))


class RetrievalGroup(nn.Module):
    def __init__(self, cfg: GCAConfig, n_layers: int) -> None:
        super().__init__()
        self.query_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.layers = nn.ModuleList(UpperLayer(cfg) for _ in range(n_layers))


class GCAForCausalLM(CausalLM):
    """GCA (DRT) causal language model with a tied LM head (or an untied ``head``, ``model.tie_embeddings=false``).

    ``model(input_ids)`` runs a whole sequence (training and short evaluation); ``model.forward_stream(ids, state)``
    continues a sequence held in a ``StreamState`` (long inputs segment by segment, or decoding token by token).
    """

    def __init__(self, cfg: GCAConfig) -> None:
        super().__init__()
        if cfg.retrieval_scope == "document" and cfg.eos_id is None:
            raise ConfigError("model.retrieval_scope=document needs model.eos_id, the token that ends a document")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.landmark = nn.Parameter(torch.zeros(cfg.d_model))
        self.lower = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_lower_layers))
        self.encoder = ChunkEncoder(cfg)
        self.groups = nn.ModuleList(RetrievalGroup(cfg, n) for n in cfg.groups)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        scale_dim = cfg.d_model if cfg.retrieval_scale == "d_model" else cfg.head_dim
        self.retrieval_scale = scale_dim**-0.5
        self.retrieval_stats: dict[str, torch.Tensor] = {}
        """Telemetry of the last step's retrievals: ``retrieval_entropy_g<g>``, ``retrieval_distance_g<g>``."""
        self.picks: Picks | None = None
        """None, or (set to ``{}`` by a caller) every retrieval the whole-sequence forward ``model(input_ids)``
        scores, as ``StreamState.picks`` records them when streaming (far recall in validation). Not recorded under
        context parallelism: a rank scores only its span's rows."""
        self.init_weights()

    def init_weights(self) -> None:
        """N(0, init_std) for every linear/embedding weight and the landmark, zero biases, unit norm gains."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=self.cfg.init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.landmark, std=self.cfg.init_std)

    def new_stream_state(self, memory: ChunkStore | None = None) -> StreamState:
        """A fresh state for ``forward_stream``; ``memory`` replaces the in-RAM chunk memory (any ``ChunkStore``,
        e.g. the on-disk ``model.offload.MemmapChunkMemory``)."""
        n_layers = self.cfg.n_lower_layers + self.cfg.n_upper_layers
        return StreamState(n_layers=n_layers, n_groups=len(self.groups), memory=memory)

    def forward_stream(
        self, input_ids: torch.Tensor, state: StreamState, last_logits: int | None = None, memory_only: bool = False
    ) -> torch.Tensor:
        """Continue the sequence in ``state`` with ``input_ids [B, t]``; returns their logits ``[B, t, V]``, or only
        those of the last ``last_logits`` tokens (the LM head dominates the cost of streaming a long prefix).

        ``memory_only=True`` (one retrieval group only) skips the upper layers and returns no logits: it keeps
        what later tokens read from far back -- the lower layers' windows, the chunk memory, the query of the last
        landmark (scored when a later step needs its retrieval row) -- and empties the upper layers' windows; no
        part of it reads the whole chunk memory, so its cost per token does not grow with the position. Logits are
        then exact again from ``window_reach`` tokens on; a long prefix is streamed this way except for its last
        ``window_reach`` tokens (passkey evaluation).
        """
        if memory_only and len(self.groups) != 1:
            raise ValueError("memory_only needs a single retrieval group: later groups query upper-layer states")
        return self._step(input_ids, state, last_logits, memory_only)

    @property
    def window_reach(self) -> int | None:
        """The shortest run of tokens after ``memory_only`` steps whose last logits are exact: one more than the
        upper stack's sliding-window receptive field (counted in stream positions, which N tokens always cover).
        ``None`` when ``memory_only`` is unsupported (several retrieval groups)."""
        return self.cfg.n_upper_layers * self.cfg.window + 1 if len(self.groups) == 1 else None

    def _cp_step(self, input_ids: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        return self._step(input_ids, None, cp=cp)

    def _needle_step(self, input_ids: torch.Tensor, needle: NeedleLabels, *, hidden: bool) -> torch.Tensor:
        if self.cfg.retrieval_scope == "document" or self.cfg.retrieval == "random":
            raise ValueError(
                "retrieval_labels supervise the learned retriever over the whole sequence: not with "
                "model.retrieval=random or model.retrieval_scope=document"
            )
        return self._step(input_ids, None, hidden=hidden, needle=needle)

    def _step(
        self,
        input_ids: torch.Tensor,
        state: StreamState | None,
        last_logits: int | None = None,
        memory_only: bool = False,
        cp: ContextParallel | None = None,
        hidden: bool = False,
        needle: NeedleLabels | None = None,
    ) -> torch.Tensor:
        """``cp``: run one rank's span of a sequence under context parallelism (``model.context_parallel``): the
        step starts after ``cp.n_prev`` tokens and takes from the other ranks what ``state`` would hold.
        ``needle`` (a whole sequence): each group's ``needle_loss`` is added to it."""
        cfg = self.cfg
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens]; got shape {tuple(input_ids.shape)}")
        if cp is not None and state is not None:
            raise ValueError("a context-parallel step takes its state from the other ranks, not from a StreamState")
        if cp is not None and cfg.retrieval_scope == "document":
            raise ValueError("model.retrieval_scope=document does not run under context parallelism")
        B, T = input_ids.shape
        n_prev = state.n_tokens if state else cp.n_prev if cp else 0
        layout = StepLayout.build(n_prev, T, cfg.chunk_size, input_ids.device)
        docs = self._chunk_documents(input_ids, layout, state) if cfg.retrieval_scope == "document" else None
        caches: list[KVCache | None] = [None] * (len(self.lower) + cfg.n_upper_layers)
        if state is not None:
            caches = list(state.caches)
        if cp is not None:
            caches = cp.halo_caches(len(caches))

        tokens = self.embed(input_ids)  # [B, T, d_model]
        landmarks = self.landmark.to(tokens.dtype).expand(B, layout.n_landmarks, -1)
        x = torch.cat([tokens, landmarks], dim=1)[:, layout.order]  # [B, L, d_model] stream order
        stream_start = layout.first_chunk * (cfg.chunk_size + 1) + layout.lead
        pos = window_positions(cfg, stream_start, layout.length, x.device, landmarks=True)
        for layer, cache in zip(self.lower, caches):
            x = layer(x, cache, pos)

        readable = self._encode_chunks(x, layout, state)
        if cp is not None:
            readable = cp.share_chunks(readable, x)
        caches = caches[len(self.lower) :]
        # nn.ModuleList iterates as plain Modules; every entry of self.groups is a RetrievalGroup.
        for g, group in enumerate(cast("list[RetrievalGroup]", list(self.groups))):
            if memory_only:
                self._skip_upper_layers(group, x, layout, state)
                break
            memory = self._retrieve(g, group, x, readable, layout, state, cp, docs, needle)
            for layer in group.layers:
                x = layer(x, caches.pop(0), memory, layout, pos)

        if state is not None:
            state.n_tokens += T
        if memory_only:
            return x.new_empty(B, 0, cfg.vocab_size)
        token_pos = layout.token_pos if last_logits is None else layout.token_pos[max(0, T - last_logits) :]
        h = self.norm(x[:, token_pos])  # [B, T, d_model]
        return h if hidden else self.lm_head(h)

    def _chunk_documents(
        self, input_ids: torch.Tensor, layout: StepLayout, state: StreamState | None
    ) -> ChunkDocuments:
        """The documents of every chunk readable in this step (``model.retrieval_scope=document``): this step's
        chunks, after those of earlier steps when streaming."""
        eos_id = cast(int, self.cfg.eos_id)  # __init__ refuses the document scope without one
        last_token = (layout.landmark_chunk + 1) * self.cfg.chunk_size - 1 - layout.n_prev
        docs, eos_count = ChunkDocuments.of_step(
            input_ids, eos_id, last_token, state.eos_count if state is not None else None
        )
        if state is None:
            return docs
        if input_ids.shape[1]:
            state.eos_count = eos_count
        if layout.n_landmarks:
            state.read_docs.append(docs.read)
            state.key_docs.append(docs.key)
        return ChunkDocuments(state.read_docs.view(), state.key_docs.view()) if state.read_docs.size else docs

    def _encode_chunks(
        self, x: torch.Tensor, layout: StepLayout, state: StreamState | None
    ) -> tuple[torch.Tensor, ChunkGather, ChunkGather] | None:
        """Encode the chunks completed in this step; return the landmark keys and chunk K/V readable now (``None``
        while no chunk is complete)."""
        P = self.cfg.chunk_size + 1
        if state is not None and state.pending is not None:
            x = torch.cat([state.pending, x], dim=1)  # the unfinished chunk's earlier positions come first
        n = layout.n_landmarks
        if n:
            keys, mem_k, mem_v = self.encoder(x[:, : n * P].reshape(x.shape[0], n, P, -1))
        if state is None:
            return (keys, mem_k, mem_v) if n else None
        state.pending = x[:, n * P :]
        if n:
            state.memory.append(keys, mem_k, mem_v)
        all_keys, all_k, all_v = state.memory.keys, state.memory.k, state.memory.v
        return None if all_keys is None or all_k is None or all_v is None else (all_keys, all_k, all_v)

    def _skip_upper_layers(
        self, group: RetrievalGroup, x: torch.Tensor, layout: StepLayout, state: StreamState | None
    ) -> None:
        """``memory_only``: empty the upper layers' windows and keep the last landmark's query instead of scoring
        the step's landmarks. Later steps read only that row (the step's other rows serve the skipped upper
        layers), and only when they run the upper layers; scoring every landmark against every stored chunk here
        made a segment's cost grow with its position."""
        if state is None:
            raise ValueError("memory_only needs a StreamState: it only updates what the state carries")
        state.caches[len(self.lower) :] = [KVCache() for _ in range(self.cfg.n_upper_layers)]
        if layout.n_landmarks:
            last = layout.landmark_pos[-1:]
            state.rows[0] = DeferredRow(group.query_norm(x[:, last]), layout.landmark_chunk[-1:])

    def _retrieve(
        self,
        g: int,
        group: RetrievalGroup,
        x: torch.Tensor,
        readable: tuple[torch.Tensor, ChunkGather, ChunkGather] | None,
        layout: StepLayout,
        state: StreamState | None,
        cp: ContextParallel | None,
        docs: ChunkDocuments | None,
        needle: NeedleLabels | None = None,
    ) -> RetrievedMemory | None:
        """Rows for every chunk this step touches: chunk ``c`` uses the row of landmark ``c - 1``; ``docs``: only
        chunks of the reader's document are visible (``model.retrieval_scope=document``)."""
        if readable is None:
            return None
        keys, mem_k, mem_v = readable
        cfg = self.cfg
        B = x.shape[0]
        random_picks = cfg.retrieval == "random"
        gumbel = cfg.gumbel_topk and self.training and not random_picks
        # Context parallelism: every rank scores its rows of the noise one process draws for the whole sequence.
        noise = cp.gumbel_uniform(B, x.device) if cp is not None and (gumbel or random_picks) else None
        recorded = state.picks if state is not None else self.picks if cp is None else None

        def score(queries: torch.Tensor, chunk: torch.Tensor) -> RetrievalRows:
            rows = retrieve(
                queries,
                keys,
                chunk,
                top_k=cfg.top_k,
                scale=self.retrieval_scale,
                gumbel=gumbel,
                grad=cfg.retrieval_grad,
                uniform=None if noise is None else noise[:, chunk],
                random_picks=random_picks,
                query_doc=None if docs is None else docs.read[:, chunk],
                key_doc=None if docs is None else docs.key[:, : keys.shape[1]],
            )
            record_picks(recorded, g, rows, chunk)
            return rows

        queries = group.query_norm(x[:, layout.landmark_pos])  # [B, n_landmarks, d_model]
        if needle is not None:
            needle.terms.append(needle_loss(queries, keys, needle.labels, scale=self.retrieval_scale))
        previous = state.rows[g] if state is not None else None
        if cp is not None:  # the row before the span is scored here from the previous rank's last query
            queries, previous = cp.previous_row(queries)
        if isinstance(previous, DeferredRow):
            previous = score(previous.query, previous.chunk)
        parts = [previous if previous is not None else RetrievalRows.empty(B, cfg.top_k, x.device)]
        if layout.n_landmarks:
            new_rows = score(queries, layout.landmark_chunk)
            # A row retrieves something when its chunk has an earlier one: known from the layout, with no sync.
            if layout.first_chunk + layout.n_landmarks >= 2:
                for name, value in retrieval_stats(new_rows, layout.landmark_chunk).items():
                    self.retrieval_stats[f"retrieval_{name}_g{g}"] = value
            parts.append(new_rows)
        rows = RetrievalRows.cat(parts)
        if state is not None:
            state.rows[g] = rows[-1:]
        rows = rows[: layout.n_chunks]
        if cp is not None:  # mem_k/mem_v hold the span's chunks: fetch the rest from their ranks
            k, v = cp.gather_chunks(mem_k, mem_v, rows.index)
        else:
            batch = torch.arange(B, device=x.device)[:, None, None]
            k, v = mem_k[batch, rows.index], mem_v[batch, rows.index]
        # Gathered once per group, shared by its layers: [B, C, R, S, H, D] -> the operator's [B, C, H, R, S, D].
        k = k.permute(0, 1, 4, 2, 3, 5).contiguous()
        v = v.permute(0, 1, 4, 2, 3, 5).contiguous()
        return RetrievedMemory(k=k, v=v, weights=rows.weights)
