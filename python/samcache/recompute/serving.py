"""What a served request takes from calibration, the same in samcache's engine and in the plugins:
the per-layer recompute rates for a mean ratio, and whether images are reused only at their own
index among the prompt's images (``keep_image_order``)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from samcache._checks import check_fraction
from samcache.recompute.budget import LayerBudget, SensitivityCurves, solve_layer_budget

#: The budget kinds: rates solved from the curves per layer, or the same rate at every layer.
BUDGETS = ("layer-aware", "uniform")


def check_keep_image_order(value) -> bool | str:
    """``keep_image_order`` as True, False or ``"auto"``."""
    if not (isinstance(value, bool) or value == "auto"):
        raise TypeError(f"keep_image_order must be True, False or 'auto', got {value!r}")
    return value


def serving_budget(curves: SensitivityCurves | None, ratio: float, num_layers: int,
                   kind: str = "layer-aware") -> LayerBudget:
    """Per-layer rates for a mean ``ratio``: solved from ``curves`` (layer-aware), or the same rate
    everywhere (uniform; layer-aware without curves, and where the curves' end-to-end check found
    uniform rates better)."""
    check_fraction("ratio", ratio)
    if kind not in BUDGETS:
        raise ValueError(f"recompute_budget must be one of {BUDGETS}, got {kind!r}")
    if ratio <= 0.0:
        return LayerBudget(rates=np.zeros(num_layers), expected_loss=0.0, mean_rate=0.0)
    if kind == "layer-aware" and curves is not None and not curves.prefers_uniform(ratio):
        return solve_layer_budget(curves, ratio)
    return LayerBudget(rates=np.full(num_layers, ratio), expected_loss=float("nan"), mean_rate=ratio)


def keeps_image_order(setting: bool | str, curves: SensitivityCurves | None, ratio: float,
                      kind: str = "layer-aware", *, isolated: bool = False) -> bool:
    """Whether requests served at ``ratio`` reuse an image's KV only at its own index: ``setting``
    itself, or with ``"auto"``: never for a model whose images attend in isolation (reuse is
    exact at any index), else what the calibration's image-order check found for the rates served
    at that ratio, and without one keep the order (exact: nothing is reused where it could be
    wrong before a calibration says it is safe)."""
    check_keep_image_order(setting)
    if setting != "auto":
        return setting
    if isolated:
        return False
    check_fraction("recompute_ratio", ratio)
    order = None if curves is None else curves.image_order
    if order is None:
        return True
    uniform = kind == "uniform" or curves.prefers_uniform(ratio)
    return order.keeps_order(ratio, uniform=uniform)


def load_curves(path, *, num_layers: int, model_id: str | None = None) -> SensitivityCurves:
    """Curves ``engine.calibrate(save=path)`` wrote, checked against the model's depth (and its id,
    where both are known); a clear ValueError naming the file otherwise."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"sensitivity={str(path)!r}: cannot read the curves file ({e.strerror or e})") from None
    try:
        data = json.loads(text)
        curves = SensitivityCurves.from_dict(data)
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError, AttributeError, ValueError) as e:
        raise ValueError(f"{path} is not a sensitivity-curves JSON saved by engine.calibrate(save=...): {e!r}") from None
    if model_id is not None and data.get("model_id") not in (None, model_id):
        raise ValueError(f"{path} was calibrated on model {data['model_id']}, not on this one ({model_id}); "
                         "calibrate this model (engine.calibrate(save=...))")
    if curves.num_layers != num_layers:
        raise ValueError(f"sensitivity curves have {curves.num_layers} layers, the model has {num_layers}")
    return curves


__all__ = ["BUDGETS", "check_keep_image_order", "keeps_image_order", "load_curves", "serving_budget"]
