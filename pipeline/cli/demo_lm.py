"""The language-modelling demo: prep without the held-out packages -> DeepSpeed training of GCA, the sliding-window
model and full attention -> perplexity by context on the same tokens -> results:
``python -m pipeline.cli.demo_lm [--config configs/demo_lm/demo_lm.yaml] [key=value ...]``.

The stages are described in ``pipeline/demos/demo_lm.py``. Exit status: 0 done, 1 a stage failed or a held-out
package is unusable (one line saying which; rerunning continues where it stopped), 2 a bad config (one line
naming the key).
"""

from __future__ import annotations

import argparse
import logging
import sys

from data_prep.entry import run
from data_prep.redaction import install_log_redaction
from data_prep.safe_write import UnsafeWriteError
from data_prep.schema import ConfigError
from pipeline.demos.demo_lm import DemoLMError, run_demo_lm


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run every demo-lm stage not done yet."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo_lm/demo_lm.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the demo-lm config")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [demo-lm] %(message)s", datefmt="%H:%M:%S")
    install_log_redaction()
    try:
        run_demo_lm(args.config, args.overrides)
    except (ConfigError, UnsafeWriteError) as err:  # a bad setting, or a link planted in the run folder
        print(f"demo-lm: error: {err}", file=sys.stderr)
        return 2
    except DemoLMError as err:
        print(f"demo-lm: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run(main)
