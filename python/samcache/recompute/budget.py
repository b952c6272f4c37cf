"""The layer-aware recompute budget: how much of a reused span to recompute at each layer.

A token recomputed at layer l needs a fresh hidden state from layer l-1, so the recomputed
token sets are nested across depth and the per-layer rates are non-increasing
(r_0 >= r_1 >= ... >= r_{L-1}). An offline probe measures, per layer, the fidelity loss when
only that layer's rate changes (``SensitivityCurves``); the solver picks the rates that
minimise the summed loss with a mean rate within the budget (e.g. 5%).

The seed design solves this greedily. Under the monotone coupling a greedy step can stall (a
shallow layer with a small gain must rise first to let a deep layer with a large gain rise),
so we solve it exactly instead: a dynamic program over (layer, rate, budget units) with
suffix minima for the monotone constraint. It costs O(L * R * B) array operations (L layers,
R probed rates, B budget units of 1/``resolution``), milliseconds for real models, and is tested
against brute-force enumeration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from samcache.recompute.image_order import ImageOrderCheck
from samcache.recompute.probe_grid import check_probe_rates, nearest_measured, rows_from_json, rows_to_json


@dataclass(frozen=True)
class SensitivityCurves:
    """``loss[l, i]``: fidelity loss (e.g. next-token KL vs a full prefill) when layer ``l``
    recomputes a fraction ``rates[i]`` of the reused tokens. ``rates`` ascend from 0 to <= 1.

    ``checked`` (optional, ``[len(rates), 2]``): the loss measured end to end, every layer
    recomputing at once, with the rates solved from these curves (column 0) and with the same
    rate at every layer (column 1), at each probe rate; NaN where not measured. Why: the solver
    adds up per-layer losses measured one layer at a time, and a model whose layers repair
    together (recomputing one deep layer alone can make things worse) breaks that sum. Where
    the check found the uniform rates better, :meth:`prefers_uniform` says so and the engine
    uses them.

    ``image_order`` (optional): on the calibration pairs where a reused image changed its index,
    how often the served reuse kept the reference's confident tokens at each probe rate
    (:class:`~samcache.recompute.image_order.ImageOrderCheck`); ``keep_image_order="auto"`` reads it."""

    rates: np.ndarray
    loss: np.ndarray
    checked: np.ndarray | None = None
    image_order: ImageOrderCheck | None = None

    def __post_init__(self) -> None:
        rates = check_probe_rates(self.rates)
        loss = np.asarray(self.loss, dtype=np.float64)
        if loss.ndim != 2 or loss.shape[1] != rates.size or loss.shape[0] < 1:
            raise ValueError(f"loss must be [num_layers, {rates.size}], got shape {loss.shape}")
        if not np.all(np.isfinite(loss)):
            raise ValueError("loss must be finite")
        object.__setattr__(self, "rates", rates)
        object.__setattr__(self, "loss", loss)
        if self.checked is not None:
            checked = np.asarray(self.checked, dtype=np.float64)
            if checked.shape != (rates.size, 2):
                raise ValueError(f"checked must be [{rates.size}, 2] (solved, uniform per probe rate), "
                                 f"got shape {checked.shape}")
            if np.any(np.isinf(checked)):
                raise ValueError("checked losses must be finite or NaN (not measured)")
            object.__setattr__(self, "checked", checked)
        if self.image_order is not None:
            if not isinstance(self.image_order, ImageOrderCheck):
                raise TypeError(f"image_order must be an ImageOrderCheck or None, got {type(self.image_order).__name__}")
            if not np.array_equal(self.image_order.rates, rates):
                raise ValueError("image_order was measured at other probe rates than the curves")

    def to_dict(self, model_id: str | None = None) -> dict:
        """JSON-ready (NaN as None), as ``engine.calibrate(save=...)`` writes and ``sensitivity=path`` reads."""
        out = {"model_id": model_id, "rates": self.rates.tolist(), "loss": self.loss.tolist()}
        if self.checked is not None:
            out["checked"] = rows_to_json(self.checked)
        if self.image_order is not None:
            out["image_order"] = self.image_order.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "SensitivityCurves":
        """The curves :meth:`to_dict` wrote (its ``model_id`` is the caller's to check)."""
        checked = data.get("checked")
        order = data.get("image_order")
        return cls(rates=np.asarray(data["rates"]), loss=np.asarray(data["loss"]),
                   checked=None if checked is None else rows_from_json(checked),
                   image_order=None if order is None else ImageOrderCheck.from_dict(order))

    def prefers_uniform(self, total_rate: float) -> bool:
        """Whether the end-to-end check found the same rate at every layer better than the solved
        rates at the checked probe rate nearest ``total_rate`` (False without a check)."""
        if isinstance(total_rate, bool) or not (isinstance(total_rate, (int, float)) and 0.0 <= total_rate <= 1.0):
            raise ValueError(f"total_rate must be a number in [0, 1], got {total_rate!r}")
        if self.checked is None:
            return False
        i = nearest_measured(self.rates, ~np.isnan(self.checked).any(axis=1), total_rate)
        return i is not None and bool(self.checked[i, 1] < self.checked[i, 0])

    @property
    def num_layers(self) -> int:
        return self.loss.shape[0]


@dataclass(frozen=True)
class LayerBudget:
    """Per-layer recompute rates (non-increasing with depth), their summed expected loss and
    their mean rate (the budget actually used)."""

    rates: np.ndarray
    expected_loss: float
    mean_rate: float

    def tokens_per_layer(self, span_tokens: int) -> list[int]:
        """How many of ``span_tokens`` reused tokens each layer recomputes."""
        return tokens_per_layer(self.rates, span_tokens)


def tokens_per_layer(rates: Sequence[float], reused_tokens: int) -> list[int]:
    """How many of ``reused_tokens`` each layer recomputes at ``rates`` (in [0, 1]): rounded up,
    so a non-zero rate always recomputes at least one token, and never more than all of them."""
    return [math.ceil(r * reused_tokens - 1e-9) for r in rates]


def solve_layer_budget(curves: SensitivityCurves, total_rate: float, *, resolution: int = 200) -> LayerBudget:
    """Exact minimum-loss rates with r_0 >= ... >= r_{L-1} and mean(r) <= total_rate.

    Rates are counted in units of 1/``resolution`` (default 0.5%: exact for the usual probe
    grids; a rate that is not a multiple is charged the next unit up, so the budget is never
    exceeded).
    """
    if not isinstance(curves, SensitivityCurves):
        raise TypeError("curves must be a SensitivityCurves")
    if not (isinstance(total_rate, (int, float)) and 0.0 <= total_rate <= 1.0):
        raise ValueError(f"total_rate must be a number in [0, 1], got {total_rate!r}")
    if not isinstance(resolution, int) or resolution < 1:
        raise ValueError("resolution must be a positive int")
    L, R = curves.loss.shape
    units = np.ceil(curves.rates * resolution - 1e-9).astype(np.int64)  # cost of each rate
    budget = int(math.floor(total_rate * L * resolution + 1e-9))
    inf = np.inf
    # best[i, b]: least loss of the layers so far, the current layer at rate i, exactly b units.
    best = np.full((R, budget + 1), inf)
    for i in range(R):
        if units[i] <= budget:
            best[i, units[i]] = curves.loss[0, i]
    choice = np.zeros((L, R, budget + 1), dtype=np.int16)  # previous layer's rate index
    for layer in range(1, L):
        # prev_min[i, b] = min over j >= i of best[j, b]: the previous layer's rate is >= this one's.
        prev_min = np.minimum.accumulate(best[::-1], axis=0)[::-1]
        prev_arg = _suffix_argmin(best)
        nxt = np.full_like(best, inf)
        for i in range(R):
            u = units[i]
            if u > budget:
                continue
            nxt[i, u:] = prev_min[i, : budget + 1 - u] + curves.loss[layer, i]
            choice[layer, i, u:] = prev_arg[i, : budget + 1 - u]
        best = nxt
    flat = int(np.argmin(best))
    i, b = divmod(flat, budget + 1)
    if not np.isfinite(best[i, b]):
        raise ValueError("no feasible allocation (rates[0] must be 0)")  # unreachable: rates[0] == 0
    picked = [0] * L
    for layer in range(L - 1, -1, -1):
        picked[layer] = i
        if layer:
            j = int(choice[layer, i, b])
            b -= int(units[i])
            i = j
    rates = curves.rates[picked]
    return LayerBudget(rates=rates, expected_loss=float(curves.loss[np.arange(L), picked].sum()), mean_rate=float(rates.mean()))


def _suffix_argmin(best: np.ndarray) -> np.ndarray:
    """arg[i, b] = the j >= i minimising best[j, b] (ties: the smallest such j)."""
    R = best.shape[0]
    arg = np.empty(best.shape, dtype=np.int16)
    arg[R - 1] = R - 1
    cur = best[R - 1].copy()
    for i in range(R - 2, -1, -1):
        take = best[i] <= cur
        arg[i] = np.where(take, i, arg[i + 1])
        cur = np.where(take, best[i], cur)
    return arg


def uniform_layer_budget(curves: SensitivityCurves, total_rate: float) -> LayerBudget:
    """The ablation baseline: every layer at the largest probed rate <= total_rate."""
    if not isinstance(curves, SensitivityCurves):
        raise TypeError("curves must be a SensitivityCurves")
    if not (isinstance(total_rate, (int, float)) and 0.0 <= total_rate <= 1.0):
        raise ValueError(f"total_rate must be a number in [0, 1], got {total_rate!r}")
    i = int(np.searchsorted(curves.rates, total_rate + 1e-12, side="right") - 1)
    L = curves.num_layers
    rates = np.full(L, curves.rates[i])
    return LayerBudget(rates=rates, expected_loss=float(curves.loss[:, i].sum()), mean_rate=float(curves.rates[i]))


def probe_layer_sensitivity(
    measure: Callable[[int, float], float],
    num_layers: int,
    rates: Sequence[float] = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
    *,
    progress: bool = True,
) -> SensitivityCurves:
    """Build the curves offline: ``measure(layer, rate)`` runs a calibration set with only
    ``layer`` recomputing ``rate`` of the reused tokens and returns the fidelity loss."""
    if not callable(measure):
        raise TypeError("measure must be callable as measure(layer, rate) -> loss")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError("num_layers must be a positive int")
    rates = np.asarray(rates, dtype=np.float64)
    cells = [(layer, float(r)) for layer in range(num_layers) for r in rates]
    iterator = cells
    if progress:
        from tqdm import tqdm

        iterator = tqdm(cells, desc="probing layer sensitivity", unit="run")
    loss = np.array([measure(layer, r) for layer, r in iterator], dtype=np.float64).reshape(num_layers, rates.size)
    return SensitivityCurves(rates=rates, loss=loss)
