"""Check the nodes before a launch: ``[torchrun ...] python -m pipeline.cli.preflight [--gpus-per-node N]
--config X [k=v ...]``.

Start it exactly like the training run (same launcher, config and overrides); the checks are described in
``pipeline/train/preflight.py``. Exit status: 0 all checks passed, 1 a check failed (one line each), 2 a configuration
error.
"""

from __future__ import annotations

import argparse

from data_prep.entry import run
from pipeline.train.preflight import main as preflight


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run this rank's checks; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the training YAML (pipeline.train.config.TrainConfig)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs every node must have (0 for a CPU run; default: not checked)",
    )
    parser.add_argument("--min-free-gb", type=float, default=10.0, help="free space required at run_dir at least")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="give up (exit 1) after this long")
    # Passed by the deepspeed launcher; pipeline.train.dist reads LOCAL_RANK instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="the training run's key=value overrides")
    args = parser.parse_args(argv)
    return preflight(args.config, args.overrides, args.gpus_per_node, args.min_free_gb, args.timeout_s)


if __name__ == "__main__":
    run(main)
