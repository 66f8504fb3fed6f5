"""The language-modelling demo (``make demo-lm``): GCA vs sliding window vs full attention, perplexity by context on
the same held-out tokens: ``python launch/demo_lm.py [--config configs/demo_lm/demo_lm.yaml] [key=value ...]``.

The command line is ``pipeline.cli.demo_lm``'s (also runnable as ``python -m pipeline.cli.demo_lm``).
"""

from data_prep.entry import run
from pipeline.cli.demo_lm import main

if __name__ == "__main__":
    run(main)
