"""Sample from a model export: ``python -m pipeline.cli.generate --checkpoint <export dir> --prompt "Once upon"``.
The prompt (or ``--prompt-file``) is streamed segment by segment, so a long prompt costs bounded memory.
Exit status: 0 done, 2 a bad argument or export (found before the model runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep.entry import run
from data_prep.redaction import redact
from data_prep.schema import not_utf8
from pipeline.evaluation.generate import Sampling, check_sampling, generate
from pipeline.evaluation.runtime import StreamBudget, check_device, load_checkpoint


def check_args(args: argparse.Namespace) -> str:
    """Every argument checked before the model loads; returns the prompt text.

    Raises:
        ValueError: naming the option and its value.
    """
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.offload_mb < -1:
        raise ValueError(f"--offload-mb {args.offload_mb} must be >= 0 (MiB kept in RAM) or -1 (everything in RAM)")
    if args.seed < 0:
        raise ValueError(f"--seed {args.seed} must be >= 0")
    check_sampling(args.temperature, args.top_k, args.top_p)
    check_device(args.device, "--device")
    if args.prompt is not None:
        prompt = args.prompt
        if (bad := not_utf8(prompt)) is not None:  # the tokenizer takes text only
            raise ValueError(f"--prompt: {bad} is not UTF-8 text; give the prompt in UTF-8")
    elif not args.prompt_file.is_file():
        raise ValueError(f"--prompt-file {args.prompt_file}: not a file")
    else:
        try:
            prompt = args.prompt_file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"--prompt-file {args.prompt_file}: not UTF-8 text") from None
    if not prompt:
        raise ValueError("the prompt is empty; give at least one character")
    return prompt


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and stream the sampled text to stdout."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument("--prompt-file", type=Path)
    for name, kind, default in (
        ("max-new-tokens", int, 128),
        ("temperature", float, 0.8),
        ("top-k", int, 0),
        ("top-p", float, 0.95),
        ("seed", int, 0),
        ("offload-mb", int, 1024),
    ):
        p.add_argument(f"--{name}", type=kind, default=default)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    try:
        prompt = check_args(args)
        ckpt = load_checkpoint(args.checkpoint, args.device)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {redact(str(err))}", file=sys.stderr)
        return 2
    tok = ckpt.tokenizer
    stop = (tok.eos_id,) if tok.eos_id is not None else ()
    out: list[int] = []
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    budget = StreamBudget(offload_mb=args.offload_mb)
    for token in generate(
        ckpt.model, tok.encode(prompt), args.max_new_tokens, sampling=sampling, stop_ids=stop, budget=budget
    ):
        text = tok.decode(out + [token])[len(tok.decode(out)) :]  # decode in context: pieces merge spaces
        out.append(token)
        print(text, end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    run(main)
