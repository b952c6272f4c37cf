"""Approximate KV kept out of SGLang's prefix tree.

A spliced image's KV (recompute below 1) is approximate, and so is the KV of every token after
it; SGLang's tree would serve it to a later identical prompt as if a full prefill had computed
it. The model override marks each request whose step left its KV approximate with the number of
leading tokens that are still exact (:func:`mark`, on SGLang's ``Req``: it lives as long as the
request); samcache's radix tree inserts a marked request only up to there (the page-aligned
exact prefix), so an identical re-send computes (or splices again) the rest. A tree that is not
samcache's cannot be told: with one, the override splices nothing (:func:`tree_keeps_approximate_out`).
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "samcache"  # --radix-cache-backend samcache
EXACT_TOKENS = "samcache_exact_tokens"  # attribute of SGLang's Req: its leading exact tokens


def mark(req: Any, exact_tokens: int) -> None:
    """Note that ``req``'s KV is exact only for its first ``exact_tokens`` tokens (a request marked
    twice, e.g. by two chunks, keeps the smaller)."""
    if isinstance(exact_tokens, bool) or not isinstance(exact_tokens, int) or exact_tokens < 0:
        raise ValueError(f"exact_tokens must be an int >= 0, got {exact_tokens!r}")
    known = getattr(req, EXACT_TOKENS, None)
    setattr(req, EXACT_TOKENS, exact_tokens if known is None else min(known, exact_tokens))


def exact_tokens(req: Any) -> int | None:
    """The leading tokens of ``req`` whose KV is exact; None: all of them (never marked)."""
    return getattr(req, EXACT_TOKENS, None)


def mark_batch(forward_batch: Any, approximate: dict[int, int]) -> None:
    """Mark the requests of ``forward_batch`` (by batch index) whose step left KV approximate. The
    plugin's batch hook gives the batch its requests (``samcache_reqs``)."""
    if not approximate:
        return
    reqs = getattr(forward_batch, "samcache_reqs", None)
    if reqs is None:
        if _server_tree() in (None, "disabled"):
            return  # no prefix tree to keep it out of
        raise RuntimeError("samcache: this forward batch does not carry its requests (the plugin's ForwardBatch "
                           "hook did not run), so approximate KV could not be kept out of the prefix tree")
    for b, exact in approximate.items():
        mark(reqs[b], int(exact))


def tree_keeps_approximate_out() -> bool | None:
    """Whether this SGLang server's prefix cache keeps approximate KV out: True without a radix
    cache or with samcache's (``--radix-cache-backend samcache``), False with any other tree
    (SGLang's default, HiCache's); None outside a server (tools and tests build their own)."""
    tree = _server_tree()
    return None if tree is None else tree in ("disabled", BACKEND_NAME)


def _server_tree() -> str | None:
    """This server's prefix tree: ``"disabled"``, the registered backend's name, ``"default"``
    (SGLang's own choice), or None outside a server."""
    try:
        from sglang.srt.runtime_context import get_memory

        memory = get_memory()
        disabled, backend = memory.disable_radix_cache, memory.radix_cache_backend
    except Exception:  # noqa: BLE001 - no server context
        return None
    return "disabled" if disabled else (backend or "default")


__all__ = ["EXACT_TOKENS", "exact_tokens", "mark", "mark_batch", "tree_keeps_approximate_out"]
