"""Model behaviour on CPU with the naive backend: causality, retrieval gradients, streaming parity, export."""

import pytest
import torch
from helpers import FP32_REORDERED, assert_close
from helpers import tiny_config as shared_tiny_config

from model import ConfigError, GCAConfig, GCAForCausalLM, load_pretrained, save_pretrained

VOCAB = 64


# Two retrieval groups, grouped-query heads and chunks of 4: every path of the model in a 48-token input.
SHAPES = dict(
    vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, groups=[1, 1], chunk_size=4, window=6
)


def tiny_config(**overrides) -> GCAConfig:
    return shared_tiny_config(**{**SHAPES, **overrides})


def trained_model(cfg: GCAConfig, steps: int = 5, T: int = 48) -> GCAForCausalLM:
    """A few optimizer steps with a large LR so norm gains and the landmark move far from their init."""
    model = GCAForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, T))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert (model.groups[0].query_norm.weight - 1).abs().max() > 0.05
    return model.eval()


def test_shapes_and_loss_for_any_length():
    model = GCAForCausalLM(tiny_config())
    for T in (1, 3, 4, 5, 17, 40):
        ids = torch.randint(0, VOCAB, (2, T))
        out = model(ids, labels=ids)
        assert out.logits.shape == (2, T, VOCAB)
        if T > 1:
            expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            torch.testing.assert_close(out.loss, expected)


def test_prefix_logits_do_not_depend_on_total_length():
    """A length that is not a chunk multiple gives the same logits as the prefix of a longer input."""
    model = GCAForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, VOCAB, (1, 41))
    full = model(ids).logits
    for T in (13, 30, 37):
        torch.testing.assert_close(model(ids[:, :T]).logits, full[:, :T], rtol=1e-5, atol=1e-5)


def test_causality_across_chunks_and_through_retrieval():
    cfg = tiny_config(top_k=3)
    model = trained_model(cfg).eval()
    ids = torch.randint(0, VOCAB, (1, 80))
    base = model(ids).logits
    window_tokens = cfg.window * cfg.chunk_size // (cfg.chunk_size + 1)
    for t in (0, 3, 4, 22, 50):
        changed = ids.clone()
        changed[0, t] = (changed[0, t] + 1) % VOCAB
        logits = model(changed).logits
        assert torch.equal(logits[:, :t], base[:, :t]), f"token {t} changed earlier logits"
        # Beyond the sliding window, only retrieval can carry the change: it must (or the test proves nothing).
        far = t + 3 * window_tokens
        if far < ids.shape[1]:
            assert (logits[:, far:] - base[:, far:]).abs().max() > 1e-6, f"token {t} never reached by retrieval"


def test_without_gca_far_tokens_are_unreachable():
    """Control for the test above: zeroing the retrieval weights removes every path beyond the window."""
    cfg = tiny_config()
    model = trained_model(cfg).eval()
    for group in model.groups:
        for layer in group.layers:
            layer.gca.wo.weight.data.zero_()
    ids = torch.randint(0, VOCAB, (1, 80))
    changed = ids.clone()
    changed[0, 2] += 1
    # lower layers (1) + upper layers (2) widen the receptive field to 3 windows of stream positions.
    horizon = 3 * cfg.window
    torch.testing.assert_close(model(changed).logits[:, horizon:], model(ids).logits[:, horizon:])


@pytest.mark.parametrize("retrieval_grad", [True, False])
def test_retrieval_weights_get_gradient_unless_stopped(retrieval_grad):
    model = GCAForCausalLM(tiny_config(retrieval_grad=retrieval_grad))
    ids = torch.randint(0, VOCAB, (2, 64))
    model(ids, labels=ids).loss.backward()
    # The group query norm only influences the loss through the retrieval scores -> weights.
    grads = [g.query_norm.weight.grad for g in model.groups]
    if retrieval_grad:
        assert all(g is not None and torch.isfinite(g).all() and g.abs().max() > 0 for g in grads)
    else:
        assert all(g is None or g.abs().max() == 0 for g in grads)
    assert model.groups[0].layers[0].gca.wq.weight.grad.abs().max() > 0


