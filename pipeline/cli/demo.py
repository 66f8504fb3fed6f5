"""The demo: prep output -> DeepSpeed training of GCA + baseline -> passkey/ppl eval -> results table:
``python -m pipeline.cli.demo [--config configs/demo/demo.yaml] [key=value ...]``.

The stages are described in ``pipeline/demos/demo.py``. Exit status: 0 done, 1 a stage failed or the data is missing
(one line saying which; rerunning continues where it stopped), 2 a bad demo config (one line naming the key).
"""

from __future__ import annotations

import argparse
import logging
import sys

from data_prep.entry import run
from data_prep.redaction import install_log_redaction
from data_prep.safe_write import UnsafeWriteError
from data_prep.schema import ConfigError
from pipeline.demos.demo import DemoError, run_demo


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run every demo stage not done yet."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the demo config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [demo] %(message)s", datefmt="%H:%M:%S")
    install_log_redaction()
    try:
        run_demo(args.config, args.overrides)
    except (ConfigError, UnsafeWriteError) as err:  # a bad setting, or a link planted in the run folder
        print(f"demo: error: {err}", file=sys.stderr)
        return 2
    except DemoError as err:
        print(f"demo: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run(main)
