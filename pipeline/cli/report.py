"""One markdown report of evaluation outputs: ``python -m pipeline.cli.report <eval --out dir> [<dir> ...]
[--out report.md]`` (``launch/report.py``) reads the results, plots and samples files ``launch/eval.py`` wrote into
each directory and writes one report (default: ``<first dir>/report.md``), each directory a row of its tables.
Exit status: 0 written; 2 a directory without results, an unreadable or malformed result file, or an output path
that is a link (one line naming it); 1 the report could not be written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep.entry import run
from data_prep.safe_write import check_name
from pipeline.evaluation.report import REPORT_FILE, write_report


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), write the report and print where it went."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directories", nargs="+", type=Path, help="--out directories of launch/eval.py")
    parser.add_argument("--out", type=Path, help=f"the report's path (default: <first directory>/{REPORT_FILE})")
    args = parser.parse_args(argv)
    out = args.out or args.directories[0] / REPORT_FILE
    try:
        check_name(out)  # before anything is read: a link planted at the report's name is refused
        write_report(args.directories, out)
    except ValueError as err:  # JsonFileError, ReportError and UnsafeWriteError: one line naming the file
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a read-only directory
        print(f"error: could not write {out} ({err.strerror or err})", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
