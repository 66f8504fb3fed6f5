"""``python -m pipeline.evaluation <lm_eval arguments>``: the ``lm_eval`` CLI with the ``gca`` model registered."""

from lm_eval.__main__ import cli_evaluate

import pipeline.evaluation.lm_eval_adapter  # noqa: F401  (registers --model gca)

cli_evaluate()
