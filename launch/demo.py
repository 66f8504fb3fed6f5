"""`make demo`: prep output -> DeepSpeed training of GCA + baseline -> passkey/ppl eval -> results table.

python launch/demo.py [--config configs/demo/demo.yaml] [key=value ...]
"""

import argparse
import logging

from data_prep.redaction import install_log_redaction
from pipeline.demo import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the demo config")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [demo] %(message)s", datefmt="%H:%M:%S")
    install_log_redaction()
    main(args.config, args.overrides)
