"""Content hashing: 128-bit xxh3 digests of images and bytes, and namespaced cache keys.

A ``ContentHash`` names content (the same pixels always give the same hash). A ``ContentKey``
names content *within a namespace* (model id + optional tenant salt); only ContentKeys index
the cache, so one model or tenant can never hit another's entries.

Digests are 16 bytes: ``xxhash.xxh3_128_intdigest(data).to_bytes(16, "little")``, the byte
order the native core uses for its 128-bit keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from samcache.errors import ImageLoadError

DIGEST_SIZE = 16
_IMAGE_DOMAIN = b"samcache/image/v1\0"
_BYTES_DOMAIN = b"samcache/bytes/v1\0"
_NAMESPACE_DOMAIN = b"samcache/namespace/v1\0"
_ORDINAL_DOMAIN = b"samcache/ordinal/v1\0"
# PIL modes whose numpy array fully describes the pixels; other modes (YCbCr, CMYK, LAB, ...)
# add their name to the hash, since their numbers mean different colours.
_PLAIN_MODES = {"1", "L", "RGB", "RGBA", "I", "I;16", "F"}


def _digest(h: xxhash.xxh3_128) -> bytes:
    return h.intdigest().to_bytes(DIGEST_SIZE, "little")


def _check_digest(digest: object, cls: str) -> None:
    if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
        raise TypeError(f"{cls} needs {DIGEST_SIZE} bytes, got {type(digest).__name__} {digest!r:.40}")


@dataclass(frozen=True, slots=True)
class ContentHash:
    """128-bit digest of some content (an image, a document, bytes)."""

    digest: bytes

    def __post_init__(self) -> None:
        _check_digest(self.digest, "ContentHash")

    def hex(self) -> str:
        return self.digest.hex()

    def __repr__(self) -> str:
        return f"ContentHash({self.digest.hex()})"


@dataclass(frozen=True, slots=True)
class ContentKey:
    """A ContentHash scoped to a Namespace: the only key type the ContentIndex accepts."""

    digest: bytes

    def __post_init__(self) -> None:
        _check_digest(self.digest, "ContentKey")

    def hex(self) -> str:
        return self.digest.hex()

    def __repr__(self) -> str:
        return f"ContentKey({self.digest.hex()})"



def at_ordinal(content: ContentHash, index: int) -> ContentHash:
    """``content`` as the ``index``-th image of its prompt (0: the first): another hash for every
    index. Image KV keyed by it is reused only where the image keeps its place among the prompt's
    images, for models that write an image's order into its KV (``keep_image_order``)."""
    if not isinstance(content, ContentHash):
        raise TypeError(f"at_ordinal needs a ContentHash, got {type(content).__name__}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be an int >= 0, got {index!r}")
    h = xxhash.xxh3_128(_ORDINAL_DOMAIN)
    h.update(content.digest)
    h.update(index.to_bytes(8, "little"))
    return ContentHash(_digest(h))

class Namespace:
    """Scope of cached content: a model id plus an optional tenant salt.

    ``Namespace("qwen2.5-vl-7b", tenant="acme").key(hash_image(img))`` is the index key of that
    image for that model and tenant; any other model id or tenant gives another key.
    """

    __slots__ = ("model_id", "tenant", "digest")

    def __init__(self, model_id: str, tenant: str | bytes | None = None) -> None:
        if not isinstance(model_id, str) or not model_id:
            raise ValueError("Namespace needs a non-empty model_id string")
        if tenant is not None and not isinstance(tenant, (str, bytes)):
            raise TypeError(f"tenant must be str, bytes or None, got {type(tenant).__name__}")
        self.model_id = model_id
        self.tenant = tenant
        h = xxhash.xxh3_128(_NAMESPACE_DOMAIN)
        for part in (model_id.encode(), _tenant_bytes(tenant)):
            h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no ambiguous joins
            h.update(part)
        self.digest = _digest(h)

    def key(self, content: ContentHash) -> ContentKey:
        if not isinstance(content, ContentHash):
            raise TypeError(f"Namespace.key needs a ContentHash, got {type(content).__name__}")
        return ContentKey(_digest(xxhash.xxh3_128(self.digest + content.digest)))

    def __repr__(self) -> str:
        return f"Namespace(model_id={self.model_id!r}, tenant={self.tenant!r})"


