"""The pretraining pipeline, one sub-package per job. Lower groups never import higher ones
(``tests/test_layering.py`` enforces the order):

1. ``data``: the trainer's reader of prepared MDS datasets, packed sequences and per-rank batches, and what a
   retrieval task is (``data.retrieval_tasks``: the families and their chunk-grid layout, shared by the trainer's
   mix and the eval).
2. ``hf``: the Hugging Face format of an export (``transformers`` remote code, ``tokenizer.json``).
3. ``evaluation``: eval jobs on exports (perplexity by context, passkey, generation, lm-evaluation-harness).
4. ``train``: the trainer and everything it owns (config, engines, checkpoints, metrics, preflight, callbacks,
   the export of a checkpoint).
5. ``demos``: the resumable multi-stage demos and their reports.
6. ``bench``: every benchmark (kernels, model, training step, context parallelism, long eval).
7. ``gpucheck``: the one-command GPU readiness check.
8. ``cli``: the command lines behind ``launch/`` (``python -m pipeline.cli.<app>``).
"""
