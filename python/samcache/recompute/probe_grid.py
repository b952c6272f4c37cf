"""The probe grid that calibration measures on, shared by the sensitivity curves and the
image-order check: the rates, the measured-rate lookup, and NaN ("not measured") in JSON."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_probe_rates(rates: Sequence[float]) -> np.ndarray:
    """``rates`` as a probe grid: a non-empty 1-D float64 array from 0, strictly increasing, <= 1."""
    try:
        rates = np.asarray(rates, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"rates must be a sequence of numbers, got {rates!r}") from None
    if rates.ndim != 1 or rates.size < 1:
        raise ValueError("rates must be a non-empty 1-D sequence")
    if rates[0] != 0.0 or np.any(np.diff(rates) <= 0) or rates[-1] > 1.0:
        raise ValueError(f"rates must start at 0, strictly increase and stay <= 1, got {rates.tolist()}")
    return rates


def nearest_measured(rates: np.ndarray, measured: np.ndarray, rate: float) -> int | None:
    """The index of the probe rate nearest ``rate`` among those where ``measured`` is True (the
    first on a tie), or None where nothing was measured."""
    indices = np.flatnonzero(measured)
    if indices.size == 0:
        return None
    return int(indices[np.argmin(np.abs(rates[indices] - rate))])


def rows_to_json(rows: np.ndarray) -> list[list[float | None]]:
    """A 2-D float array as JSON rows, NaN (not measured) as None."""
    return [[None if np.isnan(v) else float(v) for v in row] for row in rows]


def rows_from_json(rows) -> np.ndarray:
    """:func:`rows_to_json`'s rows back as a float64 array, None as NaN."""
    return np.asarray([[np.nan if v is None else v for v in row] for row in rows], dtype=np.float64)


__all__ = ["check_probe_rates", "nearest_measured", "rows_from_json", "rows_to_json"]