@pytest.mark.parametrize("groups", [[2], [1, 1]])
def test_incremental_decoding_matches_full_forward_after_training(groups):
    model = trained_model(tiny_config(groups=groups))
    ids = torch.randint(0, VOCAB, (2, 45))
    with torch.no_grad():
        full = model(ids).logits
        state = model.new_stream_state()
        steps = [model.forward_stream(ids[:, t : t + 1], state) for t in range(ids.shape[1])]
    assert_close(torch.cat(steps, 1), full, FP32_REORDERED)
    assert torch.equal(torch.cat(steps, 1).argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("segment", [7, 16, 25])
def test_segmentwise_processing_matches_full_forward(segment):
    model = trained_model(tiny_config())
    ids = torch.randint(0, VOCAB, (1, 120))
    with torch.no_grad():
        full = model(ids).logits
        state = model.new_stream_state()
        parts = [model.forward_stream(ids[:, s : s + segment], state) for s in range(0, ids.shape[1], segment)]
    assert_close(torch.cat(parts, 1), full, FP32_REORDERED)
    # Only the window of self-attention keys is kept, whatever the input length.
    assert all(c.k.shape[1] <= model.cfg.window for c in state.caches)
    assert state.memory.size == ids.shape[1] // model.cfg.chunk_size


def test_gumbel_noise_only_in_training():
    model = GCAForCausalLM(tiny_config(gumbel_topk=True))
    ids = torch.randint(0, VOCAB, (1, 64))
    model.eval()
    torch.testing.assert_close(model(ids).logits, model(ids).logits)
    model.train()
    runs = [model(ids).logits for _ in range(4)]
    assert any((r - runs[0]).abs().max() > 0 for r in runs[1:])


def test_off_by_one_switch_changes_the_model():
    torch.manual_seed(1)
    a = GCAForCausalLM(tiny_config(softmax_off_by_one=True)).eval()
    b = GCAForCausalLM(tiny_config(softmax_off_by_one=False)).eval()
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, VOCAB, (1, 64))
    assert (a(ids).logits - b(ids).logits).abs().max() > 1e-6


def test_export_round_trip(tmp_path):
    model = trained_model(tiny_config())
    save_pretrained(model, tmp_path, {"train_seq_len": 48})
    loaded = load_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 30))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert loaded.embed.weight.data_ptr() != model.embed.weight.data_ptr()


def test_export_rejects_tensor_mismatch(tmp_path):
    save_pretrained(GCAForCausalLM(tiny_config()), tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"d_model": 32', '"d_model": 64')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(Exception, match="model.safetensors|size"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (dict(d_model=30), "model.d_model"),
        (dict(d_model=30, n_heads=2, n_kv_heads=2), "must be even"),
        (dict(n_kv_heads=3), "model.n_kv_heads"),
        (dict(groups=[]), "model.groups"),
        (dict(chunk_size=0), "model.chunk_size"),
        (dict(attn_backend="cuda"), "model.attn_backend"),
        (dict(top_k=-1), "model.top_k"),
        (dict(attn_backend="triton", d_model=32, n_heads=4), "model.attn_backend=triton supports head dims"),
        (dict(gca_backend="triton", d_model=32, n_heads=4), "model.gca_backend=triton supports head dims"),
        (dict(gca_backend="gpu"), r"model.gca_backend='gpu' is not one of \('auto', 'naive', 'matmul'"),
        (dict(swa_backend="matmul"), r"model.swa_backend='matmul' is not one of \('auto', 'naive', 'sdpa', 'gpu'\)"),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "shorthand,gca,swa",
    [("auto", "auto", "auto"), ("naive", "naive", "naive"), ("sdpa", "sdpa", "sdpa"), ("matmul", "matmul", "auto")],
)
def test_attn_backend_shorthand_sets_both_backends(shorthand, gca, swa):
    cfg = tiny_config(attn_backend=shorthand, gca_backend="triton", swa_backend="gpu")
    assert (cfg.gca_backend, cfg.swa_backend, cfg.attn_backend) == (gca, swa, None)
    assert "attn_backend" not in cfg.to_dict()
    assert GCAConfig.from_dict(cfg.to_dict()) == cfg


def test_backends_are_the_kernels_registries():
    from kernels.gca import GCA_BACKENDS
    from kernels.swa import SWA_BACKENDS

    for name in GCA_BACKENDS:
        if name != "triton":  # the head-dim rule of the Triton kernel is checked above
            assert tiny_config(gca_backend=name).gca_backend == name
    for name in SWA_BACKENDS:
        assert tiny_config(swa_backend=name).swa_backend == name


