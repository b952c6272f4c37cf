"""rms_norm: a decoder layer's RMS norm in one kernel, alone or fused with the residual add.

``out = weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``, the statistics in float32: Hugging
Face's Qwen and Llama ``RMSNorm``, which dispatches six torch ops (on a GPU, six launches). The
layer loop's second norm follows the attention's residual add; ``add_rms_norm`` does both,
writing ``x + delta`` into ``x`` (as vLLM's ``fused_add_rms_norm`` does).

Rounding: the sum of squares is accumulated in another order than torch's ``mean``, so results
can differ from the module's by an ulp of float32 statistics; every row is computed alone, so a
row's result never depends on the other rows of the call. Contracts: ``docs/ops/rms_norm.md``.
"""

from __future__ import annotations

import math
from numbers import Real

import torch


def _check(op: str, x, weight, eps) -> float:
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(eps, Real) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


@torch.library.register_fake("samcache::rms_norm")
def _rms_norm_fake(x, weight, eps):
    torch._check(x.dim() == 2, lambda: "rms_norm: x must be [N, D]")
    torch._check(weight.shape == (x.size(1),), lambda: "rms_norm: weight must be [D]")
    return x.new_empty(x.shape)


@torch.library.register_fake("samcache::add_rms_norm")
def _add_rms_norm_fake(x, delta, weight, eps):
    torch._check(x.dim() == 2, lambda: "add_rms_norm: x must be [N, D]")
    torch._check(delta.shape == x.shape, lambda: "add_rms_norm: delta must match x")
    torch._check(weight.shape == (x.size(1),), lambda: "add_rms_norm: weight must be [D]")
    return x.new_empty(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMS norm of each row of ``x`` ``[N, D]`` (float32/float16/bfloat16, contiguous last
    dim), scaled by ``weight`` ``[D]`` (x's dtype and device); returns a new contiguous tensor."""
    return torch.ops.samcache.rms_norm(x, weight, _check("rms_norm", x, weight, eps))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (the residual add, in x's dtype), then :func:`rms_norm` of ``x``.

    delta: x's shape, dtype and device, contiguous last dim. x's rows must not overlap."""
    eps = _check("add_rms_norm", x, weight, eps)
    if not isinstance(delta, torch.Tensor):
        raise TypeError(f"add_rms_norm: delta must be a torch.Tensor, got {type(delta).__name__}")
    return torch.ops.samcache.add_rms_norm(x, delta, weight, eps)


__all__ = ["add_rms_norm", "rms_norm"]
