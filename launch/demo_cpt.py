"""The continued-pretraining demo (``make demo-cpt``): a dense Llama converted into GCA, trained on, and compared
with the dense model: ``python launch/demo_cpt.py [--config configs/demo_cpt/demo_cpt.yaml] [key=value ...]``.

The command line is ``pipeline.cli.demo_cpt``'s (also runnable as ``python -m pipeline.cli.demo_cpt``).
"""

from data_prep.entry import run
from pipeline.cli.demo_cpt import main

if __name__ == "__main__":
    run(main)