def _tenant_bytes(tenant: str | bytes | None) -> bytes:
    if tenant is None:
        return b"\xff"  # distinct from every real salt, including the empty one
    return b"s" + tenant.encode() if isinstance(tenant, str) else b"b" + tenant


def hash_bytes(data: bytes | bytearray | memoryview) -> ContentHash:
    """xxh3-128 of raw bytes (e.g. a document, a tool result)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"hash_bytes needs bytes-like data, got {type(data).__name__}")
    h = xxhash.xxh3_128(_BYTES_DOMAIN)
    h.update(data)
    return ContentHash(_digest(h))


def _canonical(preprocess: Mapping[str, Any] | None) -> bytes:
    if preprocess is None:
        return b"{}"
    if not isinstance(preprocess, Mapping):
        raise TypeError(f"preprocess must be a mapping of parameters, got {type(preprocess).__name__}")
    try:
        return json.dumps(dict(preprocess), sort_keys=True, separators=(",", ":")).encode()
    except TypeError as e:
        raise TypeError(f"preprocess parameters must be JSON values (numbers, strings, lists): {e}") from None


def decode_image_file(path: str | os.PathLike):
    """A PIL image decoded from ``path`` as model pipelines decode it (transformers' load_image):
    EXIF orientation applied, so a rotated photo never shares a hash with its unrotated pixels.
    Unreadable files raise ``ImageLoadError`` (a ``ValueError``) naming the path."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as img:
            img.load()
            return ImageOps.exif_transpose(img)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageLoadError(f"cannot read image {os.fspath(path)!r}: {e}") from e


def _pixels(image: Any) -> tuple[np.ndarray, str]:
    """Decoded pixels as a C-contiguous array, plus a colour-space tag ('' when implied)."""
    import torch

    if isinstance(image, (str, os.PathLike)):
        return _pixels(decode_image_file(image))
    if isinstance(image, torch.Tensor):
        t = image.detach().cpu().contiguous()
        tag = f"torch:{t.dtype}:{tuple(t.shape)}"
        if t.dtype == torch.bool:
            t = t.to(torch.uint8)
        arr = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        return arr, tag
    if isinstance(image, np.ndarray):
        if image.dtype.kind not in "biuf":
            raise TypeError(f"image arrays must be numeric, got dtype {image.dtype}")
        native = image.dtype.newbyteorder("=")  # equal values hash equal whatever the byte order
        return np.ascontiguousarray(image, dtype=native), ""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        Image = None
    if Image is not None and isinstance(image, Image.Image):
        img = image.convert("RGBA") if image.mode in ("P", "PA") else image  # resolve the palette
        return np.ascontiguousarray(np.asarray(img)), ("" if img.mode in _PLAIN_MODES else f"pil:{img.mode}")
    raise TypeError(f"cannot hash an image of type {type(image).__name__}: use a path, PIL image, numpy array or tensor")


def hash_image(image: Any, *, preprocess: Mapping[str, Any] | None = None) -> ContentHash:
    """Content hash of an image: xxh3-128 over its decoded pixels, shape, dtype and the
    preprocessing parameters that change what the model sees (resize, normalisation, ...).

    ``image`` is a path, a PIL image, a numpy array or a torch tensor. The same pixels give the
    same hash whatever the container (a PIL RGB image and its ``np.asarray`` agree); a path is
    decoded first (EXIF orientation applied), so re-encoding a file without changing its
    pixels keeps its hash.
    Torch tensors hash their raw bytes with dtype and shape.
    """
    arr, colour = _pixels(image)
    if arr.dtype.kind == "b":  # bool arrays may store True as 0x01 or 0xFF: hash the values
        arr = arr.astype(np.uint8)
        colour += ":bool"
    header = json.dumps([str(arr.dtype), list(arr.shape), colour], separators=(",", ":")).encode()
    h = xxhash.xxh3_128(_IMAGE_DOMAIN)
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    params = _canonical(preprocess)
    h.update(len(params).to_bytes(8, "little"))
    h.update(params)
    h.update(arr.reshape(-1).view(np.uint8) if arr.size else b"")
    return ContentHash(_digest(h))
