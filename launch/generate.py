"""Sample from a model export: ``python launch/generate.py --checkpoint <export dir> --prompt "Once upon"``.
The prompt (or ``--prompt-file``) is streamed segment by segment, so a long prompt costs bounded memory."""

import argparse
import sys
from pathlib import Path

from pipeline.evaluation.generate import generate
from pipeline.evaluation.runtime import load_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt")
    source.add_argument("--prompt-file", type=Path)
    for name, kind, default in (("max-new-tokens", int, 128), ("temperature", float, 0.8), ("top-k", int, 0),
                                ("top-p", float, 0.95), ("seed", int, 0), ("offload-mb", int, 1024)):
        p.add_argument(f"--{name}", type=kind, default=default)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    ckpt = load_checkpoint(args.checkpoint, args.device)
    prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    tok = ckpt.tokenizer
    stop = (tok.eos_id,) if tok.eos_id is not None else ()
    out: list[int] = []
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for token in generate(ckpt.model, tok.encode(prompt), args.max_new_tokens, stop_ids=stop,
                          offload_mb=args.offload_mb, **sampling):
        text = tok.decode(out + [token])[len(tok.decode(out)) :]  # decode in context: pieces merge spaces
        out.append(token)
        print(text, end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
