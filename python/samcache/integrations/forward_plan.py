"""The engine-independent half of executing a reuse plan inside an engine's forward pass.

Both plugins (vLLM, SGLang) plan every request of a forward pass the same way (:class:`StepPlan`,
over :func:`samcache.reuse.plan_request`, the per-request path samcache's engine runs too: the
same keys, look-up, plan and counters), then do the same three things; only how they find rows and
write the cache differs:

- splice a stored image (:class:`ImageKV`) into the engine's cache: its keys re-rotated from the
  cached M-RoPE positions to the new ones, every layer in one ``rope_rerotate`` call
  (:func:`splice_image`), written through the engine's own cache op (a :class:`KVWriter`);
- turn the rows no layer computes (spliced) and each layer's recompute rows into the row set of
  every layer, shrinking with depth (:func:`layer_rows`);
- keep the per-layer keys and values of images computed whole in the step, to store them when it
  ends (:class:`PendingSave`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from samcache.errors import InvariantViolation
from samcache.hashing import ContentHash, ContentKey, Namespace
from samcache.integrations.isolated_rows import IsolatedServing, SideRowsBuilder
from samcache.ops.rope import rope_rerotate
from samcache.reuse import CachedImage, ImageSlot, PromptLayout, RecomputeBudget, ReuseCounters, image_key, plan_request


@dataclass
class ImageKV:
    """A stored image: per-layer keys (rotated at ``positions``) and values, ``[L, n, H, D]``, its
    M-RoPE positions ``[3, n]`` and its index among its prompt's images when computed (None: not
    known)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    index: int | None = None


