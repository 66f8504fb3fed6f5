"""The demo (``make demo``): prep output -> DeepSpeed training of GCA + baseline -> passkey/ppl eval -> results
table: ``python launch/demo.py [--config configs/demo/demo.yaml] [key=value ...]``.

The command line is ``pipeline.cli.demo``'s (also runnable as ``python -m pipeline.cli.demo``).
"""

from data_prep.entry import run
from pipeline.cli.demo import main

if __name__ == "__main__":
    run(main)
