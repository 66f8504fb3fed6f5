"""Evaluation jobs on model exports: perplexity vs length (with the far recall of GCA's retriever, also measured
by the trainer's validation pass), passkey retrieval, sampling, lm-evaluation-harness.

Every job streams its input through ``model.forward_stream`` segment by segment, so memory is bounded by the
sliding window plus the chunk memory (``model.offload.MemmapChunkMemory`` moves its K/V to disk past a size).
Command lines: ``pipeline.cli.eval`` and ``pipeline.cli.generate`` (``launch/eval.py``, ``launch/generate.py``), and
``python -m pipeline.evaluation`` (``lm_eval`` with the ``gca`` model registered).
"""