@dataclass
class PendingSave:
    """An image computed whole in this step, to store: its flattened ``rows`` and M-RoPE
    ``positions`` ``[3, n]``; each layer's keys and values are captured as the layer writes them."""

    key: ContentKey
    rows: torch.Tensor
    positions: torch.Tensor
    index: int | None = None
    side_at: int | None = None  # computed in side rows (isolated model): its first row's side index
    record: tuple = ()          # what else its store record must match (an isolated model's variant and sink)
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)

    def capture(self, layer_rows: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep this image's rows of the keys and values a layer wrote for ``layer_rows`` (None:
        every row of the step), the side rows after them."""
        if self.side_at is not None:
            first = (keys.size(0) if layer_rows is None else layer_rows.numel()) + self.side_at
            index = torch.arange(first, first + self.rows.numel())
        else:
            index = self.rows if layer_rows is None else torch.searchsorted(layer_rows, self.rows)
        self.k.append(keys.index_select(0, index))
        self.v.append(values.index_select(0, index))

    def image_kv(self) -> ImageKV:
        return ImageKV(torch.stack(self.k), torch.stack(self.v), self.positions, self.index)

    @property
    def check(self) -> tuple:
        """The store's check value of this image's record (a lookup must name the same)."""
        return (self.rows.numel(), *self.record)


class KVWriter(Protocol):
    """Writes keys and values ``[n, H, D]`` of decoder layer ``layer`` into the engine's paged cache
    at ``slots`` (the engine's own cache op: its layout is its business)."""

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class Rotary:
    """What re-rotating a cached key needs: the model's inverse frequencies and M-RoPE sections."""

    inv_freq: torch.Tensor
    style: str
    section: tuple[int, ...]

    @classmethod
    def of(cls, rope: Any, engine: str) -> "Rotary":
        """From an engine's M-RoPE module (vLLM's and SGLang's share these attribute names)."""
        section = tuple(int(s) for s in (getattr(rope, "mrope_section", None) or ()))
        if len(section) != 3 or not getattr(rope, "is_neox_style", True):
            raise ValueError(f"samcache: the model's rotary embedding is not a rotate-half M-RoPE ({engine} plugin)")
        if getattr(rope, "scaling_factor", None) not in (None, 1, 1.0):
            raise ValueError(f"samcache: M-RoPE with rope scaling is not supported by the {engine} plugin yet")
        style = "mrope_interleaved" if getattr(rope, "mrope_interleaved", False) else "mrope"
        inv_freq = rope._compute_inv_freq(rope.base).to(torch.float32).cpu()
        if 2 * inv_freq.numel() != rope.rotary_dim or sum(section) != inv_freq.numel():
            raise ValueError("samcache: the model's M-RoPE sections do not cover its rotary dimensions")
        return cls(inv_freq.contiguous(), style, section)


def splice_image(entry: ImageKV, cached_span: slice, new_positions: torch.Tensor, slots: torch.Tensor,
                 cache: KVWriter, rotary: Rotary, num_layers: int) -> None:
    """Write tokens ``cached_span`` of a stored image into the cache at ``slots``, their keys moved
    from the cached positions to ``new_positions`` ``[3, n]`` (per-token, per-axis deltas)."""
    keys = entry.k[:, cached_span].clone()
    delta = (new_positions.to(keys.device) - entry.positions[:, cached_span].to(keys.device)).to(torch.int64)
    # Every layer's keys re-rotated in one call (the same deltas at every layer).
    rope_rerotate(keys.view(-1, *keys.shape[2:]), delta.repeat(1, num_layers).contiguous(),
                  rotary.inv_freq.to(keys.device), rotary.style, rotary.section)
    for layer in range(num_layers):
        cache.write(layer, keys[layer], entry.v[layer, cached_span], slots)


def layer_rows(skipped: np.ndarray, recompute: list[list[np.ndarray]], num_layers: int,
               always: np.ndarray | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The flattened rows each layer computes (every row not ``skipped``, plus the layer's
    ``recompute`` rows, plus ``always``) and, per layer, their positions among the previous
    layer's rows (None: the same set, or layer 0). Raises if a set grows with depth."""
    rows: list[torch.Tensor] = []
    select: list[torch.Tensor | None] = []
    for layer in range(num_layers):
        keep = ~skipped
        if recompute[layer]:
            keep[np.concatenate(recompute[layer])] = True
        if always is not None:
            keep[always] = True
        current = torch.from_numpy(np.flatnonzero(keep))
        if layer and torch.equal(current, rows[-1]):
            current, sel = rows[-1], None                    # the same set: no gather, one batch
        else:
            sel = torch.searchsorted(rows[-1], current) if layer else None
            if sel is not None and (sel.numel() and int(sel.max()) >= rows[-1].numel()
                                    or not torch.equal(rows[-1][sel], current)):
                raise InvariantViolation(f"samcache: layer {layer} computes rows layer {layer - 1} skipped "
                                         "(recompute sets must shrink with depth)")
        rows.append(current)
        select.append(sel)
    return rows, select


@dataclass(frozen=True)
class RequestImage:
    """An image of a request as a plugin names it: its content (None: not nameable, never reused)
    and its prompt tokens ``[offset, offset + length)``. Its index among the request's images is
    its place in the list the plugin gives."""

    content: ContentHash | None
    offset: int
    length: int


@dataclass
class StepPlan:
    """One forward pass's plan, request by request: what is spliced (``skipped``: flattened rows no
    layer computes), each layer's recompute rows, the images to save, the counters, and
    ``approximate``: per request (the ``owner`` the plugin names) whose KV is approximate from
    some token on, its exact leading tokens (only those may stay in the serving engine's exact
    prefix cache). ``side``: an isolated model's first-seen images, computed in side rows
    (:mod:`samcache.integrations.isolated_rows`); their rows of the step are ``skipped``."""

    total: int
    num_layers: int
    skipped: np.ndarray = None  # type: ignore[assignment]
    recompute: list[list[np.ndarray]] = None  # type: ignore[assignment]
    saves: list[PendingSave] = field(default_factory=list)
    counters: ReuseCounters = field(default_factory=ReuseCounters)
    approximate: dict[Any, int] = field(default_factory=dict)
    side: SideRowsBuilder = field(default_factory=SideRowsBuilder)
    # Isolated images computed alone in this step, (key, record) -> (side index, positions), and the
    # partly cached ones waiting for :meth:`settle` (a request whose prefix hit the blocks another
    # request of the same step computes).
    _computed: dict = field(default_factory=dict)
    _partial: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.skipped = np.zeros(self.total, dtype=bool)
        self.recompute = [[] for _ in range(self.num_layers)]

    def settle(self) -> None:
        """After every request is added: the rest of each isolated image whose first tokens came
        from the prefix cache is written from the side rows of another request of this step that
        computes the same image alone at the same positions (the prefix hit was on that request's
        blocks, so the image sits where it does there); else it falls back (computed in context)."""
        for owner, named, start, begin, rows, image_positions in self._partial:
            found = self._computed.get(named) if named is not None else None
            if found is not None:
                side_at, computed_positions = found
                offset = begin - start  # the first scheduled token's place in the image
                if torch.equal(computed_positions[:, offset:offset + rows.numel()], image_positions):
                    self.side.also_write(side_at + offset, rows)
                    self.skipped[rows.numpy()] = True
                    continue
            self._fallback(owner, start)
        self._partial.clear()

    def _fallback(self, owner: Any, start: int) -> None:
        """An isolated image at prompt token ``start`` computed in context: the request's KV is
        approximate from there."""
        self.counters.isolated_fallbacks += 1
        self.approximate[owner] = min(start, self.approximate.get(owner, start))

    def add_request(self, images: Sequence[RequestImage], *, begin: int, end: int, base: int, namespace: Namespace,
                    store: Any, budget: RecomputeBudget | None, keep_image_order: bool, positions: torch.Tensor,
                    slots: torch.Tensor, cache: KVWriter, rotary: Rotary, may_splice: bool = True,
                    owner: Any = None, isolated: IsolatedServing | None = None,
                    sink_token: int | None = None) -> None:
        """Plan a request whose prompt tokens ``[begin, end)`` are the step's flattened rows from
        ``base`` on (``positions`` [3, rows], ``slots`` its KV slots by row), splice the images the
        store holds into the cache, and list those computed whole here to save. ``may_splice``
        False: every image is computed (the engine reads those rows), and still saved. ``owner``:
        the request's name in :attr:`approximate` where the splice leaves its KV approximate.
        ``isolated``: the model's images attend in isolation (after ``sink_token``, the prompt's
        first token): stored images are exact anywhere, first-seen ones are computed in side rows.
        One whose first tokens came from the prefix cache and that the store no longer holds waits
        for :meth:`settle`; one that cannot be computed alone (cut by the step's end, or the
        prompt's first token unknown) is computed in context and counted in ``isolated_fallbacks``;
        its request is approximate from there."""
        unnamed: set = set()  # keys of images that cannot be named: never looked up, never saved
        layout_images = []
        for index, image in enumerate(images):
            if image.offset + image.length > end:
                if isolated is not None and image.offset < end:  # its first tokens here: computed in context
                    self._fallback(owner, image.offset)
                break  # cut by the step's end (or later): computed as the engine does, as is everything after
            if image.content is None:
                key = ("unnamed", index)
                unnamed.add(key)
            else:
                key = image_key(namespace, image.content, index, keep_image_order)
            # Plugins move keys per token (splice_image); the span's own position is informative only.
            position = int(positions[0, base + image.offset - begin]) if image.offset >= begin else 0
            layout_images.append(ImageSlot(index, image.offset, image.length, key, position))
        layout = PromptLayout(num_tokens=end, images=tuple(layout_images))

        record = (() if isolated is None else isolated.check(sink_token))

        def lookup(slot: ImageSlot):
            named = may_splice and slot.key not in unnamed
            entry = store.get(slot.key, check=(slot.length, *record)) if named else None
            if entry is None:
                return None
            return CachedImage(entry.k.size(1), int(entry.positions[0, 0]), entry.index,
                               exact=isolated is not None), entry

        request = plan_request(layout, prefix_tokens=begin, lookup=lookup, budget=budget, num_layers=self.num_layers)
        if request.plan.exact_tokens < end:
            self.approximate[owner] = request.plan.exact_tokens
        saving = {save.key for save in self.saves}
        for slot in request.misses:
            whole = slot.start >= begin  # else its first tokens came from the prefix cache
            rows = torch.arange(base + max(slot.start, begin) - begin, base + slot.end - begin)
            side_at = None
            if isolated is not None:
                if isolated.attention.sink and sink_token is None:
                    self._fallback(owner, slot.start)
                    continue
                if not whole:  # its first tokens came from the prefix cache: its rest may be computed alone here
                    named = None if slot.key in unnamed else (slot.key, record)
                    self._partial.append((owner, named, slot.start, begin, rows, positions[:, rows].cpu()))
                    continue
                image_positions = positions[:, rows].cpu()
                side_at = self.side.add(isolated.prefix(sink_token), rows, image_positions)
                if slot.key not in unnamed:
                    self._computed.setdefault((slot.key, record), (side_at, image_positions))
                self.counters.isolated_images += 1
                self.skipped[rows.numpy()] = True
            if slot.key not in unnamed and whole and slot.key not in saving:
                self.saves.append(PendingSave(slot.key, rows, positions[:, rows].cpu().clone(), slot.index,
                                              side_at=side_at, record=record))
                saving.add(slot.key)
        for span in request.plan.spliced:
            entry = request.hits[layout.images[span.image].key]
            rows = torch.arange(base + span.start - begin, base + span.end - begin)
            splice_image(entry, slice(span.offset, span.offset + span.length), positions[:, rows].cpu(),
                         slots[rows.to(slots.device)].to(torch.int64), cache, rotary, self.num_layers)
            self.skipped[rows.numpy()] = True
        for layer in range(self.num_layers):
            moved = request.recompute_rows(layer)
            if moved.size:
                self.recompute[layer].append(moved + base - begin)
        # Images that cannot be named were never candidates: not counted as misses.
        self.counters.count(request, scheduled_tokens=end - begin,
                            uncounted=sum(slot.key in unnamed for slot in request.misses))


__all__ = ["ImageKV", "KVWriter", "PendingSave", "RequestImage", "Rotary", "StepPlan", "layer_rows", "splice_image"]
