"""What one turn did: timings, where each prompt token's KV came from, cache hits, fidelity."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Fidelity:
    """The turn against a full prefill of the same prompt (no reuse of any kind)."""

    kl: float  # KL(full || turn) of the next-token distributions, nats
    top1_agree: bool  # same most likely next token
    greedy_agree: float  # fraction of greedy-decoded positions that match
    greedy_match_prefix: int  # tokens decoded identically before the first difference
    greedy_tokens: int  # tokens compared


@dataclass
class TurnMetrics:
    ttft_s: float = 0.0  # request start -> first token sampled (images, hashing, ViT, prefill)
    latency_s: float = 0.0  # request start -> last token (and cache registration)
    prompt_tokens: int = 0
    prefix_reused_tokens: int = 0  # KV adopted from the prefix cache
    image_reused_tokens: int = 0  # KV of known images spliced in at new positions
    prefilled_tokens: int = 0  # computed from scratch (new text, new images)
    recomputed_tokens: int = 0  # reused tokens recomputed at the first layer
    recomputed_token_layers: int = 0  # recomputed (token, layer) pairs over all layers
    recompute_rates: list[float] = field(default_factory=list)  # per layer, fraction of image-reused tokens
    isolated_tokens: int = 0  # computed again alone, for the image KV kept (repair method 'isolated'; after the first token)
    exact_tokens: int = 0  # leading prompt tokens whose KV equals a full prefill's (only these enter the prefix cache)
    images: int = 0
    vit_calls: int = 0  # images run through the vision tower
    vit_hits: int = 0  # images whose ViT output came from the cache
    vit_remote_hits: int = 0  # of those: from the shared store (another instance encoded it)
    vit_host_hits: int = 0  # of those: from host memory (the device ViT cache had let it go)
    vit_disk_hits: int = 0  # of those: from the disk tier (the ViT cache had let it go)
    image_kv_hits: int = 0
    image_kv_misses: int = 0
    image_kv_host_hits: int = 0  # of the hits: brought back from host memory (exact)
    image_kv_disk_hits: int = 0  # of the hits: brought back from the disk tier (quantized)
    image_kv_remote_hits: int = 0  # of the hits: from the shared store (another instance computed it)
    prefix_restored_tokens: int = 0  # of prefix_reused_tokens: blocks brought back from the prefix tier
    tier_load_s: float = 0.0  # worker time loading those hits into the pool, layer by layer
    tier_load_wait_s: float = 0.0  # of which the step waited for (the rest was hidden behind compute)
    kv_bytes: int = 0  # KV of this turn's sequence in the pool
    kv_pool_bytes: int = 0  # pool blocks in use or cached at the end of the turn (before it is freed)
    image_kv_store_bytes: int = 0  # all images' KV held for reuse
    compressed_images: int = 0  # images whose visual tokens were merged into anchors
    visual_tokens_merged: int = 0  # tokens the last layer no longer holds (merged into anchors)
    layer_tokens: list[int] = field(default_factory=list)  # with compression: tokens each layer holds
    decode_tokens: int = 0
    decode_tokens_per_s: float = 0.0
    fidelity: Fidelity | None = None

    @property
    def reused_tokens(self) -> int:
        return self.prefix_reused_tokens + self.image_reused_tokens

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reused_tokens"] = self.reused_tokens
        return d

    def summary(self) -> str:
        parts = [
            f"TTFT {self.ttft_s * 1e3:.1f} ms",
            f"{self.prompt_tokens} prompt tokens: {self.prefilled_tokens} prefilled, "
            f"{self.prefix_reused_tokens} prefix-reused, {self.image_reused_tokens} image-reused, "
            f"{self.recomputed_tokens} recomputed",
            f"ViT {self.vit_calls} run / {self.vit_hits} cached",
        ]
        if self.fidelity is not None:
            f = self.fidelity
            parts.append(f"KL {f.kl:.2e}, top-1 {'same' if f.top1_agree else 'differs'}, "
                         f"greedy {f.greedy_agree:.0%} of {f.greedy_tokens}")
        return "; ".join(parts)


def next_token_fidelity(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, bool]:
    """KL(reference || logits) in nats and whether the argmax agrees (float64 math)."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    got = torch.log_softmax(logits.double(), dim=-1)
    kl = float((ref.exp() * (ref - got)).sum())
    return max(kl, 0.0) if math.isfinite(kl) else kl, bool(reference_logits.argmax() == logits.argmax())


def greedy_agreement(reference: list[int], tokens: list[int]) -> tuple[float, int, int]:
    """(fraction of equal positions, length of the equal prefix, positions compared)."""
    n = min(len(reference), len(tokens))
    if n == 0:
        return 1.0, 0, 0
    equal = [a == b for a, b in zip(reference[:n], tokens[:n])]
    prefix = next((i for i, e in enumerate(equal) if not e), n)
    return sum(equal) / n, prefix, n


__all__ = ["Fidelity", "TurnMetrics", "greedy_agreement", "next_token_fidelity"]
