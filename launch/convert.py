"""Convert a dense Llama/Mistral/Qwen2 ``transformers`` checkpoint into a GCA export:
``python launch/convert.py --dense <dir> --out <dir> model.n_lower_layers=2 model.groups=[2] ...``.

The command line is ``pipeline.cli.convert``'s (also runnable as ``python -m pipeline.cli.convert``); docs/cpt.md.
"""

from data_prep.entry import run
from pipeline.cli.convert import main

if __name__ == "__main__":
    run(main)
