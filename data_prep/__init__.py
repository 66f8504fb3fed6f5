"""Corpus preparation: tokenize with SentencePiece and shard into MDS datasets (``make prep``).

Modules: `config` (schema and loading), `sources` (input readers), `builtin` (the offline default
corpus), `tokenize` (SentencePiece training and encoding), `shard` (the `main` pipeline and atomic
output), `format` (the on-disk contract the trainer reads) and `streaming_compat` (import streaming
without torchvision). This package imports nothing from `model`, `pipeline` or `kernels`.
"""
