"""``model.retrieval_scope=document``: a chunk retrieves only chunks of its own packed document, in training,
streaming and decoding alike; the default (``sequence``) is the paper's."""

import pytest
import torch
from helpers import FP32_REORDERED, assert_close
from helpers import tiny_config as shared_tiny_config

from model import ConfigError, GCAConfig, GCAForCausalLM, load_pretrained, save_pretrained

VOCAB, EOS, S = 64, 1, 4
SHAPES = dict(
    vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, groups=[1, 1], chunk_size=S, window=6
)


def tiny_config(**overrides) -> GCAConfig:
    return shared_tiny_config(**{**SHAPES, **overrides})


def packed(lengths: list[int], batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Documents of the given lengths, each ending with EOS (as the trainer packs them), in every batch row with the
    rows' boundaries shifted by one token so that they differ."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        tokens = []
        for n in [lengths[0] + b, *lengths[1:]]:
            tokens += [*torch.randint(2, VOCAB, (n - 1,), generator=g).tolist(), EOS]
        rows.append(tokens[: sum(lengths)])
    return torch.tensor(rows)


def reference_visible(ids: list[int], i: int) -> set[int]:
    """Chunks ``j < i`` whose last token belongs to the document of the token after chunk ``i`` (written from the
    token list, independently of the model's counting)."""

    def document(t: int) -> int:
        return sum(1 for u in ids[:t] if u == EOS)

    reader = document((i + 1) * S)  # the first token of chunk i + 1
    return {j for j in range(i) if document((j + 1) * S - 1) == reader}


def test_picks_are_exactly_the_earlier_chunks_of_the_reading_document():
    """With top_k as large as the sequence every visible chunk is picked, so the picks show the visible set."""
    ids = packed([22, 9, 30, 19])  # boundaries inside chunks and at a chunk's last token
    C = ids.shape[1] // S
    model = GCAForCausalLM(tiny_config(retrieval_scope="document", eos_id=EOS, top_k=C)).eval()
    model.picks = {}
    with torch.no_grad():
        model(ids)
    assert {g for g, _ in model.picks} == {0, 1}
    for (_, i), rows in model.picks.items():
        for b, picked in enumerate(rows):
            assert set(picked) == reference_visible(ids[b].tolist(), i), (b, i)
    # The same input under the paper's scope reads across documents.
    model.cfg.retrieval_scope = "sequence"
    model.picks = {}
    with torch.no_grad():
        model(ids)
    assert all(set(rows[0]) == set(range(i)) for (_, i), rows in model.picks.items())


def test_one_document_is_the_sequence_scope():
    ids = torch.randint(2, VOCAB, (2, 40))
    doc = GCAForCausalLM(tiny_config(retrieval_scope="document", eos_id=EOS))
    seq = GCAForCausalLM(tiny_config())
    seq.load_state_dict(doc.state_dict())
    doc.eval(), seq.eval()
    with torch.no_grad():
        assert torch.equal(doc(ids).logits, seq(ids).logits)


def test_earlier_documents_cannot_reach_a_later_one_through_retrieval():
    """A token far beyond the window in the last document: its logits do not depend on an earlier document under
    the document scope (nothing else reaches that far), and do under the sequence scope."""
    cfg = tiny_config(retrieval_scope="document", eos_id=EOS, groups=[1], top_k=16)  # top_k: every chunk
    model = GCAForCausalLM(cfg).eval()
    ids = packed([24, 40], batch=1)
    changed = ids.clone()
    changed[0, :20] = torch.randint(2, VOCAB, (20,))
    with torch.no_grad():
        assert torch.equal(model(ids).logits[0, -1], model(changed).logits[0, -1])
        model.cfg.retrieval_scope = "sequence"
        assert not torch.equal(model(ids).logits[0, -1], model(changed).logits[0, -1])


@pytest.mark.parametrize("segment", [1, 7, 16])
def test_streaming_matches_the_whole_sequence(segment):
    model = GCAForCausalLM(tiny_config(retrieval_scope="document", eos_id=EOS))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(3):  # move the norms and landmark off their init, so retrieval scores differ by chunk
        ids = packed([15, 21, 12], seed=_)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    ids = packed([13, 26, 5, 36], seed=9)
    with torch.no_grad():
        full = model(ids).logits
        state = model.new_stream_state()
        parts = [model.forward_stream(ids[:, s : s + segment], state) for s in range(0, ids.shape[1], segment)]
    assert_close(torch.cat(parts, 1), full, FP32_REORDERED)
    assert state.read_docs.size == state.memory.size == ids.shape[1] // S


def test_export_keeps_the_scope(tmp_path):
    model = GCAForCausalLM(tiny_config(retrieval_scope="document", eos_id=EOS)).eval()
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path).eval()
    assert (loaded.cfg.retrieval_scope, loaded.cfg.eos_id) == ("document", EOS)
    ids = packed([20, 28])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"retrieval_scope": "doc"}, "model.retrieval_scope='doc' is not one of"),
        ({"eos_id": VOCAB}, "model.eos_id must be a token id in [0, model.vocab_size)"),
        ({"eos_id": True}, "model.eos_id must be a token id"),
        ({"retrieval_scope": "document", "arch": "swa"}, "model.retrieval_scope=document applies to model.arch=gca"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
        tiny_config(**overrides)


def test_document_scope_needs_the_separator():
    with pytest.raises(ConfigError, match="model.retrieval_scope=document needs model.eos_id"):
        GCAForCausalLM(tiny_config(retrieval_scope="document"))
