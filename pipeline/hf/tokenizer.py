"""Hugging Face tokenizer files for an export, encoding exactly as the tokenizer the data was made with.

A dataset tokenized with a Hugging Face ``tokenizer.json`` (``tokenizer.type=hf``) already has the file
``transformers`` reads: the export keeps it byte for byte and gets a ``tokenizer_config.json`` for the generic
``PreTrainedTokenizerFast`` naming the same special tokens (`write_hf_tokenizer_config`), so ``AutoTokenizer``
encodes exactly as ``tokenizers`` did in prep, and as the dense model's own tokenizer does. The rest of this module
is for SentencePiece models:

The project's SentencePiece models are lossless (``data_prep.tokenize.train_tokenizer``): identity normalisation,
no dummy prefix, no stripping, byte fallback; spaces become ``▁`` and nothing else changes; no BOS/EOS is added to a
text. ``transformers``' generic SentencePiece converter strips trailing spaces and rewrites space runs, so it would
not encode the same ids; ``tokenizer.json`` is therefore built here from the model's own pieces and scores:

- ``bpe`` (data prep's default) is exact for any text. ``unigram`` is not exact in two cases (see ``_unigram``):
  exact ties between segmentations, which ``tokenizers`` breaks differently (the same pieces in another order),
  and text that literally spells a control or byte piece.
- ``unigram`` models: the same pieces and scores, Viterbi segmentation (SentencePiece's algorithm).
- ``bpe`` models: SentencePiece merges the adjacent pair whose merged piece has the highest score; the scores are
  the pieces' negated ranks, so listing every pair that forms a piece, ordered by that piece's score, gives
  ``tokenizers``' rank-ordered BPE the same merge order.

Control pieces (``<s>``, ``</s>``) are special tokens for decoding, but typed text is never split at them
(``split_special_tokens``), as in SentencePiece, which encodes the characters ``</s>`` as text.
"""

from __future__ import annotations

import json
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2
from tokenizers import Tokenizer

from data_prep.dataset_tokenizer import TokenizerFiles
from data_prep.json_file import Fields, parse_json
from data_prep.safe_write import write_bytes, write_text

SPACE = "\u2581"
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
"""``ModelProto.SentencePiece.Type`` values."""
_UNIGRAM, _BPE = 1, 2
TOKENIZER_MODEL = "tokenizer.model"


class UnsupportedTokenizerError(ValueError):
    """A SentencePiece model whose encoding the HF files cannot reproduce exactly."""


def _proto(model: bytes) -> sentencepiece_model_pb2.ModelProto:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    return proto


def _check_lossless(proto: sentencepiece_model_pb2.ModelProto) -> None:
    spec = proto.normalizer_spec
    if spec.precompiled_charsmap or spec.add_dummy_prefix or spec.remove_extra_whitespaces:
        raise UnsupportedTokenizerError(
            "the SentencePiece model normalises text (charsmap, dummy prefix or whitespace removal); only the "
            "lossless models data_prep trains can be exported as Hugging Face tokenizer files"
        )
    if not proto.trainer_spec.byte_fallback:
        raise UnsupportedTokenizerError("the SentencePiece model has no byte fallback (data prep always enables it)")
    if proto.trainer_spec.model_type not in (_UNIGRAM, _BPE):
        raise UnsupportedTokenizerError(f"SentencePiece model type {proto.trainer_spec.model_type} is not supported")


def _bpe_merges(pieces: list[tuple[str, float, int]]) -> list[tuple[str, str]]:
    """Every split of every mergeable piece into two vocabulary pieces, best (highest-score) merged piece first."""
    vocab = {piece for piece, _, kind in pieces if kind in (_NORMAL, _USER_DEFINED, _UNUSED)}
    merges = []
    for rank, (piece, score, kind) in enumerate(pieces):
        if kind != _NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-score, rank, left, right))
    merges.sort()
    return [(left, right) for _, _, left, right in merges]


def _unigram(pieces: list[tuple[str, float, int]], unk_id: int) -> Tokenizer:
    """SentencePiece's unigram model: the same pieces and scores, Viterbi segmentation.

    SentencePiece never matches text against control, unknown or byte pieces; ``tokenizers`` matches every
    vocabulary string, so those get a score below every normal piece. That reproduces SentencePiece except:

    - where two segmentations have exactly the same total score, the two Viterbi implementations break the tie
      differently: the same pieces in another order, e.g. a run of 20 spaces as 8+12 spaces where SentencePiece
      gives 12+8 (measured: 1 of 48 standard-library files with a 2000-piece model; the decoded text is equal).
      No score change can fix it: both orders always have the same total;
    - on text that literally spells such a piece (``</s>``, ``<0x41>``), which ``tokenizers`` may still read as
      that piece: it prices unknown characters below the lowest score, and byte fallback needs the byte pieces'
      names.
    """
    from tokenizers.models import Unigram

    lowest = min(score for _, score, kind in pieces if kind == _NORMAL) - 1.0
    scored = [(piece, score if kind == _NORMAL else lowest) for piece, score, kind in pieces]
    return Tokenizer(Unigram(scored, unk_id=unk_id, byte_fallback=True))


