"""Deterministic synthetic images (screenshots with windows, text and shapes) for calibration,
tests, the demo and benchmarks: nothing is downloaded."""

from __future__ import annotations

import numpy as np


def _size(size) -> tuple[int, int]:
    h, w = size if isinstance(size, (tuple, list)) and len(size) == 2 else (None, None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 16 for v in (h, w)):
        raise ValueError(f"size must be (height, width) with ints >= 16, got {size!r}")
    return h, w


def screenshot(seed: int, size: tuple[int, int] = (720, 1280)) -> np.ndarray:
    """An HxWx3 uint8 'screenshot' (``size`` = (height, width)) drawn from ``seed``: a desktop
    colour, a few windows with title bars, text lines and buttons. Different seeds differ."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    h, w = _size(size)
    img = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(40, 200, 3)))
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, h - max(8, h // 24), w, h], fill=(30, 30, 36))  # task bar
    for _ in range(int(rng.integers(2, 5))):
        x0, y0 = int(rng.integers(0, w * 2 // 3)), int(rng.integers(0, h * 2 // 3))
        x1, y1 = min(w - 1, x0 + int(rng.integers(w // 5, w // 2))), min(h - 1, y0 + int(rng.integers(h // 5, h // 2)))
        draw.rectangle([x0, y0, x1, y1], fill=tuple(int(c) for c in rng.integers(180, 256, 3)), outline=(0, 0, 0))
        draw.rectangle([x0, y0, x1, y0 + 14], fill=tuple(int(c) for c in rng.integers(0, 120, 3)))
        for line in range(y0 + 20, y1 - 10, 14):
            words = " ".join("".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(2, 8))))
                             for _ in range(int(rng.integers(2, 7))))
            draw.text((x0 + 6, line), words, fill=(20, 20, 20))
        bx = x0 + int(rng.integers(0, max(1, x1 - x0 - 60)))
        draw.rounded_rectangle([bx, y1 - 24, bx + 56, y1 - 6], radius=4, fill=(50, 110, 220))
    return np.asarray(img)



def document_page(seed: int, size: tuple[int, int] = (1100, 850)) -> np.ndarray:
    """An HxWx3 uint8 'document page' drawn from ``seed``: a title, paragraphs of text lines, and
    now and then a table or a figure box."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    h, w = _size(size)
    img = Image.new("RGB", (w, h), (250, 250, 246))
    draw = ImageDraw.Draw(img)
    margin = max(8, w // 12)
    draw.text((margin, margin), f"Section {seed % 97}: " + "".join(chr(65 + int(c)) for c in rng.integers(0, 26, 10)),
              fill=(10, 10, 10))
    y = margin + 30
    while y < h - margin:
        kind = rng.random()
        if kind < 0.12 and y + 120 < h - margin:  # a table
            rows, cols = int(rng.integers(3, 6)), int(rng.integers(2, 5))
            cw = (w - 2 * margin) // cols
            for r in range(rows):
                for c in range(cols):
                    draw.rectangle([margin + c * cw, y + r * 20, margin + (c + 1) * cw, y + (r + 1) * 20], outline=(60, 60, 60))
                    draw.text((margin + c * cw + 4, y + r * 20 + 4), str(int(rng.integers(0, 10000))), fill=(0, 0, 0))
            y += rows * 20 + 16
        elif kind < 0.2 and y + 140 < h - margin:  # a figure
            draw.rectangle([margin, y, w - margin, y + 120], fill=tuple(int(c) for c in rng.integers(150, 240, 3)))
            draw.line([margin, y + 120, w - margin, y + int(rng.integers(0, 120))], fill=(200, 30, 30), width=3)
            y += 136
        else:  # a text line
            words = " ".join("".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(2, 9))))
                             for _ in range(int(rng.integers(6, 14))))
            draw.text((margin, y), words, fill=(30, 30, 30))
            y += 16
    return np.asarray(img)


__all__ = ["document_page", "screenshot"]
