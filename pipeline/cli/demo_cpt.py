"""Continued pretraining, end to end: a tiny dense Llama trained, converted into GCA, trained on in two stages with
the retrieval-task mix, and compared with the dense model (passkey 1K -> 1M, perplexity by context):
``python -m pipeline.cli.demo_cpt [--config configs/demo_cpt/demo_cpt.yaml] [key=value ...]``.

The stages are described in ``pipeline/demos/demo_cpt.py``. Exit status: 0 done, 1 a stage failed (one line saying
which; rerunning continues where it stopped), 2 a bad config (one line naming the key).
"""

from __future__ import annotations

import argparse
import logging
import sys

from data_prep.entry import run
from data_prep.redaction import install_log_redaction
from data_prep.safe_write import UnsafeWriteError
from data_prep.schema import ConfigError
from pipeline.demos.demo_cpt import DemoCPTError, run_demo_cpt


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run every demo-cpt stage not done yet."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo_cpt/demo_cpt.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the demo-cpt config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [demo-cpt] %(message)s", datefmt="%H:%M:%S")
    install_log_redaction()
    try:
        run_demo_cpt(args.config, args.overrides)
    except (ConfigError, UnsafeWriteError) as err:  # a bad setting, or a link planted in the run folder
        print(f"demo-cpt: error: {err}", file=sys.stderr)
        return 2
    except DemoCPTError as err:
        print(f"demo-cpt: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run(main)
