"""samcache's radix-cache backend for SGLang (``--radix-cache-backend samcache``).

SGLang's own prefix tree (:class:`sglang.srt.mem_cache.radix_cache.RadixCache`), with three
samcache rules on top:

- **Scope.** Every tree key lives in a samcache :class:`~samcache.hashing.Namespace` (model
  fingerprint + tenant): the request's ``extra_key`` is rewritten to carry the namespace digest,
  so a prefix of one tenant or model never matches another's. The tenant is SGLang's per-request
  ``cache_salt`` unless a ``tenant_of`` callable says otherwise.
- **Image identity.** SGLang writes per-image pad values over the image tokens; a pad value is a
  function of the image's identity. :func:`assign_image_identity` makes that identity a samcache
  content key (model + tenant + pixels), so other pixels mean other tokens and no match. Each tree
  node records the content keys of the images its tokens hold (:meth:`SamcacheRadixCache.image_keys`),
  for the model override to look up.
- **Priorities.** :class:`ImageLastEviction` evicts plain-text leaves before leaves holding image
  KV (images are the expensive part to recompute), in SGLang's configured order (LRU by default)
  within each class.
- **Copy-on-write forks.** :meth:`SamcacheRadixCache.fork` hands sub-agents the common prefix's KV
  slots by reference, each branch pinning it with SGLang's ``lock_ref``; :meth:`~SamcacheRadixCache.extend`
  adds a branch's private suffix; releasing or evicting one branch never frees KV another uses.

:func:`make_radix_cache` is the factory for ``register_radix_cache_backend``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import MM_PAD_SHIFT_VALUE
from sglang.srt.mem_cache.base_prefix_cache import (
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from samcache.hashing import ContentKey, Namespace, hash_bytes, hash_image
from samcache.integrations.sglang.exactness import BACKEND_NAME, exact_tokens
from samcache.integrations.sglang.identity import server_model_id

_SCOPE_PREFIX = "samcache:"  # scoped extra_key: "samcache:<namespace hex>[:<request extra_key>]"
_NS_HEX_LEN = 32
_IDENTITY_TAG = b"samcache/sglang-identity/v1\0"
_SGLANG_ITEM_TAG = b"samcache/sglang-item/v1\0"
# Pads remembered for image lookups (4 pads per image): bounded so a long-running server does not
# grow without limit; a forgotten pad only loses the key lookup, never correctness (the tree
# matches on the pad tokens themselves).
_MAX_REMEMBERED_PADS = 1 << 18

TenantOf = Callable[[RadixKey], "str | bytes | None"]


def salt_tenant(key: RadixKey) -> str | None:
    """Default tenant of a tree key: SGLang's per-request ``cache_salt`` (None: no tenant)."""
    return key.cache_salt


# ---------------------------------------------------------------------------------------------
# image identity


def _identity_check(key: ContentKey, namespace: Namespace) -> bytes:
    # Second half of a samcache identity: ties the key to the namespace it was made in, so a
    # scheduler can tell samcache identities from SGLang's own and from another tenant's.
    return hashlib.blake2b(_IDENTITY_TAG + namespace.digest + key.digest, digest_size=16).digest()


def identity_bytes(key: ContentKey, namespace: Namespace) -> bytes:
    """The 32-byte SGLang item identity of the image whose samcache key is ``key``."""
    if not isinstance(key, ContentKey):
        raise TypeError(f"key must be a ContentKey, got {type(key).__name__}")
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    return key.digest + _identity_check(key, namespace)


def key_from_identity(identity: bytes | None, namespace: Namespace) -> ContentKey | None:
    """The samcache key inside ``identity`` when samcache made it for ``namespace``; else None."""
    if not isinstance(identity, (bytes, bytearray)) or len(identity) != 32:
        return None
    key = ContentKey(bytes(identity[:16]))
    return key if bytes(identity[16:]) == _identity_check(key, namespace) else None


