"""Whether recompute can repair an image reused at another index, measured at calibration.

Some models write an image's index among the prompt's images into its KV (a model that names
screenshots "first", "second" learns that from the images before each one). Reused at another
index, such an image's KV says the old index, and recompute short of nearly all of it does not
repair that (docs/design.md). ``keep_image_order="auto"`` lets the calibration decide: on the
calibration pairs where a reused image changed its index, it counts how often the served reuse
(through the engine's own recompute, at each probe rate) still picks the token a full prefill
picks, teacher-forced over the reference's reply. Only tokens where the reference is confident
count (top-1 probability above ``CONFIDENT_PROBABILITY``): a model whose next-token distribution
is flat (random weights) flips its argmax among near-equal logits whatever is reused, and gives
no evidence either way.

The rule: keep the order (reuse an image's KV only at its own index) where agreement at the
served ratio is below ``AGREEMENT_BAR`` over at least ``MIN_CONFIDENT_TOKENS`` confident tokens.
Without that much evidence, images are reused at any index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from samcache.recompute.probe_grid import check_probe_rates, nearest_measured, rows_from_json, rows_to_json

#: A reference token counts as evidence when the full prefill gave it at least this probability.
CONFIDENT_PROBABILITY = 0.5

#: Keep the order below this agreement: more than 1 confident token in 100 changed by the reuse.
AGREEMENT_BAR = 0.99

#: Fewer confident tokens than this on the moved pairs say nothing about the model.
MIN_CONFIDENT_TOKENS = 50


@dataclass(frozen=True)
class ImageOrderCheck:
    """``agreed[i, c]``: confident reference tokens that reuse at probe rate ``rates[i]`` still
    predicted, summed over the calibration pairs where a reused image changed its index, with the
    solved per-layer rates (``c = 0``) and the same rate at every layer (``c = 1``); NaN where not
    measured. ``confident``: the reference's confident tokens over those pairs (the same for every
    run: they come from the full prefill); ``pairs``: how many such pairs."""

    rates: np.ndarray
    agreed: np.ndarray
    confident: int
    pairs: int

    def __post_init__(self) -> None:
        rates = check_probe_rates(self.rates)
        agreed = np.asarray(self.agreed, dtype=np.float64)
        if agreed.shape != (rates.size, 2):
            raise ValueError(f"agreed must be [{rates.size}, 2] (solved, uniform per probe rate), got shape {agreed.shape}")
        for name in ("confident", "pairs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        measured = agreed[~np.isnan(agreed)]
        if np.any(measured < 0) or np.any(measured > self.confident):
            raise ValueError(f"agreed counts must lie in [0, confident={self.confident}] (or be NaN)")
        object.__setattr__(self, "rates", rates)
        object.__setattr__(self, "agreed", agreed)
        object.__setattr__(self, "confident", int(self.confident))
        object.__setattr__(self, "pairs", int(self.pairs))

    def agreement(self, rate: float, uniform: bool = False) -> float | None:
        """Agreement on confident tokens at the measured probe rate nearest ``rate``, with uniform
        (``uniform=True``) or solved rates; None where nothing was measured or nothing was confident."""
        if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and 0.0 <= rate <= 1.0):
            raise ValueError(f"rate must be a number in [0, 1], got {rate!r}")
        column = self.agreed[:, 1 if uniform else 0]
        i = nearest_measured(self.rates, ~np.isnan(column), rate)
        if i is None or self.confident == 0:
            return None
        return float(column[i] / self.confident)

    def keeps_order(self, rate: float, uniform: bool = False) -> bool:
        """Whether reuse at ``rate`` should keep images at their own index: agreement below
        ``AGREEMENT_BAR`` over at least ``MIN_CONFIDENT_TOKENS`` confident tokens."""
        agreement = self.agreement(rate, uniform)
        return agreement is not None and self.confident >= MIN_CONFIDENT_TOKENS and agreement < AGREEMENT_BAR

    def to_dict(self) -> dict:
        """JSON-ready (NaN as None)."""
        return {"rates": self.rates.tolist(), "confident": self.confident, "pairs": self.pairs,
                "agreed": rows_to_json(self.agreed)}

    @classmethod
    def from_dict(cls, data: dict) -> "ImageOrderCheck":
        return cls(rates=np.asarray(data["rates"]), agreed=rows_from_json(data["agreed"]), confident=data["confident"], pairs=data["pairs"])


def confident_agreement(reference: list, logits: list) -> tuple[int, int]:
    """(tokens where ``logits`` pick the reference's argmax, tokens counted): over the positions
    where the reference's top-1 probability is at least ``CONFIDENT_PROBABILITY``."""
    import torch

    if len(reference) != len(logits):
        raise ValueError(f"reference and logits must cover the same tokens, got {len(reference)} and {len(logits)}")
    if not reference:
        return 0, 0
    ref, got = torch.stack(list(reference)).double(), torch.stack(list(logits))
    confident = torch.softmax(ref, dim=-1).amax(dim=-1) >= CONFIDENT_PROBABILITY
    same = ref.argmax(dim=-1) == got.argmax(dim=-1)
    return int((same & confident).sum()), int(confident.sum())


__all__ = ["AGREEMENT_BAR", "CONFIDENT_PROBABILITY", "ImageOrderCheck", "MIN_CONFIDENT_TOKENS", "confident_agreement"]
