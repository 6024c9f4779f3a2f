"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import torch

from chatkv.config import SamplingParams


class Sampler:
    """Samples tokens for one sequence under fixed :class:`SamplingParams`.

    With ``seed`` set, the same logits produce the same tokens in every process.
    """

    def __init__(self, params: SamplingParams) -> None:
        """Prepare a sampler (and its private random generator when seeded)."""
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick a token id from ``logits`` ``[vocab]``."""
        p = self.params
        if p.temperature == 0.0:
            return int(torch.argmax(logits).item())
        logits = logits.float().cpu() / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token once the mass before it already reaches top_p; the top token always stays.
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())
