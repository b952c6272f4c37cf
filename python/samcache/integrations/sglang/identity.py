"""Image identity inside SGLang: per-image content keys, not SGLang's whole-item pad values.

SGLang names a multimodal item by a 64-bit hash of its features and writes pad values derived from
it over the item's tokens, so its radix cache matches an image only inside an identical prefix, and
one item may bundle several images. samcache names every image on its own: an xxh3-128 hash of its
pixel patches (the processor's ``pixel_values`` rows of that image), its patch grid and their dtype,
under the :class:`~samcache.hashing.Namespace` of the model fingerprint and the request's tenant.
One changed pixel is another image; another model or tenant never hits. Items that carry no pixels
(precomputed embeddings, features already dropped) name nothing and are never reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from samcache.hashing import ContentHash, hash_bytes
from samcache.model_identity import model_fingerprint


@dataclass(frozen=True)
class ImageRef:
    """Image tokens ``[offset, offset + length)`` of a request's prompt and the image's content hash
    (None: not nameable by content, never reused)."""

    content: ContentHash | None
    offset: int
    length: int


def _grid(item: Any) -> np.ndarray | None:
    data = getattr(item, "model_specific_data", None) or {}
    grid = data.get("image_grid_thw") if hasattr(data, "get") else None
    if grid is None:
        return None
    return np.asarray(grid.cpu() if isinstance(grid, torch.Tensor) else grid, dtype=np.int64).reshape(-1, 3)


def image_refs(mm_inputs: Any, within: tuple[int, int] | None = None) -> list[ImageRef]:
    """Every image of a request (SGLang's ``MultimodalInputs``), split out of bundled items. With
    ``within=(begin, end)`` (an extend step's prompt positions) only images whose last token lies
    inside are hashed: those the step computes or splices, whole or after the part the prefix holds.
    The others (wholly in the prefix, or cut by the step's end) come back with ``content=None``."""
    refs: list[ImageRef] = []
    for item in getattr(mm_inputs, "mm_items", None) or ():
        if not item.is_image() or not item.offsets:
            continue
        grid = _grid(item)
        feature = item.feature if isinstance(item.feature, torch.Tensor) else None
        nameable = grid is not None and feature is not None and feature.dim() == 2 and grid.shape[0] == len(item.offsets)
        patches = np.concatenate([[0], np.cumsum(grid.prod(axis=1))]) if nameable else None
        if nameable and patches[-1] != feature.shape[0]:
            nameable = False  # rows that do not add up to the grids: not a layout we can split
        for i, (start, end) in enumerate(item.offsets):  # SGLang's offsets are inclusive
            content = None
            inside = within is None or within[0] <= int(end) < within[1]
            if nameable and inside:
                rows = feature[int(patches[i]): int(patches[i + 1])].detach().contiguous().cpu()
                pixels = hash_bytes(memoryview(rows.view(-1).view(torch.uint8).numpy()))
                content = hash_bytes(grid[i].tobytes() + str(rows.dtype).encode() + b"|" + pixels.digest)
            refs.append(ImageRef(content, int(start), int(end) - int(start) + 1))
    return refs


def model_id(model: Any, dtype: torch.dtype) -> str:
    """The model part of the image store's keys (:func:`samcache.model_identity.model_fingerprint`):
    the checkpoint (SGLang's ``--model-path`` and revision), the model class, the config's name and
    the dtype. (Qwen3-VL-MoE's ``model.config`` is its text config, without a name: the server's
    arguments name the model.)"""
    args = _server_args()
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or ""
    return model_fingerprint(getattr(args, "model_path", None) or name or type(model).__name__, runtime="sglang",
                             revision=getattr(args, "revision", None), config=name, model_class=type(model).__name__,
                             dtype=dtype)


def model_path(model: Any) -> str | None:
    """The checkpoint a model was loaded from (SGLang's ``--model-path``, else its config's name)."""
    args = _server_args()
    config = getattr(model, "config", None)
    return getattr(args, "model_path", None) or getattr(config, "_name_or_path", None) or None


def server_model_id(ctx: Any) -> str:
    """The model part of the radix tree's keys, from SGLang's cache-factory context: checkpoint,
    revision, dtype, architecture and KV dtype (KV from another of these is never reused)."""
    mc, sa = ctx.model_config, ctx.server_args
    archs = ",".join(getattr(getattr(mc, "hf_config", None), "architectures", None) or [])
    return model_fingerprint(str(getattr(mc, "model_path", None)), runtime="sglang", revision=getattr(mc, "revision", None),
                             dtype=getattr(mc, "dtype", None), architectures=archs,
                             kv_dtype=getattr(sa, "kv_cache_dtype", None))


def _server_args() -> Any:
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # noqa: BLE001 - no server context (tools, tests): the config names the model
        return None


__all__ = ["ImageRef", "image_refs", "model_id", "model_path", "server_model_id"]
