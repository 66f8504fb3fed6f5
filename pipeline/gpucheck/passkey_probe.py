"""The passkey eval of ``pipeline.cli.eval`` plus the accelerator's peak memory (a stage of ``launch/gpu_check.py``).

``python -m pipeline.gpucheck.passkey_probe --checkpoint <export> --out <dir> [key=value ...]`` runs the same
``run_eval`` as ``pipeline.cli.eval --task passkey`` and adds ``peak_gpu_mib`` (``torch.cuda.max_memory_allocated``,
null on CPU) to ``<dir>/probe.json``; the eval's own result stays in ``<dir>/passkey.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from data_prep.redaction import install_log_redaction
from data_prep.safe_write import write_text
from pipeline.evaluation.run import EvalOutputError, run_eval

log = logging.getLogger("passkey_probe")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="export directory")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("overrides", nargs="*", help="eval keys, e.g. lengths=[1048576] device=cuda")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    install_log_redaction()  # eval values may come from the environment
    try:
        result = run_eval(args.checkpoint, "passkey", args.out, args.overrides)
    except (ValueError, FileNotFoundError) as err:  # bad input, found before any evaluation ran
        log.error("error: %s", err)
        return 2
    except EvalOutputError as err:  # the eval finished; its result is somewhere else (named)
        log.error("error: %s", err)
        return 1
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    probe = {
        "rows": result["results"],
        "peak_rss_mib": result.get("peak_rss_mib"),
        "peak_gpu_mib": peak,
        "seconds": result.get("seconds"),
    }
    write_text(Path(args.out, "probe.json"), json.dumps(probe, indent=2) + "\n")
    log.info("%s", json.dumps(probe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
