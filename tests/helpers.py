"""What many tests share: the tiny model config, the MDS dataset writer and the standard tolerances.

Imported as ``helpers`` (pytest puts ``tests/`` on ``sys.path`` for its root ``conftest.py``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from model import GCAConfig, preset

# ---------------------------------------------------------------- model config


def tiny_config(**overrides: object) -> GCAConfig:
    """The ``tiny`` model preset (``model.presets``: milliseconds on CPU, the readable reference operators, a
    byte-sized vocabulary) with ``overrides``; a test names the shapes its check depends on."""
    return preset("tiny", **overrides)


TINY_TRAIN_OVERRIDES: Mapping[str, object] = {
    "seed": 7,
    "model.vocab_size": 64,
    "model.d_model": 32,
    "model.n_heads": 2,
    "model.n_kv_heads": 2,
    "model.ffn_hidden": 64,
    "model.n_lower_layers": 1,
    "model.groups": "[1]",
    "model.n_encoder_layers": 1,
    "model.chunk_size": 8,
    "model.top_k": 2,
    "model.window": 16,
    "model.gca_backend": "naive",
    "model.swa_backend": "naive",
    "train.seq_len": 64,
    "train.micro_batch": 2,
    "train.global_batch": 4,
    "train.max_steps": 8,
    "optim.lr": 3e-3,
    "optim.min_lr": 3e-4,
    "schedule.warmup_steps": 2,
    "data.shuffle_window": 8,
    "logging.every": 1,
    "logging.progress": False,
}
"""The trainer's ``key=value`` settings for a ~0.05M-parameter GCA model over a 64-token vocabulary (a few ms per
step on CPU); the tests' training runs add their own keys on top."""


def train_overrides(run_dir: Path, data: Path, *layers: Mapping[str, object]) -> list[str]:
    """``run_dir``, ``data.path``, `TINY_TRAIN_OVERRIDES`, then each of ``layers`` (later wins), as overrides."""
    merged: dict[str, object] = {"run_dir": str(run_dir), "data.path": str(data), **TINY_TRAIN_OVERRIDES}
    for layer in layers:
        merged.update(layer)
    return [f"{k}={v}" for k, v in merged.items()]


# ---------------------------------------------------------------- datasets

MARKOV_VOCAB = 64
"""Token ids of ``markov_pieces`` are in ``[2, MARKOV_VOCAB)`` (0 and 1 stay free for unk and EOS)."""


def markov_pieces(n_docs: int, seed: int, vocab: int = MARKOV_VOCAB) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(doc_id, piece, tokens)`` of ``n_docs`` documents from one fixed Markov chain (``next = succ[cur]`` 90%
    of the time, so a tiny model learns it in a few dozen steps), 40-200 tokens each, cut into 1-3 pieces."""
    rng = np.random.default_rng(seed)
    succ = np.random.default_rng(0).permutation(np.arange(2, vocab))
    for doc_id in range(n_docs):
        length = int(rng.integers(40, 200))
        tokens = np.empty(length, dtype=np.uint16)
        tokens[0] = rng.integers(2, vocab)
        for t in range(1, length):
            follow = rng.random() < 0.9
            tokens[t] = succ[tokens[t - 1] - 2] if follow else rng.integers(2, vocab)
        for piece, part in enumerate(np.array_split(tokens, int(rng.integers(1, 4)))):
            yield doc_id, piece, part


def write_mds_split(
    out: Path,
    pieces: Iterable[tuple[int, int, np.ndarray | list[int]]],
    *,
    size_limit: int | None = None,
    hashes: tuple[str, ...] = (),
) -> None:
    """Write ``(doc_id, piece, tokens)`` rows to the MDS split directory ``out`` the way data prep does (uint16
    tokens, zstd). ``size_limit``: bytes per shard (default: the writer's); ``hashes``: shard hashes recorded."""
    from data_prep import format as fmt
    from data_prep.streaming_compat import ensure_streaming_importable

    ensure_streaming_importable()
    from streaming import MDSWriter

    options: dict[str, object] = {"hashes": list(hashes)} if hashes else {}
    if size_limit is not None:
        options["size_limit"] = size_limit
    with MDSWriter(out=str(out), columns=fmt.mds_columns("uint16"), compression="zstd", **options) as writer:
        for doc_id, piece, tokens in pieces:
            writer.write({fmt.TOKENS: np.asarray(tokens, dtype=np.uint16), fmt.DOC_ID: doc_id, fmt.PIECE: piece})


# ---------------------------------------------------------------- tokenizers


def train_test_tokenizer(lines: Iterable[str], vocab_size: int, **options: object) -> bytes:
    """A SentencePiece BPE model trained in memory on ``lines`` (one thread, quiet), with the special ids data prep
    gives its tokenizers (unk 0, EOS 1, no BOS or pad) and ``vocab_size`` as an upper bound; ``options`` add or
    override trainer flags (``byte_fallback``, ``character_coverage``, ...)."""
    import io

    import sentencepiece as spm

    out = io.BytesIO()
    settings: dict[str, object] = {
        "model_type": "bpe",
        "eos_id": 1,
        "bos_id": -1,
        "pad_id": -1,
        "unk_id": 0,
        "num_threads": 1,
        "minloglevel": 2,
        "hard_vocab_limit": False,
        **options,
    }
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, vocab_size=vocab_size, **settings)
    return out.getvalue()


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
r"""Llama-3's pre-tokenizer regex, as its ``tokenizer.json`` holds it (Qwen2's has ``\p{N}`` for ``\p{N}{1,3}``)."""
HF_SPECIALS = ["<|end_of_text|>", "<|begin_of_text|>"]
SPACE = "\u2581"


