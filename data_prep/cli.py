"""Command lines of data prep: ``python -m data_prep.cli --config configs/data/<name>.yaml [key=value ...]`` prepares
a tokenized MDS dataset (``main``, also ``launch/prep.py``), and ``slices_main`` runs the three steps of a sliced
prep (``launch/slurm/prep_slices.py``, which ``launch/slurm/prep.sbatch`` runs on SLURM)::

    prep_slices.py tokenizer [--num-slices N] --config configs/data/x.yaml [key=value ...]
    prep_slices.py slice --index I --num-slices N --config configs/data/x.yaml [key=value ...]
    prep_slices.py merge --num-slices N --config configs/data/x.yaml [key=value ...]

Every step gets the same ``--config`` and overrides and derives its paths from ``output``. ``slice`` is a prep
with ``num_slices=N slice_index=I``, the tokenizer step's shared tokenizer in ``<output>.slices`` (``tokenizer.model=``,
or ``tokenizer.path=`` for ``tokenizer.type=hf``) and ``output=<output>.slices/slice-I``. Errors are one
line (bad input, never a traceback) and exit status 2; an interrupt exits 130.
"""

from __future__ import annotations

import argparse
import logging
import sys

from data_prep.config import PrepConfig, load_config
from data_prep.entry import run
from data_prep.errors import PrepError
from data_prep.format import IncompleteDatasetError
from data_prep.merge import merge_slices, prepare_tokenizer, slice_overrides
from data_prep.redaction import install_log_redaction, redact
from data_prep.safe_files import UnsafeDatasetError
from data_prep.safe_write import UnsafeWriteError
from data_prep.schema import add_keys_argument
from data_prep.shard import main as prep


def _setup_logging() -> None:
    """Prep's own INFO lines, and warnings from everything else.

    Not INFO from every logger: prep imports torch on a background thread (``data_prep.shard``), and torch registers
    an exit hook that logs FakeTensor cache statistics at INFO before its import sets its own loggers to WARNING. An
    error that ended prep during that import was followed by those lines, which read as a second failure.
    """
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("data_prep").setLevel(logging.INFO)
    install_log_redaction()  # log lines name paths and values that may come from the environment


def main(argv: list[str] | None = None) -> int:
    """Prep: parse ``argv`` (default: ``sys.argv[1:]``), prepare the dataset; 0 done, 2 bad input, 130 interrupted."""
    parser = argparse.ArgumentParser(description="Prepare a tokenized MDS dataset.")
    parser.add_argument("--config", help="YAML file with prep settings (see configs/data/)")
    add_keys_argument(parser, PrepConfig)
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. tokenizer.vocab_size=8192")
    args = parser.parse_args(argv)
    _setup_logging()
    try:
        prep(load_config(args.config, args.overrides))
    except (PrepError, UnsafeWriteError) as exc:
        print(f"prep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prep: interrupted; no output was written", file=sys.stderr)
        return 130
    return 0


def slices_main(argv: list[str] | None = None) -> int:
    """One step of a sliced prep (``tokenizer``, ``slice`` or ``merge``); the exit status as for ``main``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("tokenizer", "slice", "merge"))
    parser.add_argument("--config", help="YAML file with prep settings (see configs/data/)")
    parser.add_argument("--num-slices", type=int, help="how many slices the run has (tokenizer: checked early)")
    parser.add_argument("--index", type=int, help="slice: which slice (0-based; the array task id)")
    parser.add_argument("--keep-slices", action="store_true", help="merge: keep <output>.slices afterwards")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, the same for every step")
    args = parser.parse_intermixed_args(argv)  # the overrides may follow the options, after the step name
    if args.step != "tokenizer" and args.num_slices is None:
        parser.error(f"{args.step} needs --num-slices")
    if args.step == "slice" and args.index is None:
        parser.error("slice needs --index")
    _setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        if args.step == "tokenizer":
            prepare_tokenizer(cfg, args.num_slices or 1)
        elif args.step == "slice":
            per_slice = slice_overrides(cfg, args.num_slices, args.index)
            prep(load_config(args.config, [*args.overrides, *per_slice]))
        else:
            merge_slices(cfg, args.num_slices, keep_slices=args.keep_slices)
    except (PrepError, IncompleteDatasetError, UnsafeDatasetError, UnsafeWriteError) as exc:  # one line, no traceback
        print(f"prep_slices {args.step}: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"prep_slices {args.step}: interrupted; rerun this step", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    run(main)
