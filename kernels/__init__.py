"""Attention operators for GCA models: plain PyTorch references and Triton kernels.

Dimension glossary, used in every shape comment of kernels/, model/ and the tests:

    B   batch (for GCA: batch x query chunks, flattened)
    T   tokens in a stream (landmarks included)
    HQ  query heads, H key/value heads, G = HQ // H (grouped-query attention)
    D   head dimension
    Q   query rows per GCA call (the tokens of one chunk, landmark included, or 1..Q decode tokens)
    S   memory slots per retrieved chunk (the chunk's real tokens; the landmark is never a memory slot)
    R   retrieved chunks per query chunk (the top-k of the retriever)

This package imports only torch and triton.
"""