def hf_test_tokenizer(texts: Iterable[str], vocab_size: int, kind: str = "llama3"):
    """A ``tokenizers`` BPE trained in memory on ``texts`` (``vocab_size`` at most), laid out like a real model's
    ``tokenizer.json``:

    - ``llama3``: Llama-3's regex ``Split`` then ``ByteLevel`` (byte-level BPE, no normalizer);
    - ``qwen2``: the same with Qwen2's single-digit regex and an NFC normalizer;
    - ``llama2``: a SentencePiece-style BPE in the layout of Llama-2's ``tokenizer.json``: spaces become ``▁`` and a
      ``Prepend("▁")`` normalizer puts one before the text of every encode call, byte fallback.

    ``HF_SPECIALS`` are its first ids (special added tokens); ``<unk> <s> </s>`` for ``llama2``."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    if kind == "llama2":
        tok = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True))
        # trained on words (a pre-tokenizer), then given the normalizers Llama-2's file holds and no pre-tokenizer
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first")
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        )
        tok.train_from_iterator(texts, trainer)
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        tok.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        return tok
    tok = Tokenizer(BPE())
    pattern = LLAMA3_SPLIT if kind == "llama3" else LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=HF_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_hf_tokenizer(directory: Path, tokenizer, config: Mapping[str, object] | None = None) -> Path:
    """``tokenizer.json`` (and ``tokenizer_config.json`` when ``config`` is given) in ``directory``, as a model
    folder holds them."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


# ---------------------------------------------------------------- tolerances

EXACT: Mapping[str, float] = {"rtol": 0.0, "atol": 0.0}
"""Bit-identical: the same operations on the same inputs (a copy, a store, a reload)."""
FP64_REFERENCE: Mapping[str, float] = {"rtol": 0.0, "atol": 1e-12}
"""An fp64 fast path against the fp64 reference maths: only rounding of a different operation order."""
FP32_REORDERED: Mapping[str, float] = {"rtol": 1e-4, "atol": 1e-4}
"""The same fp32 maths cut differently (segments, single tokens, sliced operator calls vs one forward)."""


