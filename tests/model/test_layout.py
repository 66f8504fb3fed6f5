"""``StepLayout`` against a walk along the stream: where every token and landmark of a step sits."""

import pytest
import torch

from model.layout import StepLayout


def walked(n_prev: int, n_tokens: int, S: int) -> dict[str, list[int]]:
    """The layout by appending the step's tokens one at a time, a landmark after every S-th real token."""
    token_pos, landmark_pos, landmark_chunk, stream = [], [], [], []
    for i in range(n_tokens):
        token_pos.append(len(stream))
        stream.append(i)
        real = n_prev + i
        if (real + 1) % S == 0:
            landmark_pos.append(len(stream))
            landmark_chunk.append(real // S)
            stream.append(n_tokens + len(landmark_chunk) - 1)
    return {"token_pos": token_pos, "landmark_pos": landmark_pos, "landmark_chunk": landmark_chunk, "order": stream}


@pytest.mark.parametrize("S", [1, 3, 16])
def test_positions_match_a_walk_along_the_stream(S):
    for n_prev in range(0, 3 * S + 2):
        for n_tokens in range(0, 3 * S + 2):
            layout = StepLayout.build(n_prev, n_tokens, S, torch.device("cpu"))
            for name, expected in walked(n_prev, n_tokens, S).items():
                got = getattr(layout, name)
                assert got.dtype == torch.long and got.tolist() == expected, (n_prev, n_tokens, name)
            assert layout.first_chunk == n_prev // S and layout.lead == n_prev % S
