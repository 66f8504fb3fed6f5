"""Pretraining pipeline: typed config, distributed setup, streaming data, engines, checkpoints, the trainer."""
