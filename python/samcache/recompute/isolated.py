"""``isolated``: image KV computed without left context, reused anywhere (MPIC).

When an image is first seen, the turn computes it in context as usual (that turn is exact), and
the KV kept for later turns is computed again with nothing before the image but its frame token
(``<|vision_start|>``): KV that depends on the image alone, the same wherever the image goes
next. Every later reuse of it is then a move (no image was before it when it was computed), and
the recompute order is :mod:`~samcache.recompute.boundary`'s: each image's first tokens first.
The extra cost is one more forward over the image's tokens when it is first seen, counted in the
turn's metrics (``isolated_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from samcache.recompute.boundary import Boundary


@dataclass(frozen=True)
class Isolated(Boundary):
    name: ClassVar[str] = "isolated"
    isolated: ClassVar[bool] = True


__all__ = ["Isolated"]
