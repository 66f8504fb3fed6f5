"""Training data as the trainer reads it: prepared MDS shards read and hash-checked (``reader``), packed into
fixed-length sequences and split into per-rank micro-batches, and the needle a training sample or an eval sample
carries (``needle``: one definition of a needle and its chunk-grid layout, shared with ``pipeline.evaluation``).

May import ``model``, ``kernels`` and ``data_prep``; no other ``pipeline`` group.
"""
