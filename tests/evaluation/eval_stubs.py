"""Stub models with the streaming interface, for checking the passkey protocol itself."""

from types import SimpleNamespace

import torch
import torch.nn as nn


class _Stub(nn.Module):
    vocab = 256
    cfg = SimpleNamespace(chunk_size=16)  # the chunk grid the passkey samples are laid out on

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the harness a device

    def new_stream_state(self, memory=None):
        return SimpleNamespace(seen=[])

    def forward_stream(self, ids, state, last_logits=None):
        state.seen.extend(ids[0].tolist())
        logits = torch.zeros(1, ids.shape[1] if last_logits is None else min(last_logits, ids.shape[1]), self.vocab)
        logits[0, -1, self.next_token(state.seen)] = 1.0  # only the last row is ever scored
        return logits


class InductionOracle(_Stub):
    """Predicts what followed the latest earlier occurrence of the last ``n`` tokens: copies the needle."""

    def __init__(self, n: int = 12) -> None:
        super().__init__()
        self.n = n

    def next_token(self, seen):
        history = bytes(seen)
        at = history[:-1].rfind(history[-self.n :])
        return history[at + self.n] if at >= 0 else 0


class RandomDigits(_Stub):
    """Guesses a uniformly random digit: chance level is 1/10 for the first digit of a key."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)

    def next_token(self, seen):
        return ord("0") + int(torch.randint(0, 10, (1,), generator=self.gen))


class Recorder(InductionOracle):
    """An oracle that keeps every token it is fed, to check what the harness shows the model."""

    def new_stream_state(self, memory=None):
        state = super().new_stream_state(memory)
        self.last_state = state
        return state
