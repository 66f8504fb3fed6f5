"""Fused Triton GCA vs ``naive_gca`` natively on CUDA, at the model's shapes, in the training dtypes.

Shapes follow DRT: B = batch x chunks = 64, HQ = 12, Q = S + 1 = 65 query rows (landmark
included, the row the official kernel left uninitialised), S = 64 slots, R = 8 chunks, D = 64, plus GQA, R = 1,
decode-sized Q, S = 63 and D = 128, through both backward layouts (fused when G * Q <= 64, else split). Same
tolerance rule as the CPU tier (``gca_checks``) and NaN-poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch
from gca_checks import FLOOR, assert_gca_close, make_inputs

from kernels.gca import naive_gca
from kernels.gca.triton_gca import triton_gca, triton_gca_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("nan_kernel_outputs"),
]

# (B, HQ, H, Q, S, R, D, softmax_off_by_one)
CASES = [
    (64, 12, 12, 65, 64, 8, 64, False),
    (64, 12, 12, 65, 64, 8, 64, True),
    (64, 12, 3, 65, 64, 8, 64, False),
    (64, 12, 12, 64, 63, 1, 64, True),
    (64, 12, 4, 2, 64, 8, 64, False),
    (16, 8, 8, 65, 64, 4, 128, True),
    (16, 8, 2, 33, 100, 3, 96, False),
    # The fused backward (all G*Q rows in one query tile): the benchmark's shape, and D = 128 (16-slot tiles).
    (64, 12, 12, 64, 64, 8, 64, False),
    (16, 8, 8, 64, 64, 4, 128, True),
]


def case_id(case):
    return "B{}-HQ{}-H{}-Q{}-S{}-R{}-D{}-off{}".format(*case[:7], int(case[7]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_naive(case, dtype):
    *shape, off = case
    q, k, v, weights, do = make_inputs(*shape, dtype, device="cuda")
    weights = weights.float()  # the model feeds fp32 retrieval weights under bf16 autocast
    assert_gca_close(triton_gca, q, k, v, weights, do, softmax_off_by_one=off)


@pytest.mark.parametrize("Q", [1, 2, 65])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decode_matches_naive(Q, dtype):
    q, k, v, weights, _ = make_inputs(64, 12, 4, Q, 64, 8, 64, dtype, device="cuda")
    out = triton_gca_decode(q, k, v, weights, softmax_off_by_one=True)
    ref = naive_gca(q.double(), k.double(), v.double(), weights.double(), softmax_off_by_one=True)
    base = (naive_gca(q, k, v, weights, softmax_off_by_one=True).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    bound = 2 * base + FLOOR[dtype] * max(1.0, ref.abs().max().item())
    assert err <= bound, f"o: max error {err:.3e} > {bound:.3e} (2 x naive_gca in {dtype}: {base:.3e}, + floor)"