def test_export_with_the_attn_backend_key_still_loads(tmp_path):
    """Exports written before the two backend keys existed hold ``attn_backend``; they load with its meaning."""
    import json

    model = GCAForCausalLM(tiny_config()).eval()
    save_pretrained(model, tmp_path)
    config_path = tmp_path / "config.json"
    payload = json.loads(config_path.read_text())
    for key in ("gca_backend", "swa_backend"):
        del payload["model"][key]
    payload["model"]["attn_backend"] = "sdpa"
    config_path.write_text(json.dumps(payload))
    loaded = load_pretrained(tmp_path)
    assert (loaded.cfg.gca_backend, loaded.cfg.swa_backend) == ("sdpa", "sdpa")
    ids = torch.randint(0, VOCAB, (1, 20))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="model.chunk_len"):
        GCAConfig.from_dict({**tiny_config().to_dict(), "chunk_len": 64})


def test_last_logits_only_is_the_tail_of_the_full_logits():
    model = trained_model(tiny_config())
    ids = torch.randint(0, VOCAB, (1, 50))
    with torch.no_grad():
        full = model(ids).logits
        state = model.new_stream_state()
        head = model.forward_stream(ids[:, :30], state, last_logits=1)
        tail = model.forward_stream(ids[:, 30:], state, last_logits=5)
    assert head.shape == (1, 1, VOCAB) and tail.shape == (1, 5, VOCAB)
    assert_close(head[:, 0], full[:, 29], FP32_REORDERED)
    assert_close(tail, full[:, -5:], FP32_REORDERED)


def test_memory_only_prefix_gives_the_same_logits_after_the_window_reach():
    model = trained_model(tiny_config(groups=[2]), T=64)
    reach = model.window_reach
    assert reach == 2 * 6 + 1
    ids = torch.randint(0, VOCAB, (1, 90))
    with torch.no_grad():
        full = model(ids).logits

        def tail_logits(split: int) -> torch.Tensor:
            state = model.new_stream_state()
            skipped = model.forward_stream(ids[:, :split], state, memory_only=True)
            assert skipped.shape == (1, 0, VOCAB)
            return model.forward_stream(ids[:, split:], state)

        assert_close(tail_logits(90 - reach)[:, -1], full[:, -1], FP32_REORDERED)
        # Control: the skipped upper layers do matter inside the reach, and the far tokens are read via retrieval.
        assert (tail_logits(89)[:, -1] - full[:, -1]).abs().max() > 1e-3
        far = ids.clone()
        far[0, :60] = (far[0, :60] + 1) % VOCAB  # far beyond every window: read only through retrieval
        assert (model(far).logits[:, -1] - full[:, -1]).abs().max() > 1e-3


def test_memory_only_needs_a_single_group():
    model = GCAForCausalLM(tiny_config())
    assert model.window_reach is None
    with pytest.raises(ValueError, match="single retrieval group"):
        model.forward_stream(torch.zeros(1, 4, dtype=torch.long), model.new_stream_state(), memory_only=True)


