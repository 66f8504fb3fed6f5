"""Training data as the trainer reads it: prepared MDS shards read and hash-checked (``reader``), packed into
fixed-length sequences and split into per-rank micro-batches, and the retrieval tasks a training sequence or an eval
sample carries (``needle``: needle texts and chunk-grid layouts; ``retrieval_tasks``: the task families, one builder
shared with ``pipeline.evaluation``; ``mix``: which training sequences get which task).

May import ``model``, ``kernels`` and ``data_prep``; no other ``pipeline`` group.
"""
