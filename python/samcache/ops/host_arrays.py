"""Host index arrays to a device in one asynchronous copy.

A step's metadata is a handful of small integer arrays built on the host. Copied one by one from
ordinary (pageable) memory, each copy makes the host wait until the device's stream has drained;
staged in one pinned buffer, all of them go in one copy that the host does not wait for.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(arrays: Sequence[np.ndarray], dtype: np.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """``arrays`` as 1-D tensors of ``dtype`` on ``device``: contiguous views of one buffer that
    arrived in one non-blocking copy (on the CPU, views of one host tensor)."""
    device = torch.device(device)
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise ValueError(f"upload copies index arrays: dtype must be an integer type, got {dtype}")
    info = np.iinfo(dtype)
    parts = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"array {i} must hold integers, got {a.dtype}")
        if a.size and (a.min() < info.min or a.max() > info.max):
            raise ValueError(f"array {i} has values outside {dtype} ({a.min()} .. {a.max()})")
        parts.append(a.astype(dtype, copy=False).ravel())
    flat = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)  # torch keeps the pinned buffer until the copy ran
    elif device.type != "cpu":
        flat = flat.to(device)
    return list(flat.split([p.size for p in parts])) if parts else []


__all__ = ["upload"]
