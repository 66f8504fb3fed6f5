"""The chunked linear + cross-entropy (``model.chunked_loss``) against the naive full-logits loss: the same loss
and gradients, and the ``[tokens, vocab]`` logits never alive at once."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config
from torch.distributed._tools.mem_tracker import MemTracker

from model import build_model, lm_loss
from model.chunked_loss import chunked_lm_loss

FP32 = dict(rtol=1e-5, atol=1e-6)


def naive_and_chunked(h, weight, labels, chunk_elements):
    """Loss and gradients of ``h`` and ``weight`` through the naive loss and through the chunked one, each from
    its own leaf copies, under an upstream gradient of 3 (so that backward's scaling is exercised)."""
    out = []
    for loss_fn in (
        lambda a, w: lm_loss(F.linear(a, w), labels),
        lambda a, w: chunked_lm_loss(a, w, labels, chunk_elements),
    ):
        a, w = h.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss = loss_fn(a, w)
        (3 * loss).backward()
        out.append((loss.detach(), a.grad, w.grad))
    return out


@pytest.mark.parametrize("rows", [1, 5, 7, 26, 1000])  # 26 = every row at once; 7 leaves a ragged last slice
def test_loss_and_gradients_equal_the_naive_loss(rows):
    torch.manual_seed(0)
    B, T, d, V = 2, 13, 8, 50
    labels = torch.randint(0, V, (B, T))
    labels[0, 3] = labels[1, 5] = labels[1, 12] = -100  # ignored targets, one of them at the unscored last position
    (ref, ref_h, ref_w), (got, got_h, got_w) = naive_and_chunked(
        torch.randn(B, T, d), torch.randn(V, d), labels, rows * V
    )
    torch.testing.assert_close(got, ref, **FP32)
    torch.testing.assert_close(got_h, ref_h, **FP32)
    torch.testing.assert_close(got_w, ref_w, **FP32)
    assert got_h[0, 2].abs().max() == 0 and got_h[:, -1].abs().max() == 0  # rows whose target is ignored / absent


def test_every_label_ignored_gives_nan_like_cross_entropy():
    h, w = torch.randn(1, 4, 8), torch.randn(10, 8)
    labels = torch.full((1, 4), -100)
    assert torch.isnan(chunked_lm_loss(h, w, labels)) and torch.isnan(lm_loss(F.linear(h, w), labels))


def test_no_gradient_is_made_without_autograd():
    """Under no_grad (validation) only the loss is computed: one matmul per slice, not three."""
    h, w = torch.randn(1, 20, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    labels = torch.randint(0, 10, (1, 20))
    with torch.no_grad(), torch.profiler.profile() as prof:
        loss = chunked_lm_loss(h, w, labels, chunk_elements=50)  # 5 rows a slice: 4 slices
    torch.testing.assert_close(loss, lm_loss(F.linear(h, w), labels).detach(), **FP32)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::mm", 0) + counts.get("aten::addmm", 0) == 4


@pytest.mark.parametrize("arch", ["gca", "swa", "full"])
@pytest.mark.parametrize("tie", [True, False])
def test_the_models_chunked_loss_path_matches_their_logits(arch, tie):
    """``model(ids, labels, return_logits=False)`` (the trainer's loss): the loss and every parameter's gradient,
    the tied embedding (LM head and input table at once) included, as through the full logits."""
    torch.manual_seed(0)
    model = build_model(tiny_config(arch=arch, tie_embeddings=tie))
    ids = torch.randint(0, 256, (2, 45))
    ids[1, :4] = -100  # labels only: the inputs stay valid tokens
    inputs = ids.clamp_min(0)
    ref = model(inputs, labels=ids)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = model(inputs, labels=ids, return_logits=False)
    out.loss.backward()
    assert out.logits.shape == (2, 0, 256)
    torch.testing.assert_close(out.loss, ref.loss, **FP32)
    assert ref_grads["embed.weight"].abs().max() > 0
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], **FP32, msg=lambda m, n=name: f"{n}: {m}")


def peak_bytes(loss_fn) -> int:
    """Peak bytes of the tensors alive during ``loss_fn().backward()``, as torch's MemTracker counts them."""
    tracker = MemTracker()
    with tracker:
        loss_fn().backward()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def test_the_logits_are_never_held_whole():
    """Memory proxy: 1,024 positions x vocab 4,096 are 16.8 MB of fp32 logits; the naive loss peaks at several
    such buffers (head output, log-softmax, their gradients), the chunked one below one logits buffer."""
    torch.manual_seed(0)
    B, T, d, V = 2, 512, 16, 4096
    labels = torch.randint(0, V, (B, T))
    logits_bytes = B * T * V * 4
    weight = torch.randn(V, d, requires_grad=True)
    h = torch.randn(B, T, d, requires_grad=True)
    naive = peak_bytes(lambda: lm_loss(F.linear(h, weight), labels))
    chunked = peak_bytes(lambda: chunked_lm_loss(h, weight, labels, chunk_elements=1 << 16))
    assert naive > 2 * logits_bytes
    assert chunked < logits_bytes / 8


def test_under_bf16_autocast_as_the_naive_loss():
    """Autocast: the slices' logits are made in bf16 as ``F.linear`` makes them, so loss and gradients agree with
    the naive loss within bf16 rounding (1 part in 2^8 of each gradient's scale)."""
    torch.manual_seed(0)
    labels = torch.randint(0, 50, (2, 13))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (ref, ref_h, ref_w), (got, got_h, got_w) = naive_and_chunked(
            torch.randn(2, 13, 8), torch.randn(50, 8), labels, 250
        )
    assert got.dtype == ref.dtype == torch.float32 and got_w.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=0)
    assert (got_h - ref_h).abs().max() < ref_h.abs().max() / 2**7
    assert (got_w - ref_w).abs().max() < ref_w.abs().max() / 2**7
