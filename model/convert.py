"""A dense Llama-family checkpoint (a ``transformers`` folder: ``config.json`` + safetensors) as a GCA model.

The mapping, for a dense model of ``N`` layers and a GCA layout with ``n_lower_layers + sum(groups) == N``:

* dense layers ``0 .. n_lower_layers - 1`` become the lower sliding-window layers, and the remaining ones the upper
  layers, group after group: every dense weight sits where it computed before (attention, MLP, both norms), the
  embedding, the final norm and the LM head too (tied or not, as in the checkpoint: ``model.tie_embeddings``).
  Queries and keys are re-ordered per head from the checkpoint's half-split rotary layout to this repository's
  interleaved pairs, which leaves every product unchanged.
* the chunk encoder's layer ``e`` is a copy of dense layer ``n_lower_layers + e`` (the first upper layers: they read
  what the encoder reads, the lower stack's output), its keys/values repeated over the query heads (the encoder
  has no grouped-query attention); its output norm is that first upper layer's input norm, and the chunk-memory
  projections are its key/value projections, so memories start as the keys/values that layer computes.
* each upper layer's GCA query norm and query projection are copies of the same layer's attention input norm and
  query projection; its output projection (weight and bias) starts at zero. The GCA output is then exactly 0, which
  is what makes the converted model compute the dense model's logits (with ``model.tokens_see_landmarks=false``
  and ``model.position=rope``) on any sequence whose stream fits in ``model.window``; farther, the window and
  retrieval replace full attention, which training has to teach.
* new: the landmark vector (the mean token embedding, a typical input rather than an outlier), each group's
  retrieval query norm and the encoder's input norm (unit gains).

``convert_dense_into`` returns where every GCA tensor came from; a checkpoint tensor the mapping does not place is
an error, so no dense weight is dropped silently. A layout the GCA model cannot reproduce is a ``ConversionError``
naming the ``config.json`` key (or the ``model.*`` key that does not fit).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch

from data_prep.json_file import Fields, JsonFileError, read_json
from model.config import GCAConfig
from model.gca import GCAForCausalLM
from model.io import ExportError, check_safetensors, read_export_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""``config.json`` ``model_type`` values whose layout (pre-norm RMSNorm, SwiGLU, RoPE, GQA) converts."""
_UNSUPPORTED_REASONS = {
    "qwen3": "per-head q_norm/k_norm on queries and keys",
    "olmo2": "norms after attention and MLP (post_feedforward_layernorm) and q_norm/k_norm",
    "gemma": "a (1 + weight) RMSNorm and a GELU MLP",
    "gemma2": "a (1 + weight) RMSNorm, soft-capping and a GELU MLP",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Tensors some checkpoints store that are derived from ``rope_theta`` (recomputed here)."""


PARAMETER_ROLES = ("dense", "gca", "memory", "retriever")
"""What a GCA parameter is for, which says whether a conversion placed it or added it (``parameter_role``)."""


def parameter_role(name: str) -> str:
    """The role of the GCA parameter ``name`` (a wrapper's extra name components, e.g. activation checkpointing's,
    do not matter): ``retriever`` (the landmark vector and the groups' retrieval query norms), ``memory`` (the
    chunk encoder and its memory projections), ``gca`` (the upper layers' Grouped Cross Attention) or ``dense``
    (what a dense transformer also has: embedding, self-attention, MLP, their norms, the final norm). A conversion
    places dense weights exactly in the ``dense`` parameters; the three others are what it adds ("new")."""
    parts = name.split(".")
    if "query_norm" in parts or parts[-1] == "landmark":
        return "retriever"
    if "encoder" in parts:
        return "memory"
    if "gca" in parts:
        return "gca"
    return "dense"


class ConversionError(ValueError):
    """The checkpoint's layout cannot become this GCA model; the message names the key."""


def read_dense_config(directory: str | Path) -> dict[str, Any]:
    """``config.json`` of a ``transformers`` folder, checked for a layout the GCA model can reproduce."""
    path = Path(directory) / "config.json"
    try:
        hf = read_json(path)
    except FileNotFoundError:
        raise ConversionError(f"{path}: no config.json; an hf: checkpoint is a transformers folder") from None
    except JsonFileError as exc:
        raise ConversionError(str(exc)) from None
    if not isinstance(hf, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    kind = hf.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        why = f" ({_UNSUPPORTED_REASONS[kind]})" if kind in _UNSUPPORTED_REASONS else ""
        raise ConversionError(
            f"{path}: model_type={kind!r}{why} does not convert; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int):
            raise ConversionError(f"{path}: {key} must be an integer; got {hf.get(key)!r}")
    rules: list[tuple[bool, str, str]] = [
        (hf.get("hidden_act", "silu") != "silu", "hidden_act", "the GCA MLP is SwiGLU (silu)"),
        (bool(hf.get("mlp_bias", False)), "mlp_bias", "the GCA MLP has no biases"),
        (hf.get("rope_scaling") is not None, "rope_scaling", "only plain RoPE (base rope_theta) converts"),
        (
            kind == "llama" and bool(hf.get("attention_bias", False)),
            "attention_bias",
            "Llama's attention_bias adds an o_proj bias, which the GCA attention does not have",
        ),
        (
            (kind == "qwen2" and bool(hf.get("use_sliding_window", False)))
            or (kind == "mistral" and hf.get("sliding_window") is not None),
            "use_sliding_window" if kind == "qwen2" else "sliding_window",
            "the checkpoint already uses sliding-window attention (its layers did not see full attention)",
        ),
        (
            any(t != "full_attention" for t in hf.get("layer_types") or []),
            "layer_types",
            "every dense layer must be full attention",
        ),
        (
            hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]),
            "head_dim",
            "the GCA head dim is hidden_size / num_attention_heads",
        ),
    ]
    for broken, key, why in rules:
        if broken:
            raise ConversionError(f"{path}: {key}={hf.get(key)!r} does not convert: {why}")
    return hf


DENSE_KEYS = (
    "arch",
    "vocab_size",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "norm_eps",
    "rope_theta",
    "qkv_bias",
    "tie_embeddings",
    "position",
)
"""The ``model.*`` keys a dense checkpoint decides (``dense_overrides``); the others are the GCA layout's."""


def dense_overrides(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model.*`` values a converted model must have, from a checked ``config.json`` (``read_dense_config``);
    the layout keys (``n_lower_layers``, ``groups``, ``n_encoder_layers``, ``chunk_size``, ``top_k``,
    ``window``) stay the caller's."""
    values = {
        "arch": "gca",
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "ffn_hidden": hf["intermediate_size"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(hf.get("rope_theta", 10000.0)),
        "qkv_bias": hf["model_type"] == "qwen2",
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "position": "rope",
    }
    assert tuple(values) == DENSE_KEYS
    return values


def checkpoint_model_keys(directory: str | Path, *, dense: bool) -> dict[str, Any]:
    """The `DENSE_KEYS` values of a model that starts from ``directory``: a dense ``transformers`` folder's
    (`dense_overrides` of its checked ``config.json``) or a GCA export's (the model of its ``config.json``), whose
    weights fix the same shapes. The one place both are read, for the trainer's ``checkpoint.init_from``.

    Raises:
        ConversionError: a dense folder whose layout does not convert (named).
        ExportError, FileNotFoundError: an export without a readable ``config.json``.
    """
    if dense:
        return dense_overrides(read_dense_config(directory))
    exported, _ = read_export_config(directory)
    return {key: getattr(exported, key) for key in DENSE_KEYS}


def check_fits(cfg: GCAConfig, directory: str | Path) -> dict[str, Any]:
    """Raise ``ConversionError`` naming the first ``model.*`` key that does not fit the checkpoint; return its
    checked ``config.json``."""
    hf = read_dense_config(directory)
    for key, want in dense_overrides(hf).items():
        if getattr(cfg, key) != want:
            raise ConversionError(
                f"model.{key}={getattr(cfg, key)!r} does not fit the dense checkpoint {directory}: set "
                f"model.{key}={want!r}"
            )
    n_layers = hf["num_hidden_layers"]
    if cfg.n_lower_layers + cfg.n_upper_layers != n_layers:
        raise ConversionError(
            f"model.n_lower_layers + sum(model.groups) = {cfg.n_lower_layers} + {cfg.n_upper_layers} must equal the "
            f"dense model's num_hidden_layers={n_layers}: every dense layer becomes a lower or an upper layer"
        )
    if cfg.n_encoder_layers > cfg.n_upper_layers:
        raise ConversionError(
            f"model.n_encoder_layers={cfg.n_encoder_layers} must be at most sum(model.groups)={cfg.n_upper_layers}: "
            "the encoder layers are copies of the first upper layers"
        )
    return hf


INDEX_NAME = "model.safetensors.index.json"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
"""A shard file name in ``weight_map``: one plain name in the folder, as ``transformers`` writes them (no ``/``, no
``..``, no leading ``.``); the rule dataset shard names follow (``data_prep.safe_files.check_shard_path``)."""


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a dense checkpoint: those its ``model.safetensors.index.json`` maps tensors to,
    else ``model.safetensors``. The whole index is checked before any file is opened: it is read with
    ``data_prep.json_file.read_json`` (bounded size and nesting), every ``weight_map`` value must be a plain file
    name inside ``directory`` (a value ``../outside/w.safetensors`` would read a file from anywhere), and each file
    must exist as a regular file (links followed, as the HF cache fills a snapshot folder with links; a FIFO would
    block the read). Only ``stat`` is used: nothing is opened but the index.

    Raises:
        ConversionError: one line naming the index and the entry (or the missing ``model.safetensors``).
    """
    index = directory / INDEX_NAME
    try:
        weight_map = Fields(read_json(index), str(index)).mapping("weight_map")
    except FileNotFoundError:
        single = directory / "model.safetensors"
        return [_regular_file(single, str(single))]
    except JsonFileError as exc:
        raise ConversionError(str(exc)) from None
    bad = [(tensor, name) for tensor, name in weight_map.items() if not _is_plain_name(name)]
    if bad:
        tensor, name = bad[0]
        raise ConversionError(
            f"{index}: weight_map entry {tensor!r} names {json.dumps(name)[:80]}, not a file name inside {directory} "
            f"({len(bad)} such entr{'y' if len(bad) == 1 else 'ies'}); nothing was read"
        )
    first = {name: tensor for tensor, name in reversed(weight_map.items())}  # each file's first entry, for messages
    return [
        _regular_file(directory / name, f"{index}: weight_map entry {tensor!r} names {name}, which")
        for name, tensor in sorted(first.items())
    ]


def _regular_file(path: Path, what: str) -> Path:
    """``path`` if it is a regular file (links followed), else a `ConversionError` starting with ``what``."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConversionError(f"{what} is missing (an hf: checkpoint needs its safetensors weights)") from None
    if not stat.S_ISREG(mode):
        raise ConversionError(f"{what} is not a regular file (a FIFO, device or directory?); weights come from one")
    return path


def _is_plain_name(name: object) -> bool:
    return isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None


def read_dense_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors (one file or an index of shards), in fp32; each file's header
    is checked before it is read (nothing is unpickled)."""
    from safetensors import safe_open

    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        try:
            check_safetensors(file)
        except ExportError as exc:
            raise ConversionError(str(exc)) from None
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name).float()
    return tensors


def _interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a query/key projection (weight ``[heads*D, in]`` or bias ``[heads*D]``) from the checkpoint's rotary
    layout, which rotates dims ``(i, i + D/2)``, to the pairs ``(2i, 2i + 1)`` that ``model.layers`` rotates (both
    with frequency ``i``)."""
    D = w.shape[0] // n_heads
    half = torch.arange(D // 2)
    order = torch.stack([half, half + D // 2], dim=-1).flatten()
    return w.view(n_heads, D, *w.shape[1:])[:, order].reshape(w.shape)


def _repeat_kv_rows(w: torch.Tensor, n_kv_heads: int, n_heads: int) -> torch.Tensor:
    """A key/value projection's rows repeated so that query head ``h`` gets key/value head ``h // (n_heads /
    n_kv_heads)``: grouped-query attention written as plain multi-head attention."""
    D = w.shape[0] // n_kv_heads
    return w.view(n_kv_heads, D, *w.shape[1:]).repeat_interleave(n_heads // n_kv_heads, dim=0).reshape(-1, *w.shape[1:])


def convert_dense_into(model: GCAForCausalLM, directory: str | Path) -> dict[str, str]:
    """Overwrite every parameter of ``model`` from the dense checkpoint in ``directory`` (the module docstring's
    mapping). Returns GCA tensor name -> its source (a checkpoint tensor name, or ``new: ...``).

    Raises:
        ConversionError: the layout does not convert, ``model.*`` does not fit, or the checkpoint holds a tensor the
            mapping does not place (named).
    """
    cfg = model.cfg
    check_fits(cfg, directory)
    dense = read_dense_weights(directory)
    used: set[str] = set()
    source: dict[str, str] = {}
    params = dict(model.named_parameters())

    def take(name: str) -> torch.Tensor:
        if name not in dense:
            raise ConversionError(f"{directory}: tensor {name} is missing from the checkpoint")
        used.add(name)
        return dense[name]

    def put(target: str, value: torch.Tensor, origin: str) -> None:
        param = params[target]
        if tuple(value.shape) != tuple(param.shape):
            raise ConversionError(
                f"{directory}: {origin} has shape {list(value.shape)}; the GCA tensor {target} needs "
                f"{list(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(value)
        source[target] = origin

    def proj(layer: int, name: str, part: str) -> str:
        return f"model.layers.{layer}.self_attn.{name}.{part}"

    H, HQ = cfg.n_kv_heads, cfg.n_heads
    parts = ("weight", "bias") if cfg.qkv_bias else ("weight",)

    def copy_decoder_layer(prefix: str, layer: int) -> None:
        """One dense layer into a lower or upper layer's self-attention, MLP and norms."""
        for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
            name = f"model.layers.{layer}.{theirs}.weight"
            put(f"{prefix}.{ours}.weight", take(name), name)
        for part in parts:
            for ours, theirs, heads in (("wq", "q_proj", HQ), ("wk", "k_proj", H)):
                name = proj(layer, theirs, part)
                put(f"{prefix}.attn.{ours}.{part}", _interleave_rope_rows(take(name), heads), name + " (rope pairs)")
            put(f"{prefix}.attn.wv.{part}", take(proj(layer, "v_proj", part)), proj(layer, "v_proj", part))
        put(f"{prefix}.attn.wo.weight", take(proj(layer, "o_proj", "weight")), proj(layer, "o_proj", "weight"))
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            name = f"model.layers.{layer}.mlp.{theirs}.weight"
            put(f"{prefix}.mlp.{ours}.weight", take(name), name)

    embed = take("model.embed_tokens.weight")
    if cfg.tie_embeddings:
        put("embed.weight", embed, "model.embed_tokens.weight (also the tied LM head)")
        if "lm_head.weight" in dense:  # some tied checkpoints store the head as well: it must be the same matrix
            if not torch.equal(take("lm_head.weight"), embed):
                raise ConversionError(
                    f"{directory}: tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight"
                )
    else:
        put("embed.weight", embed, "model.embed_tokens.weight")
        put("head.weight", take("lm_head.weight"), "lm_head.weight")
    put("norm.weight", take("model.norm.weight"), "model.norm.weight")
    put("landmark", embed.mean(0), "new: the mean of model.embed_tokens.weight")
    for i in range(cfg.n_lower_layers):
        copy_decoder_layer(f"lower.{i}", i)
    layer = cfg.n_lower_layers
    first_upper = layer
    for g, n in enumerate(cfg.groups):
        put(f"groups.{g}.query_norm.weight", torch.ones(cfg.d_model), "new: unit gains")
        for j in range(n):
            prefix = f"groups.{g}.layers.{j}"
            copy_decoder_layer(prefix, layer)
            norm = f"model.layers.{layer}.input_layernorm.weight"
            put(f"{prefix}.gca.norm.weight", dense[norm], norm + " (copy)")
            for part in parts:
                name = proj(layer, "q_proj", part)
                put(f"{prefix}.gca.wq.{part}", dense[name], name + " (copy)")
            zero = "new: zeros, so the GCA output starts at exactly 0"
            put(f"{prefix}.gca.wo.weight", torch.zeros_like(params[f"{prefix}.gca.wo.weight"]), zero)
            if cfg.gca_output_bias:
                put(f"{prefix}.gca.wo.bias", torch.zeros(cfg.d_model), zero)
            layer += 1

    put("encoder.prenorm.weight", torch.ones(cfg.d_model), "new: unit gains")
    norm = f"model.layers.{first_upper}.input_layernorm.weight"
    put("encoder.norm.weight", dense[norm], norm + " (copy)")
    for part in parts:
        for ours, theirs in (("mem_k", "k_proj"), ("mem_v", "v_proj")):
            name = proj(first_upper, theirs, part)
            put(f"encoder.{ours}.{part}", dense[name], name + " (copy)")
    for e in range(cfg.n_encoder_layers):
        src, prefix = first_upper + e, f"encoder.layers.{e}"
        for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
            name = f"model.layers.{src}.{theirs}.weight"
            put(f"{prefix}.{ours}.weight", dense[name], name + " (copy)")
        for part in parts:
            q = _interleave_rope_rows(dense[proj(src, "q_proj", part)], HQ)
            k = _interleave_rope_rows(_repeat_kv_rows(dense[proj(src, "k_proj", part)], H, HQ), HQ)
            v = _repeat_kv_rows(dense[proj(src, "v_proj", part)], H, HQ)
            origin = f"model.layers.{src}.self_attn.q/k/v_proj.{part} (copy; k/v repeated over the query heads)"
            put(f"{prefix}.wqkv.{part}", torch.cat([q, k, v]), origin)
        put(f"{prefix}.wo.weight", dense[proj(src, "o_proj", "weight")], proj(src, "o_proj", "weight") + " (copy)")
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            name = f"model.layers.{src}.mlp.{theirs}.weight"
            put(f"{prefix}.mlp.{ours}.weight", dense[name], name + " (copy)")

    left = sorted(n for n in dense if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if left:
        raise ConversionError(
            f"{directory}: {len(left)} checkpoint tensor(s) the conversion does not place, e.g. {left[0]} "
            "(a layout this converter does not know; nothing is dropped silently)"
        )
    unset = sorted(set(params) - set(source))
    if unset:  # a GCA parameter the mapping forgot would keep its random initialisation
        raise ConversionError(f"the conversion sets no value for GCA tensor(s) {unset}")
    return source


def convert_dense(directory: str | Path, layout: GCAConfig) -> tuple[GCAForCausalLM, dict[str, str]]:
    """A new GCA model with ``layout``'s layout keys and the checkpoint's shapes (``dense_overrides``), converted
    from ``directory``; the layout's ``tokens_see_landmarks`` is kept (``false`` for the dense logits)."""
    hf = read_dense_config(directory)
    cfg = GCAConfig.from_dict({**layout.to_dict(), **dense_overrides(hf)})
    model = GCAForCausalLM(cfg)
    return model, convert_dense_into(model, directory)
