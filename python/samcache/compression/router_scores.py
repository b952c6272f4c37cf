"""What an MoE layer's router says about each visual token, the score visual-token compression
uses instead of an extra scoring network or attention maps (which fast kernels never build).

From the router logits of one layer (``[tokens, experts]``, computed anyway): the routing
distribution (softmax), the routing confidence (top-1 probability), the dominant expert (argmax)
and the entropy of the distribution. Two tokens the router sends to the same experts in the same
proportions carry similar content; :meth:`RouterScores.similarity` measures that with the
Bhattacharyya coefficient of their distributions (1: identical routing, 0: disjoint experts).

Router logits of layer L exist only after L's attention, so compression applies from layer L+1
on; :func:`stage_layers` places the stages (the seed's layers 2, 6 and 15 of a 48-layer model,
scaled to the model's depth).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from samcache._checks import check_int

#: The seed design's stages: router logits of layers 2, 6 and 15 of a 48-layer model.
SEED_STAGES, SEED_DEPTH = (2, 6, 15), 48


@dataclass(frozen=True)
class RouterScores:
    """Per token (rows in the order the logits came): ``probs`` [n, E] float32, ``confidence``
    [n] (top-1 probability), ``expert`` [n] int64 (dominant expert), ``entropy`` [n] (nats)."""

    probs: torch.Tensor
    confidence: torch.Tensor
    expert: torch.Tensor
    entropy: torch.Tensor

    @classmethod
    def from_logits(cls, logits: torch.Tensor) -> RouterScores:
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits must be a tensor, got {type(logits).__name__}")
        if logits.dim() != 2 or logits.shape[1] < 2:
            raise ValueError(f"router logits must be [tokens, experts >= 2], got {tuple(logits.shape)}")
        if not torch.isfinite(logits).all():
            raise ValueError("router logits must be finite")
        logp = torch.log_softmax(logits.float(), dim=-1)
        probs = logp.exp()
        confidence, expert = probs.max(dim=-1)
        entropy = -(probs * logp).sum(dim=-1)
        return cls(probs, confidence, expert.to(torch.int64), entropy)

    def __len__(self) -> int:
        return int(self.probs.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.probs.shape[1])

    def similarity(self, rows: torch.Tensor | Sequence[int], to: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """[len(rows), len(to)] Bhattacharyya coefficients of the routing distributions."""
        root = self.probs.sqrt()
        a = root[torch.as_tensor(rows, dtype=torch.int64)]
        b = root[torch.as_tensor(to, dtype=torch.int64)]
        return a @ b.T

    def subset(self, rows: torch.Tensor | Sequence[int]) -> RouterScores:
        idx = torch.as_tensor(rows, dtype=torch.int64)
        return RouterScores(self.probs[idx], self.confidence[idx], self.expert[idx], self.entropy[idx])


def stage_layers(num_layers: int, seed_layers: Sequence[int] = SEED_STAGES, seed_depth: int = SEED_DEPTH) -> tuple[int, ...]:
    """The layers whose router logits start a compression stage in a model of ``num_layers``
    decoder layers: ``seed_layers`` of a ``seed_depth``-layer model scaled to this depth, distinct,
    increasing, and each before the last layer (its compression applies from the next layer).

    What is scaled is the share of the model that runs before each stage's compression applies:
    a stage at layer ``l`` of ``D`` leaves layers ``0..l`` uncompressed, ``(l + 1) / D`` of the
    model, and lands at the layer of this model that leaves the same share (2 / 6 / 15 of 48 ->
    0 / 1 / 3 of 12: 1/12, 2/12 and 4/12 against the seed's 3/48, 7/48 and 16/48). Scaling the
    index itself instead (0 / 2 / 4 of 12) kept every token in 42% of a 12-layer model where the
    seed keeps them in 33%. A stage that would coincide with the one before moves one layer on."""
    check_int("num_layers", num_layers, 2)
    check_int("seed_depth", seed_depth, 1)
    out: list[int] = []
    for layer in seed_layers:
        check_int("seed layer", layer, 0)
        scaled = max(0, round((layer + 1) * num_layers / seed_depth) - 1)
        if out:
            scaled = max(scaled, out[-1] + 1)
        if scaled > num_layers - 2:
            break
        out.append(scaled)
    return tuple(out)


__all__ = ["SEED_DEPTH", "SEED_STAGES", "RouterScores", "stage_layers"]
