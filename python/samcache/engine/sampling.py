"""Next-token sampling: greedy, or temperature with nucleus (top-p) filtering."""

from __future__ import annotations

import math

import torch

from samcache._checks import check_seed


class Sampler:
    """``Sampler(temperature, top_p, seed)(logits) -> token id``. temperature 0 is greedy."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, *, seed: int = 0) -> None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        check_seed(seed)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.generator = torch.Generator().manual_seed(int(seed))  # sampling runs on the CPU (see __call__)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: torch.Tensor) -> int:
        if self.greedy:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < self.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))


__all__ = ["Sampler"]
