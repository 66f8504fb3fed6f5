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
        S = chunk_size
        real = n_prev + torch.arange(n_tokens, device=device)  # absolute real-token index
        closes_chunk = (real + 1) % S == 0
        landmarks_before = torch.cumsum(closes_chunk.long(), 0) - closes_chunk.long()
        token_pos = torch.arange(n_tokens, device=device) + landmarks_before
        landmark_pos = token_pos[closes_chunk] + 1
        n_landmarks = int(landmark_pos.numel())
        order = torch.empty(n_tokens + n_landmarks, dtype=torch.long, device=device)
        order[token_pos] = torch.arange(n_tokens, device=device)
        order[landmark_pos] = n_tokens + torch.arange(n_landmarks, device=device)
        lead = n_prev % S
        return StepLayout(
            n_prev=n_prev,
            n_tokens=n_tokens,
            token_pos=token_pos,
            landmark_pos=landmark_pos,
            landmark_chunk=real[closes_chunk] // S,
            order=order,
            lead=lead,
            first_chunk=n_prev // S,
            n_chunks=-(-(lead + n_tokens + n_landmarks) // (S + 1)),
        )
