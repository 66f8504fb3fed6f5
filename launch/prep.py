"""Prepare a tokenized MDS dataset: ``python launch/prep.py --config configs/data/<name>.yaml [key=value ...]``."""

import argparse
import logging
import sys

from data_prep.config import load_config
from data_prep.errors import PrepError
from data_prep.redaction import install_log_redaction
from data_prep.shard import main


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", help="YAML file with prep settings (see configs/data/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. tokenizer.vocab_size=8192")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()  # log lines name paths and values that may come from the environment
    try:
        main(load_config(args.config, args.overrides))
    except PrepError as exc:
        print(f"prep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prep: interrupted; no output was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
