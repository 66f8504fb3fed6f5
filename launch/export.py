"""Export a training checkpoint: ``python launch/export.py --checkpoint <run>/checkpoints/step_N --out <dir>``.

The export loads with ``model.load_pretrained`` and, offline, with ``transformers``' ``AutoModelForCausalLM`` /
``AutoTokenizer`` (``trust_remote_code=True``). The command line is ``pipeline.cli.export``'s (also runnable as
``python -m pipeline.cli.export``).
"""

from data_prep.entry import run
from pipeline.cli.export import main

if __name__ == "__main__":
    run(main)