def save_tiny_dense(directory: Path, *, vocab_size: int = 64, tied: bool = True, kind: str = "llama") -> Path:
    """A random 2-layer ``LlamaForCausalLM`` (``kind="llama"``) or ``Qwen2ForCausalLM`` (``"qwen2"``) of the tiny
    trainer model's shapes, saved as a transformers folder (what ``checkpoint.init_from=hf:`` converts)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model_cls(config).save_pretrained(directory)
    return directory


def assert_close(
    got: torch.Tensor, want: torch.Tensor, tol: Mapping[str, float], msg: str | Callable[[str], str] | None = None
) -> None:
    """``torch.testing.assert_close`` with one of the named tolerances above."""
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"], msg=msg)


# ---------------------------------------------------------------- the retrieval mix


def one_family_mix(
    tokenizer: Path | bytes, seq_len: int, chunk_size: int, family: str = "single", *, chains: int = 2, fraction=1.0
):
    """A ``RetrievalMix`` of one family (what ``data.needle_mix`` + ``data.needle_variant`` build)."""
    from pipeline.data.mix import RetrievalMix, sentencepiece_codec
    from pipeline.data.retrieval_tasks import TaskShape

    return RetrievalMix(
        sentencepiece_codec(tokenizer),
        seq_len=seq_len,
        chunk_size=chunk_size,
        fraction=fraction,
        families={family: 1.0},
        shape=TaskShape(chains=chains),
    )


def insert_task(mix, seq: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, slice]:
    """The ids and the answer span of ``mix``'s first family's sample over ``seq``."""
    sample = mix.insert(seq, rng, mix.families[0])
    return sample.ids, sample.answer


def batch_forward_picks(model, ids: np.ndarray, monkeypatch) -> dict[tuple[int, int], list[list[int]]]:
    """(group, query chunk) -> valid picks of one batch forward of ``ids`` (one ``retrieve`` call per group): the
    independent reference for the picks the streaming eval records."""
    import model.gca as gca_module

    real_retrieve = gca_module.retrieve
    picks: dict[tuple[int, int], list[list[int]]] = {}

    def spy(queries, keys, chunk, **kwargs):
        rows = real_retrieve(queries, keys, chunk, **kwargs)
        g = len({group for group, _ in picks})
        for i, c in enumerate(chunk.tolist()):
            picks[(g, c)] = [[int(j) for j, w in zip(rows.index[0, i], rows.weights[0, i]) if w > 0]]
        return rows

    monkeypatch.setattr(gca_module, "retrieve", spy)
    with torch.inference_mode():
        model(torch.from_numpy(ids)[None])
    monkeypatch.undo()
    return picks


def grid_samples_with_picks(model, source, tokenizer, grid, monkeypatch) -> list[list[tuple[object, dict]]]:
    """Per depth of a one-length ``PasskeyGrid``, each sample as the eval draws it (seeded by (seed, length, depth
    index, sample)) with the picks of a batch forward of its input (``batch_forward_picks``)."""
    from pipeline.evaluation.passkey import build_sample

    (length,) = grid.lengths
    out = []
    for d, depth in enumerate(grid.depths):
        rows = []
        for s in range(grid.samples):
            rng = np.random.default_rng([grid.seed, length, d, s])
            sample = build_sample(
                source, tokenizer, grid.spec, length=length, depth=depth, rng=rng, chunk_size=model.cfg.chunk_size
            )
            rows.append((sample, batch_forward_picks(model, sample.ids[: sample.answer_start], monkeypatch)))
        out.append(rows)
    return out


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous the test starts at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_process_group(cmd: list[str], env: Mapping[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` (a launcher and its ranks) in a process group of its own; past ``timeout`` seconds the whole group is
    killed and ``TimeoutExpired`` raised (a failure), so no rank outlives the test."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env), cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_local_ranks(cmd: list[str], world: int, env: Mapping[str, str], cwd: Path, timeout: float) -> None:
    """``world`` copies of ``cmd``, rank ``r`` with ``RANK`` = ``LOCAL_RANK`` = ``r`` and ``WORLD_SIZE``, rendezvous
    on loopback at a free port; every one is waited for (or killed). Fails naming each rank that failed, with the
    end of its output."""
    base = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    procs = [
        subprocess.Popen(
            cmd,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [(r, p.returncode, log[-3000:]) for r, (p, log) in enumerate(zip(procs, logs)) if p.returncode]
    assert not failed, failed
