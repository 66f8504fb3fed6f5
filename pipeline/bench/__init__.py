"""Every benchmark, each printing ratios against a baseline measured in the same run: the Triton GCA kernel
(``kernels``), model forward throughput and memory (``model``), the training step (``train``), context parallelism
(``cp``) and long-context eval time and memory (``eval``). The GPU check runs the kernel benchmark as one of its
stages.

May import every group below it (``data``, ``hf``, ``evaluation``, ``train``, ``demos``: its stage runner).
"""
