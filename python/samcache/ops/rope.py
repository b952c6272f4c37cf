"""rope: move cached keys to new positions by re-rotating RoPE.

Keys are cached with RoPE applied at their old positions ``p``. Reusing them at ``p + delta``
needs every rotary pair ``j`` rotated by ``delta * inv_freq[j]``; rotations compose, so
``rope_rerotate(RoPE(k, p), d) == RoPE(k, p + d)``.

Styles (pairing, and which position drives frequency ``j``):

- ``"neox"``: rotate-half, pair ``(j, j + rotary_dim/2)``; ``delta`` is ``[N]``.
- ``"gptj"``: interleaved, pair ``(2j, 2j + 1)``; ``delta`` is ``[N]``.
- ``"mrope"``: Qwen2/2.5-VL sectioned M-RoPE, rotate-half; ``delta`` is ``[3, N]`` (t, h, w);
  frequency ``j`` uses t below ``s0``, h below ``s0 + s1``, w above.
- ``"mrope_interleaved"``: Qwen3-VL interleaved M-RoPE, rotate-half; ``delta`` is ``[3, N]``;
  frequencies ``1, 4, 7, ...`` below ``3 * s1`` use h, ``2, 5, 8, ...`` below ``3 * s2`` use w,
  the rest t.

Precision: the angle is formed and reduced modulo 2*pi in float64 before a float32 cos/sin, so
float32 keys stay within ~1e-6 of a float64 rotation even at ``|delta| ~ 1e5`` (a float32
angle alone would be off by up to ~6e-3 rad there). See docs/ops/rope.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch

STYLES = ("neox", "gptj", "mrope", "mrope_interleaved")
MROPE_STYLES = ("mrope", "mrope_interleaved")


def _check_fake_args(key, delta, inv_freq, style, mrope_section) -> None:
    torch._check(key.dim() == 3, lambda: "rope: key must be [N, H, D]")
    torch._check(inv_freq.dim() == 1, lambda: "rope: inv_freq must be 1-D")
    torch._check(style in STYLES, lambda: f"rope: unknown style {style!r}")
    torch._check(delta.dim() == (2 if style in MROPE_STYLES else 1), lambda: "rope: delta has the wrong rank")


@torch.library.register_fake("samcache::rope_rerotate")
def _rope_rerotate_fake(key, delta, inv_freq, style, mrope_section) -> None:
    _check_fake_args(key, delta, inv_freq, style, mrope_section)


@torch.library.register_fake("samcache::rope_rerotate_write")
def _rope_rerotate_write_fake(key, delta, inv_freq, style, mrope_section, key_cache, slot_mapping) -> None:
    _check_fake_args(key, delta, inv_freq, style, mrope_section)
    torch._check(key_cache.dim() == 4, lambda: "rope: key_cache must be [num_blocks, block_size, H, D]")
    torch._check(slot_mapping.dim() == 1, lambda: "rope: slot_mapping must be 1-D")


def _check_args(key, delta, inv_freq, style, mrope_section) -> list[int]:
    for name, value in (("key", key), ("delta", delta), ("inv_freq", inv_freq)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if not isinstance(style, str):
        raise TypeError(f"style must be a str, got {type(style).__name__}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if isinstance(mrope_section, torch.Tensor):
        mrope_section = mrope_section.tolist()
    if not isinstance(mrope_section, Sequence) or isinstance(mrope_section, str):
        raise TypeError(f"mrope_section must be a sequence of ints, got {type(mrope_section).__name__}")
    if not all(isinstance(s, Integral) and not isinstance(s, bool) for s in mrope_section):
        raise TypeError(f"mrope_section must hold ints, got {list(mrope_section)}")
    section = [int(s) for s in mrope_section]  # numpy ints too
    if style in MROPE_STYLES and len(section) != 3:
        raise ValueError(f"style {style!r} needs a 3-entry mrope_section, got {section}")
    if style not in MROPE_STYLES and section:
        raise ValueError(f"mrope_section must be empty for style {style!r}, got {section}")
    return section


def rope_rerotate(
    key: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    style: str = "neox",
    mrope_section: Sequence[int] = (),
) -> None:
    """Re-rotate cached keys in place from positions ``p`` to ``p + delta``.

    key: ``[N, H, D]`` float32/float16/bfloat16, last dim contiguous; the first
        ``rotary_dim = 2 * len(inv_freq)`` dims of each head rotate, the rest stay bit-exact.
    delta: int64 ``[N]`` (1-D styles) or ``[3, N]`` (t, h, w; M-RoPE styles), on key's device.
    inv_freq: float32 ``[rotary_dim / 2]`` on key's device, the model's inverse frequencies
        (any rope scaling already applied).
    style: ``"neox"``, ``"gptj"``, ``"mrope"`` or ``"mrope_interleaved"``.
    mrope_section: ``[s_t, s_h, s_w]`` summing to ``rotary_dim / 2`` for M-RoPE styles, else ``[]``.
    """
    section = _check_args(key, delta, inv_freq, style, mrope_section)
    torch.ops.samcache.rope_rerotate(key, delta, inv_freq, style, section)


def rope_rerotate_write(
    key: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    style: str,
    mrope_section: Sequence[int],
    key_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key`` re-rotated by ``delta`` into the paged cache, in one pass; ``key`` is unchanged.

    key_cache: ``[num_blocks, block_size, H, D]``, key's dtype and device, last dim contiguous.
    slot_mapping: int32/int64 ``[N]`` on key's device; token ``i`` goes to block
        ``slot // block_size``, offset ``slot % block_size``; ``-1`` skips the token. On the CPU
        slots are checked (range, distinct); on CUDA out-of-range slots are skipped unchecked.
    Other arguments as in :func:`rope_rerotate`.
    """
    section = _check_args(key, delta, inv_freq, style, mrope_section)
    for name, value in (("key_cache", key_cache), ("slot_mapping", slot_mapping)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    torch.ops.samcache.rope_rerotate_write(key, delta, inv_freq, style, section, key_cache, slot_mapping)


__all__ = ["rope_rerotate", "rope_rerotate_write"]
