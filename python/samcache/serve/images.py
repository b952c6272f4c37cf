"""Images of an OpenAI request: base64 data URLs (and, only where the server allows a folder,
local files), decoded under the server's limits. The server fetches nothing from the network.

An image is handed to the engine as a read-only HxWx3 uint8 array, the form the engine reads
without a copy (a PIL image costs a conversion every time it is used: ~6 ms for a 1280x720
screenshot, per image and turn, while an agent re-sends the same screenshots every turn). An 8-bit
RGB PNG, what a screenshot is, is decoded by libspng (``pyspng``, part of the ``serve`` extra) where
it is installed: about twice as fast as Pillow, the same pixels; everything else by Pillow."""

from __future__ import annotations

import base64
import binascii
import io
import pathlib
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash
from PIL import Image

from samcache.serve.errors import ApiError

try:
    import pyspng
except ImportError:  # Pillow decodes every image
    pyspng = None


class DecodedImages:
    """Decoded data-URL images by the URL's content (xxh3-128), least recently used dropped past
    ``max_bytes`` of pixels. An agent re-sends the same screenshots every turn: each is decoded
    once. Thread-safe (requests are parsed in worker threads)."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"DecodedImages max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.used = 0
        self.hits = self.misses = 0
        self._images: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, url: str, decode) -> np.ndarray:
        key = xxhash.xxh3_128_hexdigest(url.encode())
        with self._lock:
            image = self._images.get(key)
            if image is not None:
                self._images.move_to_end(key)
                self.hits += 1
                return image
        image = decode()
        size = image.nbytes
        with self._lock:
            self.misses += 1
            if key not in self._images and size <= self.max_bytes:
                self._images[key] = image
                self.used += size
                while self.used > self.max_bytes:
                    _, old = self._images.popitem(last=False)
                    self.used -= old.nbytes
        return image


def load_image(url: str, *, max_bytes: int, max_pixels: int, allowed_dirs: Sequence[pathlib.Path],
               decoded: DecodedImages | None = None) -> np.ndarray:
    """The RGB image ``url`` names (read-only HxWx3 uint8): ``data:image/...;base64,...``, or ``file://`` / a plain path
    inside one of ``allowed_dirs``. Raises :class:`ApiError` (400, or 413 over the limits).
    ``decoded``: data URLs seen before come from there (a file may change: read every time)."""
    if not isinstance(url, str) or not url:
        raise ApiError(400, "image_url.url must be a non-empty string")
    if url.startswith("data:") and decoded is not None:
        return decoded.get(url, lambda: _decode(_data_url(url, max_bytes), max_pixels))
    if url.startswith("data:"):
        data = _data_url(url, max_bytes)
    elif url.startswith(("http://", "https://")):
        raise ApiError(400, "samcache serve does not fetch images from the network; send the image as a base64 "
                            "data URL (data:image/png;base64,...)")
    else:
        data = _local_file(url, max_bytes, allowed_dirs)
    return _decode(data, max_pixels)


def _data_url(url: str, max_bytes: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ApiError(400, "an image data URL must be data:<mime type>;base64,<data>")
    mime = head[len("data:"):-len(";base64")]
    if mime and not mime.startswith("image/"):
        raise ApiError(400, f"the data URL holds {mime!r}, not an image")
    if len(payload) * 3 // 4 > max_bytes:
        raise ApiError(413, f"the image is larger than the server's limit of {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"the image data URL is not valid base64: {e}") from None


def _local_file(url: str, max_bytes: int, allowed_dirs: Sequence[pathlib.Path]) -> bytes:
    if not allowed_dirs:
        raise ApiError(400, "local image paths are off; send the image as a base64 data URL (or start the server "
                            "with --allowed-local-media-path DIR)")
    raw = urllib.parse.unquote(urllib.parse.urlparse(url).path) if url.startswith("file://") else url
    try:
        path = pathlib.Path(raw).resolve(strict=True)
    except (OSError, RuntimeError):
        raise ApiError(400, f"image {url!r}: no such file") from None
    if not any(path.is_relative_to(d) for d in allowed_dirs):
        raise ApiError(400, f"image {url!r} is outside the allowed media folders")
    if not path.is_file():
        raise ApiError(400, f"image {url!r} is not a file")
    if path.stat().st_size > max_bytes:
        raise ApiError(413, f"image {url!r} is larger than the server's limit of {max_bytes} bytes")
    return path.read_bytes()


def _decode(data: bytes, max_pixels: int) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > max_pixels:  # checked before the pixels are decoded: no decompression bomb
                raise ApiError(413, f"the image is {w}x{h} pixels, more than the server's limit of {max_pixels}")
            # An 8-bit RGB PNG (IHDR, which Pillow has just read: bit depth at byte 24, colour type at 25).
            if pyspng is not None and im.format == "PNG" and data[24] == 8 and data[25] == 2:
                pixels = pyspng.load(data, format="RGB")
            else:
                pixels = np.asarray(im.convert("RGB"))  # a fresh array the server owns
            pixels.flags.writeable = False  # shared by every request that sends it: nobody may change it
            return pixels
    except ApiError:
        raise
    except (OSError, ValueError, RuntimeError, Image.DecompressionBombError) as e:  # RuntimeError: pyspng's
        raise ApiError(400, f"the image cannot be decoded: {e}") from None



__all__ = ["DecodedImages", "load_image"]
