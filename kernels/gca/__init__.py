"""Grouped Cross Attention (GCA) operator: ``o = sum_r weights[:, r] * softmax(q k_r^T * scale) v_r``.

Each retrieved chunk ``r`` gets its own softmax over its ``S`` memory slots; the per-chunk results are mixed by
the retrieval weights. The weights are differentiable: ``d o / d weights[:, r]`` is the per-chunk output, which
is the gradient that trains the retriever end to end.

Backends:
    ``naive``  readable fp32 PyTorch reference (``kernels.gca.naive``), any device.
    ``matmul`` two batched matmuls per direction with a hand-written backward (``kernels.gca.matmul``): the CPU
               path, measured 1.3x faster than ``sdpa`` forward+backward at the benchmark shapes.
    ``sdpa``   the R per-chunk softmaxes as one batched PyTorch SDPA call (``kernels.gca.sdpa``).
    ``triton`` fused Triton kernels (CUDA, or the CPU interpreter with ``TRITON_INTERPRET=1``).
    ``auto``   ``triton`` for CUDA tensors, ``matmul`` otherwise.
"""

from kernels.gca.dispatch import GCA_BACKENDS, gca_attention
from kernels.gca.limits import MAX_HEAD_DIM, MIN_HEAD_DIM
from kernels.gca.matmul import matmul_gca
from kernels.gca.naive import naive_gca
from kernels.gca.sdpa import sdpa_gca

__all__ = ["GCA_BACKENDS", "MAX_HEAD_DIM", "MIN_HEAD_DIM", "gca_attention", "matmul_gca", "naive_gca", "sdpa_gca"]
