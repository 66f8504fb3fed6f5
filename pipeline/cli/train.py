"""Pretrain a GCA model: ``python -m pipeline.cli.train --config configs/train/x.yaml [k=v ...]``.

The same front-end serves ``launch/pretrain.py`` under ``python``, ``torchrun`` and ``deepspeed``.
``--local_rank`` (passed by the deepspeed launcher) is accepted and ignored: ``pipeline.train.dist`` reads LOCAL_RANK.
"""

from __future__ import annotations

import argparse

from data_prep.entry import run
from data_prep.schema import add_keys_argument
from pipeline.train.config import TrainConfig
from pipeline.train.trainer import main as train


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the trainer; returns its exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", required=True, help="YAML file (values for pipeline.train.config.TrainConfig); needed unless --keys"
    )
    add_keys_argument(parser, TrainConfig)  # acts while parsing, like --help: --config is not needed with it
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=10")
    args = parser.parse_args(argv)
    return train(args.config, args.overrides)


if __name__ == "__main__":
    run(main)