@pytest.mark.parametrize(
    "store,split",
    # The last memory_only segment closes two chunks and the first tail token none, so the first tail row is the
    # deferred one. With 14 tokens the deferred row sees fewer chunks than top_k: all are picked, no extra one.
    [("ram", 154), ("disk", 154), ("ram", 14)],
    ids=["ram", "disk", "fewer-chunks-than-top-k"],
)
def test_memory_only_prefix_then_tail_matches_full_streaming(tmp_path, store, split):
    """Streaming a prefix with memory_only (its retrieval rows deferred) then the tail token by token gives the
    tail the logits and the retrieval picks of streaming every token through every layer."""
    from model.offload import MemmapChunkMemory

    model = trained_model(tiny_config(groups=[2], top_k=3), T=64)
    reach, segment = model.window_reach, 7  # segments cut chunks (of 4 tokens)
    ids = torch.randint(0, VOCAB, (1, split + 40))

    def stream(memory_only: bool) -> tuple[torch.Tensor, list]:
        memory = MemmapChunkMemory(ram_bytes=0, directory=tmp_path) if store == "disk" else None
        state = model.new_stream_state(memory=memory)
        with torch.inference_mode():
            for s in range(0, split, segment):
                model.forward_stream(ids[:, s : min(s + segment, split)], state, memory_only=memory_only)
            logits, rows = [], []
            for t in range(split, ids.shape[1]):
                logits.append(model.forward_stream(ids[:, t : t + 1], state))
                rows.append(state.rows[0])
        return torch.cat(logits, 1), rows

    got_logits, got_rows = stream(memory_only=True)
    want_logits, want_rows = stream(memory_only=False)
    # The upper layers' windows were emptied at the split: exact again once the tail fills their reach.
    assert_close(got_logits[:, reach - 1 :], want_logits[:, reach - 1 :], {"rtol": 1e-5, "atol": 1e-5})
    for got, want in zip(got_rows, want_rows, strict=True):
        assert torch.equal(got.index, want.index)
        assert_close(got.weights, want.weights, {"rtol": 1e-6, "atol": 1e-6})
    # The picks read the memory_only prefix: chunks that lie beyond every window of the tail.
    far_chunks = max(1, (split - 3 * model.cfg.window) // model.cfg.chunk_size)
    assert any(((r.index < far_chunks) & (r.weights > 0)).any() for r in got_rows)


def test_memory_only_steps_skip_retrieval_upper_layers_and_lm_head(monkeypatch):
    """What a memory_only step runs: the lower layers and the chunk encoder, never a retrieval over the stored
    chunks, the upper layers or the LM head; the deferred row is scored once, by the next full step."""
    import model.gca as gca_module

    model = trained_model(tiny_config(groups=[2]), T=64)
    calls: dict[str, int] = {"retrieve": 0, "upper": 0, "head": 0, "encoder": 0}
    real_retrieve = gca_module.retrieve

    def counting_retrieve(*args, **kwargs):
        calls["retrieve"] += 1
        return real_retrieve(*args, **kwargs)

    monkeypatch.setattr(gca_module, "retrieve", counting_retrieve)

    def count(name):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    for layer in model.groups[0].layers:
        layer.register_forward_hook(count("upper"))
    model.norm.register_forward_hook(count("head"))
    model.encoder.register_forward_hook(count("encoder"))
    state = model.new_stream_state()
    with torch.inference_mode():
        for _ in range(15):
            model.forward_stream(torch.randint(0, VOCAB, (1, 8)), state, memory_only=True)
        assert calls == {"retrieve": 0, "upper": 0, "head": 0, "encoder": 15}
        assert state.memory.size == 30
        model.forward_stream(torch.randint(0, VOCAB, (1, 2)), state)  # closes no chunk: only the deferred row
    assert calls == {"retrieve": 1, "upper": 2, "head": 1, "encoder": 15}


@pytest.mark.parametrize("groups,memory_only", [([1, 1], False), ([2], True)], ids=["two-groups", "memory-only"])
def test_recorded_picks_are_the_batch_forwards_picks(monkeypatch, groups, memory_only):
    """``StreamState.picks``, recorded while streaming in segments that cut chunks, holds for every row it
    scored the chunks the batch forward picks for that row, without the invalid picks of the first chunks; a
    memory_only prefix scores only its last landmark's row (deferred), later rows all."""
    import model.gca as gca_module

    model = trained_model(tiny_config(groups=groups, top_k=3), T=64)
    ids = torch.randint(0, VOCAB, (2, 61))
    batch_rows = []
    real_retrieve = gca_module.retrieve

    def spy(queries, keys, chunk, **kwargs):
        rows = real_retrieve(queries, keys, chunk, **kwargs)
        batch_rows.append((chunk, rows))
        return rows

    monkeypatch.setattr(gca_module, "retrieve", spy)
    with torch.inference_mode():
        model(ids)
    monkeypatch.undo()
    assert len(batch_rows) == len(groups)  # one scoring per group
    want = {
        (g, int(c)): [[int(j) for j, w in zip(rows.index[b, i], rows.weights[b, i]) if w > 0] for b in range(2)]
        for g, (chunk, rows) in enumerate(batch_rows)
        for i, c in enumerate(chunk)
    }

    state = model.new_stream_state()
    state.picks = {}
    prefix = 29 if memory_only else 0  # 7 chunks of 4 closed by the prefix, the 8th pending
    with torch.inference_mode():
        for s in range(0, prefix, 5):
            model.forward_stream(ids[:, s : min(s + 5, prefix)], state, memory_only=True)
        for s in range(prefix, ids.shape[1], 6):
            model.forward_stream(ids[:, s : s + 6], state)
    first_full = 6 if memory_only else 0  # the deferred row: landmark of chunk 6
    assert state.picks == {k: v for k, v in want.items() if k[1] >= first_full}
    assert all(len(row) == min(c, 3) for (_, c), rows in state.picks.items() for row in rows)
