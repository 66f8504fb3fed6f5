"""Limits of the Triton GCA kernel, importable without triton (the model validates its config against them)."""

MIN_HEAD_DIM = 16  # tl.dot needs every tile dimension >= 16
MAX_HEAD_DIM = 128  # q, k, v, dk, dv tiles of one program must fit in registers/shared memory
