"""lm-evaluation-harness adapter: ``@register_model("gca")``, so downstream jobs can run
``python -m pipeline.evaluation --model gca --model_args checkpoint=<export dir> --tasks <task>``.

Every export also runs under lm-eval's stock ``hf`` model (``lm_eval --model hf --model_args
pretrained=<export>,trust_remote_code=True``; see ``pipeline.hf``), which scores a batch of requests in one
whole-sequence forward and cuts documents longer than its ``max_length`` into windows. This adapter is kept for what
that path cannot do: every request is streamed through ``forward_stream`` segment by segment, with chunk K/V moved
to disk past ``offload_mb``, so a document of millions of tokens is scored in one pass (no windows, every token
conditioned on the whole prefix) with bounded memory.

``loglikelihood`` requests are split and encoded by lm-eval's own ``TemplateLM`` exactly as the stock ``hf`` model
does it (trailing whitespace of the context moves to the continuation, the pair is encoded whole and the
continuation is what follows the context's encoding; an empty context becomes the prefix token: BOS when the
tokenizer has one, else EOS), so on a request that fits the stock model's ``max_length`` both score the same
tokens under the same condition (``tests/hf/test_lm_eval_adapter_vs_stock.py``); longer ones are not truncated
here. ``loglikelihood_rolling`` and ``generate_until`` start every sequence with the tokenizer's EOS as a start
token (a newline for the byte tokenizer, which has none), so the first real token is scored too.

Importing this module registers the model (lm-eval 0.4.13 has no plugin hook for models, hence the
``python -m pipeline.evaluation`` wrapper, which is ``lm_eval`` with this import done first).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from pipeline.evaluation.generate import Sampling, generate
from pipeline.evaluation.runtime import StreamBudget, load_checkpoint, stream_segments, stream_state

log = logging.getLogger(__name__)


@register_model("gca")
class GCALM(TemplateLM):
    """Model args: ``checkpoint`` (export dir), ``device``, ``segment``, ``max_gen_toks``, ``offload_mb``,
    ``attn_backend``; ``batch_size`` / ``max_batch_size`` are accepted and ignored (one request at a time)."""

    def __init__(
        self,
        checkpoint: str,
        *,
        device: str | None = "cpu",
        segment: int = 4096,
        max_gen_toks: int = 256,
        offload_mb: int = -1,
        attn_backend: str | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        # lm_eval passes model_args as text; refuse bad numbers before the model loads, naming the argument.
        for name, value, low in (
            ("segment", segment, 1),
            ("max_gen_toks", max_gen_toks, 1),
            ("offload_mb", offload_mb, -1),
        ):
            if int(value) < low:
                raise ValueError(f"--model_args {name}={value} must be >= {low}")
        device = device or "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            # The lm_eval CLI passes cuda:0 whenever --device is not given; say so rather than crash on a CPU box.
            log.warning("device=%s was asked for but CUDA is not available; running on cpu", device)
            device = "cpu"
        self.ckpt = load_checkpoint(checkpoint, device, attn_backend)
        self.model, self.tok = self.ckpt.model, self.ckpt.tokenizer
        self._device = next(self.model.parameters()).device
        self.budget = StreamBudget(segment=int(segment), offload_mb=int(offload_mb))
        self.max_gen_toks = int(max_gen_toks)
        self.start_id = self.tok.eos_id if self.tok.eos_id is not None else self.tok.encode("\n")[0]
        # the tokenizer may define a BOS, as the export's HF files do
        self._prefix_id = self.tok.bos_id if self.tok.bos_id is not None else self.start_id

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def _logprobs(self, ids: list[int], first: int) -> tuple[float, bool]:
        """Sum of log p(ids[t] | ids[:t]) for ``t >= first``, and whether each of those tokens is the argmax."""
        inputs = torch.tensor([ids[:-1]], device=self._device)
        total, greedy = 0.0, True
        with stream_state(self.model, self.budget) as state:
            for start, logits in stream_segments(self.model, state, inputs, self.budget.segment):
                lo = max(first - 1 - start, 0)  # logits[:, j] predicts ids[start + j + 1]
                if lo >= logits.shape[1]:
                    continue
                logp = F.log_softmax(logits[0, lo:].float(), dim=-1)
                target = torch.tensor(ids[start + lo + 1 : start + logits.shape[1] + 1], device=self._device)
                total += logp.gather(-1, target[:, None]).sum().item()
                greedy = greedy and bool((logp.argmax(-1) == target).all())
        return total, greedy

    @property
    def eot_token_id(self) -> int:
        return self.start_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context becomes (lm-eval's stock ``hf`` rule: BOS if the tokenizer has one, else EOS)."""
        return self._prefix_id

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.tok.encode(string)  # no special tokens, as the stock hf model encodes for a causal LM

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Score each ``(request, context_enc, continuation_enc)`` of ``TemplateLM.loglikelihood``: the
        continuation's tokens conditioned on the whole context, streamed whatever its length."""
        out = []
        for _, ctx, cont in tqdm(requests, disable=disable_tqdm, desc="gca loglikelihood"):
            out.append(self._logprobs(list(ctx) + list(cont), len(ctx)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="gca loglikelihood_rolling"):
            ids = [self.start_id] + self.tok.encode(req.args[0])
            out.append(self._logprobs(ids, 1)[0])  # one streamed pass: no windowing needed at any length
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="gca generate_until"):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sampling = bool(kwargs.get("do_sample", False))
            ids, text = [], ""
            # As the stock hf model does: the prompt without special tokens (a start token only for an empty one),
            # so both generate from the same ids where both can run.
            prompt = self.tok.encode(context) or [self.start_id]
            for token in generate(
                self.model,
                prompt,
                int(kwargs.get("max_gen_toks", self.max_gen_toks)),
                sampling=Sampling(
                    temperature=float(kwargs.get("temperature", 1.0)) if sampling else 0.0,
                    top_k=int(kwargs.get("top_k", 0) or 0),
                    top_p=float(kwargs.get("top_p", 1.0) or 1.0),
                    seed=int(kwargs.get("seed", 0) or 0),
                ),
                stop_ids=(self.tok.eos_id,) if self.tok.eos_id is not None else (),
                budget=self.budget,
            ):
                if token == self.tok.eos_id:
                    break
                ids.append(token)
                text = self.tok.decode(ids)
                if any(stop in text for stop in until):
                    break
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out
