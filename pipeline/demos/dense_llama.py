"""A tiny dense ``transformers`` ``LlamaForCausalLM`` trained on a prepared dataset: the dense checkpoint that
``make demo-cpt`` converts into a GCA model (``checkpoint.init_from=hf:<dir>``).

The model is built offline from a ``LlamaConfig`` (nothing is downloaded) and trained with a plain AdamW loop on
the dataset's packed training sequences (``pipeline.data.reader``: the trainer's own seeded sequence stream), so
the dense model and the GCA model trained from it read the same kind of text with the same tokenizer. The output
is a normal ``transformers`` folder: ``config.json``, ``model.safetensors``, the dataset's ``tokenizer.model``
(which the GCA trainer compares with its dataset's) and ``train_log.json`` (loss per step, val loss, seconds).
It is written to ``<out>.tmp`` and renamed when complete, so an interrupted run leaves no half folder:
``python -m pipeline.demos.dense_llama --data data/demo_lm --out runs/demo_cpt/dense [--steps 200 ...]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from data_prep.safe_write import move, write_bytes, write_text
from pipeline.data.reader import MDSReader, PackedSequences, eos_id_of

log = logging.getLogger(__name__)

TOKENIZER = "tokenizer.model"


def dense_llama_config(args: argparse.Namespace, vocab_size: int) -> object:
    """The ``LlamaConfig`` of the dense model: pre-norm RMSNorm, SwiGLU, plain RoPE, grouped-query attention and
    tied embeddings, the layout ``model.convert`` accepts."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.d_model,
        intermediate_size=args.ffn_hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``lr`` then cosine to ``min_lr`` at the last step (the GCA trainer's schedule shape)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def val_loss(model: torch.nn.Module, data: str, seq_len: int, batches: int, batch: int) -> float | None:
    """Mean next-token loss over the first ``batches`` batches of the val split (None without one)."""
    try:
        reader = MDSReader(data, "val", cache_dir=None)
    except (FileNotFoundError, ValueError):
        return None
    stream = PackedSequences(reader, seq_len=seq_len, seed=0, shuffle=False, window=batch, eos_id=eos_id_of(data))
    losses = []
    model.eval()
    with torch.no_grad():
        for _ in range(batches):
            tokens = torch.from_numpy(stream.next(batch)[0].astype("int64"))
            losses.append(float(model(input_ids=tokens, labels=tokens).loss))
    model.train()
    return sum(losses) / len(losses)


def train_dense_llama(args: argparse.Namespace) -> Path:
    """Train the dense model and write its folder to ``args.out``; returns it."""
    from transformers import LlamaForCausalLM

    data, out = args.data, Path(args.out)
    tokenizer = Path(data) / TOKENIZER
    if not tokenizer.is_file():
        raise SystemExit(f"dense-llama: error: --data {data} has no {TOKENIZER}; prepare the dataset first")
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=str(tokenizer)).get_piece_size()
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(dense_llama_config(args, vocab))
    model.train()
    stream = PackedSequences(
        MDSReader(data, "train", cache_dir=None),
        seq_len=args.seq_len,
        seed=args.seed,
        shuffle=True,
        window=max(64, args.batch),
        eos_id=eos_id_of(data),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps: list[dict] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args)
        tokens = torch.from_numpy(stream.next(args.batch)[0].astype("int64"))
        loss = model(input_ids=tokens, labels=tokens).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        steps.append({"step": step + 1, "loss": round(loss.item(), 4)})
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - t0
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            log.info("step %d/%d loss %.3f (%.0f s, ETA %.0f s)", step + 1, args.steps, loss.item(), elapsed, eta)
    seconds = time.perf_counter() - t0
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a half folder an interrupted run of this command left
    tmp.mkdir()  # empty and made here, so no name inside it can have been planted for transformers to write through
    model.save_pretrained(tmp, safe_serialization=True)
    write_bytes(tmp / TOKENIZER, Path(tokenizer).read_bytes())
    record = {
        "steps": steps,
        "val_loss": val_loss(model, data, args.seq_len, args.val_batches, args.batch),
        "seconds": round(seconds, 1),
        "tokens": args.steps * args.batch * args.seq_len,
        "seq_len": args.seq_len,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    write_text(tmp / "train_log.json", json.dumps(record, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    move(tmp, out)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a prepared dataset (train split, tokenizer.model)")
    parser.add_argument("--out", required=True, help="the transformers folder to write")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--ffn-hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--val-batches", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for key in ("steps", "seq_len", "batch", "warmup", "layers", "heads", "kv_heads", "log_every"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    if args.heads % args.kv_heads or args.d_model % args.heads:
        parser.error(f"--heads={args.heads} must divide --d-model and be a multiple of --kv-heads={args.kv_heads}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [dense-llama] %(message)s", datefmt="%H:%M:%S")
    train_dense_llama(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
