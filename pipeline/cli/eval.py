"""Evaluate a model export: ``python -m pipeline.cli.eval --checkpoint <export dir> --task ppl|passkey|ruler
--out <dir> [--config <yaml>] [key=value ...]`` writes ``<dir>/<task>.json`` and ``<dir>/<task>.png`` (ruler also
``<dir>/ruler.md``).
Keys: ``pipeline/evaluation/config.py``. Exit status: 0 done, 1 the result could not be written where asked,
2 bad input (found before any evaluation ran), 130 interrupted (Ctrl-C; passkey and ruler keep their finished
samples in ``--out`` and the same command continues from them)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from data_prep.entry import run
from data_prep.redaction import install_log_redaction, redact
from data_prep.schema import add_keys_argument
from pipeline.evaluation.config import TASKS, EvalConfig
from pipeline.evaluation.far_recall import shown_with_counts
from pipeline.evaluation.run import EvalInterrupted, EvalOutputError, run_eval


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the eval and print one line per result row."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", required=True, help="export directory (config.json + model.safetensors)")
    parser.add_argument("--task", required=True, choices=list(TASKS))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--config", help="optional YAML with eval keys (e.g. configs/eval/passkey_1m.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. lengths=[1024,65536] samples=2")
    add_keys_argument(parser, EvalConfig)  # acts while parsing, like --help: the required options are not needed
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    try:
        result = run_eval(args.checkpoint, args.task, args.out, args.overrides, args.config)
    except (ValueError, FileNotFoundError) as err:  # bad input, found before any evaluation ran
        print(f"error: {redact(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # one line, like the trainer's: what was kept and how to go on
        kept = f"{err}; " if isinstance(err, EvalInterrupted) else ""
        print(f"interrupted: {kept}rerun the same command to continue", file=sys.stderr)
        return 130
    except EvalOutputError as err:  # the eval finished; its result is somewhere else
        print(f"error: {err}", file=sys.stderr)
        if err.saved_to is None:
            print(json.dumps(err.result, indent=2))
        return 1
    for row in result["results"]:
        print(shown_with_counts(row))
    print(f"peak RSS {result['peak_rss_mib']} MiB, {result['seconds']} s -> {args.out}/{args.task}.json")
    return 0


if __name__ == "__main__":
    run(main)