def tokenizer_json(model: bytes) -> str:
    """``tokenizer.json`` text for the serialized SentencePiece ``model``.

    Raises:
        UnsupportedTokenizerError: the model normalises text, or is neither unigram nor BPE.
    """
    from tokenizers import decoders, normalizers
    from tokenizers.models import BPE

    proto = _proto(model)
    _check_lossless(proto)
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk_id = proto.trainer_spec.unk_id
    if proto.trainer_spec.model_type == _UNIGRAM:
        tok = _unigram(pieces, unk_id)
    else:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        tok = Tokenizer(BPE(vocab, _bpe_merges(pieces), unk_token=pieces[unk_id][0], fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok.to_str(pretty=True)


def special_tokens(model: bytes) -> dict[str, str]:
    """``unk_token`` / ``bos_token`` / ``eos_token`` / ``pad_token`` pieces the model defines."""
    proto = _proto(model)
    spec = proto.trainer_spec
    found = {}
    for key, index in (("unk_token", spec.unk_id), ("bos_token", spec.bos_id), ("eos_token", spec.eos_id)):
        if 0 <= index < len(proto.pieces):
            found[key] = proto.pieces[index].piece
    if 0 <= spec.pad_id < len(proto.pieces):
        found["pad_token"] = proto.pieces[spec.pad_id].piece
    return found


def special_token_ids(model: bytes) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for ``config.json`` (generation stops at EOS)."""
    spec = _proto(model).trainer_spec
    ids = {"bos_token_id": spec.bos_id, "eos_token_id": spec.eos_id, "pad_token_id": spec.pad_id}
    return {key: value for key, value in ids.items() if value >= 0}


_CARRIED_CONFIG_KEYS = ("chat_template", "model_max_length")
"""Keys of the source ``tokenizer_config.json`` that describe the tokenizer's use, not its class, and are kept."""


def write_hf_tokenizer_config(directory: Path, tokenizer: TokenizerFiles) -> dict[str, int]:
    """For a Hugging Face ``tokenizer.json`` already in ``directory``: write ``tokenizer_config.json`` and
    ``special_tokens_map.json`` naming its special tokens (as data prep chose them,
    ``data_prep.hf_tokenizer.special_ids``), and return ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for
    ``config.json``.

    ``PreTrainedTokenizerFast`` runs the file as it is (normalizer, pre-tokenizer, post-processor), where a
    model-specific class may rewrite parts of it (``LlamaTokenizerFast`` rebuilds the post-processor from
    ``add_bos_token``); ``clean_up_tokenization_spaces`` off keeps decoding the library's own.

    Raises:
        ValueError: the ``tokenizer.json`` or its config does not parse, or the config is not an object (named).
    """
    from data_prep import hf_tokenizer

    tok = hf_tokenizer.parse_tokenizer(tokenizer.data, str(directory / tokenizer.name))
    ids = hf_tokenizer.special_ids(tok, tokenizer.config)
    tokens = {
        f"{kind}_token": tok.id_to_token(ids[f"{kind}_id"])
        for kind in ("unk", "bos", "eos", "pad")
        if ids[f"{kind}_id"] >= 0
    }
    where = str(directory / "tokenizer_config.json")
    source = Fields(parse_json(tokenizer.config, where), where).obj if tokenizer.config is not None else {}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{key: source[key] for key in _CARRIED_CONFIG_KEYS if key in source},
        **tokens,
        "clean_up_tokenization_spaces": False,
    }
    write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2, sort_keys=True))
    write_text(directory / "special_tokens_map.json", json.dumps(tokens, indent=2, sort_keys=True))
    named = {"bos_token_id": ids["bos_id"], "eos_token_id": ids["eos_id"], "pad_token_id": ids["pad_id"]}
    return {key: value for key, value in named.items() if value >= 0}


def write_tokenizer_files(directory: Path, model: bytes) -> None:
    """Write ``tokenizer.model``, ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    tokens = special_tokens(model)
    write_bytes(directory / TOKENIZER_MODEL, model)
    write_text(directory / "tokenizer.json", tokenizer_json(model))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokens,
        # SentencePiece's encode adds nothing and decodes exactly; keep transformers from doing otherwise.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
    }
    write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2, sort_keys=True))
    write_text(directory / "special_tokens_map.json", json.dumps(tokens, indent=2, sort_keys=True))
