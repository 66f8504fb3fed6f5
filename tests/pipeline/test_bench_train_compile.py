"""``train.compile=blocks`` (``pipeline.train.parallel.compile_blocks``): a few optimizer steps of the compiled
model against the same steps in eager mode, and one compile per block class (blocks of a class share a graph)."""

import copy

import pytest
import torch
import torch._dynamo
from helpers import tiny_config

from model import build_model
from pipeline.train.compiles import CompileLog
from pipeline.train.parallel import blocks, compile_blocks

STEPS = 3
BLOCK_CLASSES = {"gca": 3, "swa": 1, "full": 1}
"""Distinct block classes: GCA's lower (sliding-window), encoder and upper layers; one for each baseline."""


def run(model, steps):
    """Losses, and gradients after the last step, of ``steps`` AdamW steps on fixed random batches (the Gumbel noise
    seeded per step, so both runs draw the same); the Dynamo compiles of each step (a backward graph is a compile
    record too), none of them a recompile."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, compiles, log = [], [], CompileLog()
    for step in range(steps):
        torch.manual_seed(step)
        ids = torch.randint(0, 256, (2, 70))
        loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
        losses.append(loss.detach())
        made = log.take()
        assert all(c.reason is None for c in made), [c.describe() for c in made]  # never a recompile
        compiles.append(len(made))
        if step < steps - 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}, compiles


def compiled_vs_eager(arch, backend):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graph breaks are counted process-wide: only this test's count
    torch.manual_seed(0)
    eager = build_model(tiny_config(arch=arch, n_lower_layers=2, groups=[2], gumbel_topk=True))
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled, backend=backend) == len(blocks(eager)) > BLOCK_CLASSES[arch]
    return run(eager, STEPS), run(compiled, STEPS)


@pytest.mark.parametrize("arch", ["gca", "swa", "full"])
def test_compiled_blocks_train_as_eager_ones_and_compile_once_per_class(arch):
    """Dynamo's own capture without a code generator (``aot_eager``): the same operators, so the same numbers
    bitwise; the capture and its compile count are what the GPU's compiled step uses."""
    (ref, ref_grads, no_compiles), (got, got_grads, compiles) = compiled_vs_eager(arch, "aot_eager")
    assert torch.equal(got, ref)
    for name, grad in ref_grads.items():
        assert torch.equal(got_grads[name], grad), name
    assert not any(no_compiles)
    # A forward and a backward graph per block class in the first step, nothing in later steps.
    assert compiles == [2 * BLOCK_CLASSES[arch]] + [0] * (STEPS - 1)
    assert torch._dynamo.utils.counters["graph_break"] == {}


@pytest.mark.slow
def test_inductor_compiled_gca_blocks_within_fp32_tolerance():
    """Inductor's CPU code (fused loops, its own reduction orders): fp32 rounding apart, the same training."""
    (ref, ref_grads, _), (got, got_grads, compiles) = compiled_vs_eager("gca", "inductor")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert compiles == [2 * BLOCK_CLASSES["gca"]] + [0] * (STEPS - 1)
