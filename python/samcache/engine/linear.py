"""Linear layers at engine speed on the CPU.

torch's float32 ``F.linear`` on the CPU calls MKL's sgemm, which takes its AVX2 path on AMD
processors; oneDNN, also inside torch (``torch.ops.mkldnn._linear_pointwise``: the op
``torch.compile``'s CPU backend emits for linear layers, and what vLLM's CPU build uses), runs
AVX-512 code there: 2.2x faster on a prefill's 1,400 x 256 x 1,536 layer on this project's
machines (docs/benchmark.md). Below ``ONEDNN_MIN_ROWS`` rows (decode) ``F.linear``'s GEMV is the
faster one. Results agree with ``F.linear`` to float32 rounding (another summation order).

``onednn_linears(module)`` routes every ``nn.Linear`` inside ``module`` through :func:`linear`
for the duration of a ``with`` block (the vision tower runs under it).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

ONEDNN_MIN_ROWS = 8


@functools.cache
def _onednn_available() -> bool:
    """oneDNN's linear exists in this torch and agrees with F.linear on a probe."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=g) for shape in ((16, 32), (24, 32), (24,)))
        return bool(torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-4, rtol=1e-4))
    except (RuntimeError, TypeError):
        return False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN for float32 CPU inputs of enough rows."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1] and _onednn_available()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@contextlib.contextmanager
def onednn_linears(module: torch.nn.Module):
    """Inside the block, every ``nn.Linear`` of ``module`` computes through :func:`linear`."""
    patched = [m for m in module.modules() if type(m) is torch.nn.Linear and "forward" not in vars(m)]
    for m in patched:
        m.forward = functools.partial(_linear_forward, m)
    try:
        yield module
    finally:
        for m in patched:
            vars(m).pop("forward", None)


def _linear_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


__all__ = ["ONEDNN_MIN_ROWS", "linear", "onednn_linears"]
