"""Pretrain a GCA model: ``python|torchrun|deepspeed launch/pretrain.py --config configs/train/x.yaml [k=v ...]``.

``--local_rank`` (passed by the deepspeed launcher) is accepted and ignored: ``pipeline.dist`` reads LOCAL_RANK.
"""

import argparse
import sys

from pipeline.trainer import main


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file (values for pipeline.config.TrainConfig)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=10")
    args = parser.parse_args(argv)
    return main(args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(cli())