def image_key(item: Any, namespace: Namespace) -> ContentKey:
    """samcache content key of SGLang multimodal item ``item`` under ``namespace``.

    A samcache identity (:func:`assign_image_identity`) gives its key back; any other item is
    keyed by SGLang's own item hash (a hash of its preprocessed pixels) under the namespace.
    """
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    key = key_from_identity(getattr(item, "identity", None), namespace)
    if key is not None:
        return key
    identity = getattr(item, "identity", None)
    if identity is None:
        if getattr(item, "hash", None) is None:
            item.set_pad_value()  # SGLang hashes the item's features here
        identity = int(item.hash).to_bytes(8, "big")
    return namespace.key(hash_bytes(_SGLANG_ITEM_TAG + bytes(identity)))


def assign_image_identity(item: Any, namespace: Namespace, image: Any = None) -> ContentKey:
    """Make SGLang item ``item``'s identity (hence its pad values) samcache's content key.

    ``image`` is the decoded image (PIL, numpy, tensor or path) when at hand: the key is then a
    hash of its pixels; without it, of SGLang's item hash. Either way under ``namespace``, so the
    same pixels of another model or tenant become other pad tokens. Returns the key.
    """
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    if image is not None:
        key = namespace.key(hash_image(image))
    else:
        key = image_key(item, namespace)
    item.set_identity(identity_bytes(key, namespace))
    return key


def _tokens(node_key: RadixKey) -> np.ndarray:
    raw = node_key.raw_token_ids()
    if isinstance(raw, array) and raw.typecode == "q":
        return np.frombuffer(raw, dtype=np.int64) if len(raw) else np.zeros(0, np.int64)
    return np.asarray(list(raw), dtype=np.int64)


def holds_image(node: TreeNode, pad_floor: int = MM_PAD_SHIFT_VALUE) -> bool:
    """Whether ``node``'s own tokens include image pad tokens (recorded at insert, else scanned)."""
    n = getattr(node, "samcache_image_tokens", None)
    if n is None:
        if node.key is None or len(node.key) == 0:
            return False
        n = int((_tokens(node.key) >= pad_floor).sum())
    return n > 0


# ---------------------------------------------------------------------------------------------
# eviction order


class ImageLastEviction(EvictionStrategy):
    """Evict plain-text leaves before leaves holding image KV; ``within`` orders each class
    (SGLang's configured strategy, LRU by default). Smaller priorities are evicted first."""

    def __init__(self, within: EvictionStrategy | None = None, pad_floor: int = MM_PAD_SHIFT_VALUE) -> None:
        if within is not None and not isinstance(within, EvictionStrategy):
            raise TypeError(f"within must be an SGLang EvictionStrategy, got {type(within).__name__}")
        if not isinstance(pad_floor, int) or pad_floor <= 0:
            raise ValueError(f"pad_floor must be a positive int, got {pad_floor!r}")
        self.within = within
        self.pad_floor = pad_floor

    def get_priority(self, node: TreeNode) -> tuple:
        order = node.last_access_time if self.within is None else self.within.get_priority(node)
        return (1 if holds_image(node, self.pad_floor) else 0, order)


# ---------------------------------------------------------------------------------------------
# branches


@dataclass(eq=False)
class Branch:
    """One line of an agent's plan: the cached context ``key`` ends at tree node ``node``, which
    the branch keeps locked (SGLang's ``lock_ref``) until :meth:`SamcacheRadixCache.release`."""

    key: RadixKey  # unscoped, as the caller names it
    node: TreeNode
    lock: TreeLock | None

    @property
    def released(self) -> bool:
        return self.lock is None

    def __len__(self) -> int:
        return len(self.key)


# ---------------------------------------------------------------------------------------------
# the cache


