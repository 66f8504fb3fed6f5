"""``GCAConfig``: every architectural choice of a GCA (DRT) model, validated once with errors naming the key."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from kernels.gca import GCA_BACKENDS, MAX_HEAD_DIM, MIN_HEAD_DIM
from kernels.swa import SWA_BACKENDS

ARCHS = ("gca", "swa", "full")
RETRIEVAL_SCALES = ("d_model", "head_dim")
RETRIEVALS = ("learned", "random")
RETRIEVAL_SCOPES = ("sequence", "document")
POSITIONS = ("alibi", "rope")
BACKEND_FIELDS = ("gca_backend", "swa_backend", "attn_backend")
"""Fields that choose how the model is computed, not what it computes (its weights and outputs stay the same)."""


class ConfigError(ValueError):
    """A model configuration value breaks a rule; the message names the key (``model.<field>``)."""


@dataclass
class GCAConfig:
    arch: str = "gca"
    """``gca``: the DRT model. ``swa``: the same-size sliding-window baseline (no encoder, no retrieval; its
    ``n_lower_layers + sum(groups) + n_encoder_layers`` plain sliding-window layers, like the paper's "+2 layers").
    ``full``: a full-attention transformer with RoPE, as many layers as ``swa`` (``window``, ``chunk_size``,
    ``top_k`` and the retrieval and backend keys do not apply to it)."""
    vocab_size: int = 4096
    """Tokenizer vocabulary size (the landmark is a learned vector, not a vocabulary id). The trainer takes it from
    the dataset's tokenizer when the config leaves it out (the size data prep recorded; this default only for a
    dataset without a manifest); a value the config sets must hold every token id of that tokenizer."""
    d_model: int = 128
    """Hidden size."""
    n_heads: int = 4
    """Query heads of self-attention and GCA."""
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention when smaller than ``n_heads``)."""
    ffn_hidden: int = 384
    """Hidden size of the SwiGLU MLP."""
    n_lower_layers: int = 2
    """Sliding-window decoder layers below the chunk encoder."""
    groups: list[int] = field(default_factory=lambda: [2])
    """Upper layers per retrieval group, e.g. ``[6]`` or ``[3, 3]``; each group retrieves once."""
    n_encoder_layers: int = 1
    """Bidirectional chunk-encoder layers producing landmark keys and chunk memories."""
    chunk_size: int = 16
    """Real tokens per chunk (the landmark is appended and never part of the chunk memory)."""
    top_k: int = 4
    """Chunks retrieved per query chunk."""
    window: int = 64
    """Sliding-window span in stream positions: position t attends to [t - window, t]."""
    softmax_off_by_one: bool = True
    """Add a virtual zero logit with zero value to every per-chunk GCA softmax."""
    gumbel_topk: bool = True
    """Sample the top-k with Gumbel noise during training (clean top-k in eval)."""
    retrieval_grad: bool = True
    """Let the LM loss train the retriever through the retrieval weights (false = stop-gradient ablation)."""
    retrieval: str = "learned"
    """``learned``: the landmark scores choose and weight the chunks (GCA). ``random``: the paper's random-retriever
    ablation, ``top_k`` visible chunks drawn uniformly without replacement (torch's RNG) with equal weights, in
    training and eval; the parameters stay the same (the query norms and landmark keys are then unused), so
    exports load either way."""
    retrieval_scope: str = "sequence"
    """Which earlier chunks a chunk may retrieve. ``sequence`` (the paper, the official code): every earlier chunk of
    the input, whatever document of a packed training sequence it belongs to. ``document``: only chunks of the
    reading chunk's own document, documents being separated by ``eos_id`` (a chunk counts for the document its last
    token belongs to). The same rule applies in training, evaluation and generation; the sliding window and the
    chunk encoder still see across boundaries."""
    eos_id: int | None = None
    """The end-of-document token that separates packed documents (``retrieval_scope=document``); the trainer takes
    it from the dataset's tokenizer when unset."""
    gca_output_bias: bool = True
    """Bias on the GCA output projection."""
    retrieval_scale: str = "d_model"
    """Retrieval score scale: ``d_model`` (1/sqrt(d_model), the paper) or ``head_dim``."""
    gca_backend: str = "auto"
    """Grouped Cross Attention operator (``kernels.gca.GCA_BACKENDS``): ``auto`` (Triton on CUDA, else ``matmul``),
    ``matmul`` (batched matmuls with a hand-written backward, the CPU path), ``sdpa`` (PyTorch's fused SDPA),
    ``naive`` (the readable reference) or ``triton`` (the fused kernels)."""
    swa_backend: str = "auto"
    """Sliding-window attention (``kernels.swa.SWA_BACKENDS``): ``auto`` (on CUDA FlashAttention, else
    FlexAttention; on CPU fused SDPA), ``gpu`` (the CUDA path, an error when unavailable), ``sdpa`` or ``naive``."""
    attn_backend: str | None = None
    """Shorthand for both backends, for older configs and exports: a GCA backend name; the window takes the same
    name where it has that backend (``naive``, ``sdpa``, ``auto``), else ``auto`` (``matmul``, ``triton``). When
    set it replaces ``gca_backend`` and ``swa_backend`` and is then cleared, so a saved config holds the two."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (one value everywhere, the encoder included)."""
    rope_theta: float = 10000.0
    """RoPE base of the chunk encoder (positions restart in every chunk), of the ``full`` model (absolute stream
    positions) and of the sliding window with ``position=rope``."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every linear and embedding weight."""
    position: str = "alibi"
    """Positions in the sliding-window attention (the GCA model's lower and upper layers, the ``swa`` baseline):
    ``alibi`` (the paper's DRT: a linear bias on stream distance) or ``rope`` (rotary, base ``rope_theta``, at each
    real token's index in the text; a landmark takes the index of the token after its chunk), which is what a
    converted dense model's weights expect (``model/convert.py``). Both see only the window, so both stay
    length-general."""
    tokens_see_landmarks: bool = True
    """Whether real tokens attend to the landmarks in their sliding window (the paper: yes). ``false`` hides them
    (landmarks still attend to everything in their window): a dense model converted with ``model/convert.py``
    then computes exactly the dense logits on sequences that fit in the window."""
    tie_embeddings: bool = True
    """The LM head is the embedding matrix. ``false``: a separate ``head`` projection (untied dense checkpoints, e.g.
    Llama-3-8B or Mistral-7B-v0.3, converted with ``model/convert.py``)."""
    qkv_bias: bool = False
    """Biases on the query/key/value projections of the sliding-window attention, the chunk encoder, the GCA query
    and the chunk-memory projections (Qwen2-style checkpoints have them)."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "chunk_size", "top_k", "window")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name} must be a positive integer; got {value!r}")
        for name in ("n_lower_layers", "n_encoder_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"model.{name} must be an integer >= 0; got {value!r}")
        self.groups = list(self.groups)
        if not self.groups or any(not isinstance(g, int) or isinstance(g, bool) or g < 1 for g in self.groups):
            raise ConfigError(f"model.groups must be a non-empty list of positive layer counts; got {self.groups!r}")
        if self.d_model % self.n_heads != 0:
            raise ConfigError(f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}")
        if self.arch not in ARCHS:
            raise ConfigError(f"model.arch={self.arch!r} is not one of {ARCHS}")
        if self.head_dim % 2 and (self.arch == "full" or self.n_encoder_layers):
            user = "model.arch=full" if self.arch == "full" else "the chunk encoder"
            raise ConfigError(
                f"model.d_model / model.n_heads = {self.head_dim} must be even: the RoPE of {user} rotates "
                "pairs of dimensions"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}")
        gca_key = self._apply_backend_shorthand()
        if self.gca_backend not in GCA_BACKENDS:
            raise ConfigError(f"model.gca_backend={self.gca_backend!r} is not one of {GCA_BACKENDS}")
        if self.swa_backend not in SWA_BACKENDS:
            raise ConfigError(f"model.swa_backend={self.swa_backend!r} is not one of {SWA_BACKENDS}")
        if self.gca_backend == "triton" and not MIN_HEAD_DIM <= self.head_dim <= MAX_HEAD_DIM:
            raise ConfigError(
                f"model.{gca_key}=triton supports head dims {MIN_HEAD_DIM}..{MAX_HEAD_DIM}; "
                f"model.d_model / model.n_heads = {self.head_dim} (change them, or use model.{gca_key}=naive)"
            )
        if self.retrieval not in RETRIEVALS:
            raise ConfigError(f"model.retrieval={self.retrieval!r} is not one of {RETRIEVALS}")
        if self.retrieval_scope not in RETRIEVAL_SCOPES:
            raise ConfigError(f"model.retrieval_scope={self.retrieval_scope!r} is not one of {RETRIEVAL_SCOPES}")
        if self.eos_id is not None and (
            not isinstance(self.eos_id, int) or isinstance(self.eos_id, bool) or not 0 <= self.eos_id < self.vocab_size
        ):
            raise ConfigError(f"model.eos_id must be a token id in [0, model.vocab_size); got {self.eos_id!r}")
        if self.retrieval_scope == "document" and self.arch != "gca":
            raise ConfigError(f"model.retrieval_scope=document applies to model.arch=gca only; got {self.arch!r}")
        if self.position not in POSITIONS:
            raise ConfigError(f"model.position={self.position!r} is not one of {POSITIONS}")
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"model.d_model / model.n_heads = {self.head_dim} must be even: model.position=rope rotates pairs "
                "of dimensions"
            )
        if self.retrieval_scale not in RETRIEVAL_SCALES:
            raise ConfigError(f"model.retrieval_scale={self.retrieval_scale!r} is not one of {RETRIEVAL_SCALES}")
        for name in ("norm_eps", "init_std", "rope_theta"):
            value = getattr(self, name)
            # NaN fails every comparison and infinity passes `> 0`: both would surface deep inside the forward.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"model.{name} must be a finite number > 0; got {value!r}")

    def _apply_backend_shorthand(self) -> str:
        """Expand ``attn_backend`` into the two backends; return the key that chose the GCA backend (for errors)."""
        if self.attn_backend is None:
            return "gca_backend"
        if self.attn_backend not in GCA_BACKENDS:
            raise ConfigError(f"model.attn_backend={self.attn_backend!r} is not one of {GCA_BACKENDS}")
        self.gca_backend = self.attn_backend
        self.swa_backend = self.attn_backend if self.attn_backend in SWA_BACKENDS else "auto"
        self.attn_backend = None
        return "attn_backend"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def n_upper_layers(self) -> int:
        return sum(self.groups)

    @property
    def n_baseline_layers(self) -> int:
        """Layers of the ``swa`` and ``full`` baselines: every layer of the GCA model (lower, upper, encoder) as one
        plain decoder layer, so the models have a similar parameter budget."""
        return self.n_lower_layers + self.n_upper_layers + self.n_encoder_layers

    def to_dict(self) -> dict:
        """Every field but the ``attn_backend`` shorthand, which construction has already expanded."""
        data = asdict(self)
        del data["attn_backend"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> GCAConfig:
        """Build from a plain dict (e.g. an export's ``config.json``), rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config key(s): {', '.join('model.' + k for k in unknown)}")
        return cls(**data)
