"""Pretrain a GCA model: ``python|torchrun|deepspeed launch/pretrain.py --config configs/train/x.yaml [k=v ...]``.

The command line is ``pipeline.cli.train``'s (also runnable as ``python -m pipeline.cli.train``).
"""

from data_prep.entry import run
from pipeline.cli.train import main

if __name__ == "__main__":
    run(main)