class SamcacheRadixCache(RadixCache):
    """SGLang's radix cache with samcache's scope, image-aware eviction and CoW branches."""

    def __init__(
        self,
        params: CacheInitParams,
        *,
        model_id: str,
        tenant_of: TenantOf | None = None,
        pad_floor: int = MM_PAD_SHIFT_VALUE,
    ) -> None:
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
        if tenant_of is not None and not callable(tenant_of):
            raise TypeError(f"tenant_of must be callable, got {type(tenant_of).__name__}")
        if not isinstance(pad_floor, int) or pad_floor <= 0:
            raise ValueError(f"pad_floor must be a positive int, got {pad_floor!r}")
        self.model_id = model_id
        self.tenant_of = tenant_of or salt_tenant
        self.pad_floor = pad_floor
        self._namespaces: dict[Any, tuple[Namespace, str]] = {}  # tenant -> (namespace, scope)
        self._pad_keys: OrderedDict[tuple[str, int], ContentKey] = OrderedDict()
        super().__init__(params)
        if not self.disable:
            # The configured policy (--radix-eviction-policy) still orders each class.
            self.eviction_strategy = ImageLastEviction(self.eviction_strategy, pad_floor)

    # -- scope ------------------------------------------------------------------------------

    def namespace_of(self, key: RadixKey) -> Namespace:
        """samcache namespace of a tree key: this model plus the key's tenant."""
        return self._scope(key)[0]

    def _scope(self, key: RadixKey) -> tuple[Namespace, str]:
        tenant = self.tenant_of(key)
        scope = self._namespaces.get(tenant)
        if scope is None:
            ns = Namespace(self.model_id, tenant)
            scope = self._namespaces[tenant] = (ns, _SCOPE_PREFIX + ns.digest.hex())
        return scope

    def scoped(self, key: RadixKey) -> RadixKey:
        """``key`` as the tree stores it: its ``extra_key`` carries the namespace digest.

        Injective: the hex digest has a fixed length, and the request's own extra_key follows a
        separator (None and "" stay distinct). Keeps the extra_key's tail, where SGLang's KV
        events look for the LoRA id.
        """
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        scope = self._scope(key)[1]
        extra = scope if key.extra_key is None else f"{scope}:{key.extra_key}"
        return RadixKey(key.token_ids, extra, is_bigram=key.is_bigram, limit=key.limit, cache_salt=key.cache_salt)

    @staticmethod
    def _scope_hex(scoped_key: RadixKey) -> str:
        extra = scoped_key.extra_key or ""
        return extra[len(_SCOPE_PREFIX) : len(_SCOPE_PREFIX) + _NS_HEX_LEN]

    # -- the tree's public entry points: every key is scoped once, here ----------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        if params.req is not None:
            self.register_request_images(params.req)
        return super().match_prefix(dataclasses.replace(params, key=self.scoped(params.key)))

    def touch_prefix(self, key: RadixKey) -> None:
        super().touch_prefix(self.scoped(key))

    def insert(self, params: InsertParams) -> InsertResult:
        if params.key is None:
            raise ValueError("InsertParams.key must be a RadixKey, got None")
        result = super().insert(dataclasses.replace(params, key=self.scoped(params.key)))
        self._annotate_path(result.last_device_node)
        return result

    def _insert_cache(self, req, token_ids, *, key_limit=None, **kwargs):
        # checkpoint() inserts a running/finished request here: learn its images first, so the
        # nodes it creates record their content keys.
        self.register_request_images(req)
        exact = exact_tokens(req)
        if exact is not None:  # spliced KV from there on: only the exact pages enter the tree
            limit = max(exact // self.page_size * self.page_size, req.kv.cache_protected_len)
            key_limit = limit if key_limit is None else min(key_limit, limit)
        return super()._insert_cache(req, token_ids, key_limit=key_limit, **kwargs)

    # -- image records ------------------------------------------------------------------------

    def register_images(self, items: Iterable[Any], key: RadixKey) -> list[ContentKey]:
        """Remember the content keys of SGLang multimodal ``items`` (already padded) of a request
        whose tree key is ``key``; nodes inserted later record them. Returns the keys."""
        ns = self.namespace_of(key)
        scope = ns.digest.hex()
        keys = []
        for item in items:
            if getattr(item, "pad_value", None) is None:
                continue  # not padded yet: its tokens are still the placeholder id
            ck = image_key(item, ns)
            keys.append(ck)
            for pad in item.padding_values():
                self._pad_keys[(scope, int(pad))] = ck
                self._pad_keys.move_to_end((scope, int(pad)))
        while len(self._pad_keys) > _MAX_REMEMBERED_PADS:
            self._pad_keys.popitem(last=False)
        return keys

    def register_request_images(self, req: Any) -> list[ContentKey]:
        """:meth:`register_images` for an SGLang ``Req``'s multimodal inputs."""
        mm = getattr(req, "multimodal_inputs", None)
        if mm is None or not getattr(mm, "mm_items", None):
            return []
        return self.register_images(mm.mm_items, RadixKey(array("q"), req.extra_key, cache_salt=req.cache_salt))

    def image_keys(self, node: TreeNode) -> frozenset[ContentKey]:
        """Content keys of the images whose tokens ``node`` itself holds."""
        pads = getattr(node, "samcache_pad_keys", None)
        if pads is None:
            self._annotate(node)
            pads = node.samcache_pad_keys
        elif None in pads.values():
            # An image registered after this node was cached: look its pads up again.
            scope = self._scope_hex(node.key)
            for pad, ck in pads.items():
                if ck is None:
                    pads[pad] = self._pad_keys.get((scope, pad))
        return frozenset(k for k in pads.values() if k is not None)

    def path_image_keys(self, node: TreeNode) -> frozenset[ContentKey]:
        """Content keys of every image on the path from the root to ``node``."""
        keys: set[ContentKey] = set()
        while node is not None and node is not self.root_node:
            keys |= self.image_keys(node)
            node = node.parent
        return frozenset(keys)

    def _annotate(self, node: TreeNode, known: dict[int, ContentKey | None] | None = None) -> None:
        tokens = _tokens(node.key) if node.key is not None else np.zeros(0, np.int64)
        image = tokens[tokens >= self.pad_floor]
        scope = self._scope_hex(node.key) if node.key is not None else ""
        pads: dict[int, ContentKey | None] = {}
        for pad in np.unique(image).tolist():
            ck = known.get(pad) if known else None
            pads[pad] = ck if ck is not None else self._pad_keys.get((scope, pad))
        node.samcache_pad_keys = pads
        node.samcache_image_tokens = int(image.size)

    def _annotate_path(self, node: TreeNode | None) -> None:
        # Insert creates at most one node (the new leaf); splits annotate themselves.
        while node is not None and node is not self.root_node and not hasattr(node, "samcache_pad_keys"):
            self._annotate(node)
            node = node.parent

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        known = getattr(child, "samcache_pad_keys", None)
        new_node = super()._split_node(key, child, split_len)
        self._annotate(new_node, known)
        self._annotate(child, known)
        return new_node

    # -- copy-on-write branches ---------------------------------------------------------------

    def fork(self, source: RadixKey | Branch, n: int = 2) -> list[Branch]:
        """``n`` branches sharing ``source``'s cached KV by reference.

        ``source`` is a context (a RadixKey: its longest cached prefix is shared) or a live
        branch (nested sub-agents). Nothing is copied: every branch points at the same tree node
        and takes its own lock on it, so the shared KV stays until the last branch lets go.
        """
        if self.disable:
            raise ValueError("fork needs an enabled radix cache (this one is disabled)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if isinstance(source, Branch):
            if source.released:
                raise ValueError("source branch was already released")
            key, node = source.key, source.node
        elif isinstance(source, RadixKey):
            match = self.match_prefix(MatchPrefixParams(key=source))
            key, node = source[: match.device_prefix_len], match.last_device_node
        else:
            raise TypeError(f"source must be a RadixKey or a Branch, got {type(source).__name__}")
        return [Branch(key=key, node=node, lock=self.lock(node)) for _ in range(n)]

    def branch_indices(self, branch: Branch) -> torch.Tensor:
        """KV slots of ``branch``'s whole context (shared prefix first)."""
        if branch.released:
            raise ValueError("branch was already released")
        return self.path_device_indices(branch.node)

    def extend(self, branch: Branch, token_ids: Iterable[int], kv_indices: torch.Tensor) -> torch.Tensor:
        """Append ``branch``'s private suffix (``token_ids``, whose KV the caller wrote at the
        freshly allocated slots ``kv_indices``) and move the branch's lock to its new end.

        Slots whose tokens the tree already held (another branch cached the same suffix) are
        duplicates: they go back to the allocator and the tree's copies are used. Returns the
        branch's KV slots from now on (:meth:`branch_indices`).
        """
        if branch.released:
            raise ValueError("branch was already released")
        suffix = array("q", token_ids)
        if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() != 1 or kv_indices.numel() != len(suffix):
            raise ValueError(f"kv_indices must be a 1-D tensor of {len(suffix)} slots (one per token)")
        start = len(branch.key)
        if (start + len(suffix)) % self.page_size:
            raise ValueError(f"token_ids must keep the branch page-aligned (page_size={self.page_size})")
        if not suffix:
            return self.branch_indices(branch)
        tokens = array("q", branch.key.raw_token_ids()) + suffix
        key = RadixKey(tokens, branch.key.extra_key, cache_salt=branch.key.cache_salt)
        prefix = self.path_device_indices(branch.node).to(torch.int64)
        value = torch.cat([prefix, kv_indices.to(device=prefix.device, dtype=torch.int64)])
        result = self.insert(InsertParams(key=key, value=value))
        if result.prefix_len > start:
            self.token_to_kv_pool_allocator.free_segment(value[start : result.prefix_len], start_pos=start)
        old = branch.lock
        branch.key, branch.node = key, result.last_device_node
        branch.lock = self.lock(branch.node)  # lock the new end before unlocking the old one
        self.unlock(old)
        return self.path_device_indices(branch.node)

    def release(self, branch: Branch) -> None:
        """Unpin ``branch``: its private KV becomes evictable; KV other branches lock stays."""
        if not isinstance(branch, Branch):
            raise TypeError(f"branch must be a Branch, got {type(branch).__name__}")
        if branch.released:
            raise ValueError("branch was already released")
        lock, branch.lock = branch.lock, None
        self.unlock(lock)


# ---------------------------------------------------------------------------------------------
# factory


def make_radix_cache(ctx: Any) -> SamcacheRadixCache:
    """SGLang radix-cache factory (``register_radix_cache_backend(BACKEND_NAME, make_radix_cache)``).

    Builds the tree from ``ctx.params`` (SGLang's ``CacheInitParams``: pools, page size, eviction
    policy, events) as SGLang's default chain does for a full-attention model. Hybrid SWA/Mamba
    models and HiCache need SGLang's UnifiedRadixCache and are refused.
    """
    unsupported = [
        flag
        for flag, on in (
            ("a hybrid sliding-window model", getattr(ctx, "is_hybrid_swa", False)),
            ("a hybrid SSM (Mamba) model", getattr(ctx, "is_hybrid_ssm", False)),
            ("--enable-hierarchical-cache", getattr(ctx, "enable_hierarchical_cache", False)),
            ("a DSA model", getattr(ctx, "is_dsa", False)),
        )
        if on
    ]
    if unsupported:
        raise ValueError(
            f"--radix-cache-backend {BACKEND_NAME} supports full-attention models without HiCache; "
            f"this server has {', '.join(unsupported)}"
        )
    params = ctx.params
    if getattr(ctx, "disable_radix_cache", False):
        params.disable = True
    return SamcacheRadixCache(params, model_id=server_model_id(ctx))
