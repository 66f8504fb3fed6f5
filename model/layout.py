"""Where tokens and landmarks sit in the model's stream for one forward step.

A landmark is appended after the last real token of every chunk of ``S`` tokens, so chunk ``c`` occupies stream
positions ``[c (S+1), (c+1) (S+1))`` with its landmark last. A step may start in the middle of a chunk (streaming:
``n_prev`` tokens were processed before) and may end in the middle of one (any input length works; a chunk's
landmark is inserted in the step that brings its ``S``-th token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepLayout:
    n_prev: int
    """Real tokens processed before this step."""
    n_tokens: int
    """Real tokens in this step."""
    token_pos: torch.Tensor
    """``[n_tokens]`` stream position (within the step) of every real token."""
    landmark_pos: torch.Tensor
    """``[n_landmarks]`` stream position (within the step) of every landmark."""
    landmark_chunk: torch.Tensor
    """``[n_landmarks]`` absolute index of the chunk each landmark closes."""
    order: torch.Tensor
    """``[L]`` index into ``cat([tokens, landmarks])`` giving the stream order."""
    lead: int
    """Stream positions of the step's first chunk that were processed in earlier steps."""
    first_chunk: int
    """Absolute index of the chunk the step starts in."""
    n_chunks: int
    """Chunks the step touches (first and last may be partial)."""

    @property
    def n_landmarks(self) -> int:
        return int(self.landmark_pos.numel())

    @property
    def length(self) -> int:
        return self.n_tokens + self.n_landmarks

    @staticmethod
    def build(n_prev: int, n_tokens: int, chunk_size: int, device: torch.device) -> StepLayout:
        """Every position in closed form from ``n_prev`` and ``n_tokens`` (no boolean masks: on a GPU each would
        wait for the device to learn its output size)."""
        S = chunk_size
        first_chunk = n_prev // S
        n_landmarks = (n_prev + n_tokens) // S - first_chunk
        steps = torch.arange(n_tokens, device=device)
        token_pos = steps + (n_prev + steps) // S - first_chunk  # each token after the landmarks before it
        chunks = torch.arange(n_landmarks, device=device)  # landmark k closes chunk first_chunk + k ...
        landmark_pos = (first_chunk + chunks + 1) * S - n_prev + chunks  # ... right after the chunk's last token
        order = torch.empty(n_tokens + n_landmarks, dtype=torch.long, device=device)
        order[token_pos] = steps
        order[landmark_pos] = n_tokens + chunks
        lead = n_prev % S
        return StepLayout(
            n_prev=n_prev,
            n_tokens=n_tokens,
            token_pos=token_pos,
            landmark_pos=landmark_pos,
            landmark_chunk=first_chunk + chunks,
            order=order,
            lead=lead,
            first_chunk=first_chunk,
            n_chunks=-(-(lead + n_tokens + n_landmarks) // (S + 1)),
        )
