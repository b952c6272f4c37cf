"""Images as the engine sees them: decoded RGB pixels, a content hash and a patch grid.

The hash covers the decoded pixels and every preprocessing parameter that changes what the model
sees, so two images share cache entries only if the model would see the same input. The patch
grid (and with it the number of image tokens and their M-RoPE positions) follows from the image
size alone, so a cache hit never runs the image processor; only a ViT miss turns pixels into
patches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from samcache.errors import ImageLoadError
from samcache.hashing import ContentHash, decode_image_file, hash_image


def load_rgb(image: Any) -> np.ndarray:
    """``image`` (a path, PIL image, HxWx3/HxWx4/HxW uint8 array or tensor) as HxWx3 uint8 RGB."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        return load_rgb(decode_image_file(image))
    if isinstance(image, Image.Image):
        try:
            return np.ascontiguousarray(np.asarray(image.convert("RGB")))
        except (OSError, ValueError) as e:
            raise ImageLoadError(f"cannot convert a {image.mode} PIL image to RGB: {e}") from e
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ImageLoadError(f"image arrays must be uint8 (0..255), got dtype {image.dtype}")
        if image.ndim == 2:
            image = np.repeat(image[:, :, None], 3, axis=2)
        if image.ndim != 3 or image.shape[2] not in (3, 4):
            hint = (" (channels first? pass HxWxC, e.g. array.transpose(1, 2, 0) or tensor.permute(1, 2, 0))"
                    if image.ndim == 3 and image.shape[0] in (1, 3, 4) else "")
            raise ImageLoadError(f"image arrays must be HxW, HxWx3 or HxWx4, got shape {image.shape}{hint}")
        if min(image.shape[:2]) < 1:
            raise ImageLoadError(f"image has no pixels: shape {image.shape}")
        return np.ascontiguousarray(image[:, :, :3])
    raise ImageLoadError(
        f"cannot use an image of type {type(image).__name__}: pass a path, a PIL image or a uint8 array"
    )


@dataclass(frozen=True)
class ImageGeometry:
    """The image processor settings that decide an image's patch grid."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_processor(cls, image_processor) -> "ImageGeometry":
        size = image_processor.size
        return cls(
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            temporal_patch_size=int(image_processor.temporal_patch_size),
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
        )

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of an image of this size, as the processor would resize it."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        try:
            h, w = smart_resize(
                height, width, factor=self.patch_size * self.merge_size,
                min_pixels=self.min_pixels, max_pixels=self.max_pixels,
            )
        except ValueError as e:
            raise ImageLoadError(f"image of {width}x{height} pixels cannot be used: {e}") from None
        return 1, h // self.patch_size, w // self.patch_size


@dataclass(frozen=True)
class TileGeometry:
    """InternVL's image settings: the image is resized to a grid of square tiles whose aspect ratio
    is closest to its own (``min_patches`` to ``max_patches`` tiles), plus a thumbnail of the
    whole image when there is more than one tile; each tile becomes ``tokens_per_tile`` tokens."""

    tile_size: int
    min_patches: int
    max_patches: int
    tokens_per_tile: int
    merge_size: int = 1  # the grid is already in tokens (engine code reading merge_size divides by it)

    @classmethod
    def from_processor(cls, image_processor, tokens_per_tile: int) -> "TileGeometry":
        size = image_processor.size
        side = int(size["height"] if isinstance(size, dict) else size.height)
        return cls(tile_size=side, min_patches=int(image_processor.min_patches),
                   max_patches=int(image_processor.max_patches), tokens_per_tile=int(tokens_per_tile))

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(tiles, rows, cols): the tile grid the processor cuts an image of this size into (tiles
        counts the thumbnail)."""
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

        cols, rows = get_optimal_tiled_canvas((height, width), (self.tile_size, self.tile_size),
                                              self.min_patches, self.max_patches)
        return rows * cols + (1 if rows * cols > 1 else 0), rows, cols

    def tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * self.tokens_per_tile

    def coordinates(self, grid: tuple[int, int, int]) -> np.ndarray:
        """int64 [2, tokens]: (row, col) of each image token on the image's token grid, in token
        order (tiles row-major, each tile's tokens row-major); the thumbnail's tokens sit in a block
        of their own right of the tiles. What compression's spatial spread reads."""
        tiles, rows, cols = grid
        g = int(round(self.tokens_per_tile ** 0.5))
        k = np.arange(tiles * self.tokens_per_tile)
        tile, i, j = k // self.tokens_per_tile, (k % self.tokens_per_tile) // g, k % g
        thumb = tile >= rows * cols
        r = np.where(thumb, i, (tile // cols) * g + i)
        c = np.where(thumb, cols * g + 1 + j, (tile % cols) * g + j)
        return np.stack([r, c]).astype(np.int64)


@dataclass
class PreparedImage:
    """One image of a request: RGB pixels, content hash, patch grid and token count."""

    pixels: np.ndarray
    content: ContentHash
    grid: tuple[int, int, int]
    num_tokens: int


def prepare_image(image: Any, geometry: ImageGeometry | TileGeometry, preprocess: dict[str, Any]) -> PreparedImage:
    pixels = load_rgb(image)
    grid = geometry.grid(*pixels.shape[:2])
    if isinstance(geometry, TileGeometry):
        tokens = geometry.tokens(grid)
    else:
        tokens = grid[0] * grid[1] * grid[2] // (geometry.merge_size**2)
    return PreparedImage(pixels, hash_image(pixels, preprocess=preprocess), grid, tokens)


def preprocess_params(image_processor) -> dict[str, Any]:
    """Every image processor setting that changes the pixels the ViT sees (part of the hash)."""
    d = image_processor.to_dict()
    keep = ("size", "do_convert_rgb", "do_normalize", "do_rescale", "do_resize", "image_mean", "image_std",
            "merge_size", "patch_size", "resample", "rescale_factor", "temporal_patch_size", "image_processor_type",
            "crop_to_patches", "min_patches", "max_patches")
    out = {k: d[k] for k in keep if k in d}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


__all__ = ["ImageGeometry", "PreparedImage", "TileGeometry", "load_rgb", "prepare_image", "preprocess_params"]
