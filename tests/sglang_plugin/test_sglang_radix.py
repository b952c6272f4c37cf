"""samcache's SGLang radix-cache backend, held to SGLang's own radix-cache contract.

Adapted from SGLang's ``test/registered/unit/mem_cache/test_radix_cache_unit.py`` (insert, match,
splits, extra_key isolation, lock refs, eviction) onto real ``ReqToTokenPool`` /
``MHATokenToKVPool`` / ``TokenToKVPoolAllocator`` on CPU and real ``Req`` lifecycles, plus
samcache's rules: tenant scope, image-last eviction, image identities, CoW branches.
"""

from __future__ import annotations

import contextlib
import random
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("sglang")

from samcache.hashing import Namespace
from samcache.integrations.sglang.radix import (
    Branch,
    ImageLastEviction,
    SamcacheRadixCache,
    assign_image_identity,
    image_key,
    key_from_identity,
    make_radix_cache,
)
from sglang.srt.managers.mm_utils import pad_mm_tokens
from sglang.srt.managers.schedule_batch import (
    FINISH_LENGTH,
    MM_PAD_SHIFT_VALUE,
    MultimodalDataItem,
    MultimodalInputs,
    Req,
)
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import match_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    create_tree_cache,
    get_radix_cache_factory,
    register_radix_cache_backend,
)
from sglang.srt.multimodal.modality import Modality
from sglang.srt.sampling.sampling_params import SamplingParams

MODEL = "sglang|tiny-qwen-vl|test"
IMAGE_TOKEN = 151655  # the placeholder id SGLang pads over


# ---------------------------------------------------------------------------------------------
# fixtures: SGLang's real pools on CPU


class Pools:
    def __init__(self, size: int = 512, rows: int = 16, context: int = 256, page_size: int = 1):
        self.kv = MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.float32, head_num=2, head_dim=4,
                                   layer_num=2, device="cpu", enable_memory_saver=False)
        self.alloc = TokenToKVPoolAllocator(size, torch.float32, "cpu", self.kv, need_sort=False)
        self.rows = ReqToTokenPool(size=rows, max_context_len=context, device="cpu", enable_memory_saver=False)

    def params(self, page_size: int = 1, **kw) -> CacheInitParams:
        return CacheInitParams(disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc,
                               page_size=page_size, **kw)

    def free_slots(self) -> set[int]:
        return set(self.alloc.free_pages.tolist()) | set(self.alloc.release_pages.tolist())

    def write_kv(self, slots: torch.Tensor, fill: float) -> None:
        for layer in range(2):
            self.kv.k_buffer[layer][slots] = fill
            self.kv.v_buffer[layer][slots] = -fill

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.kv.k_buffer[0][slots], self.kv.v_buffer[1][slots]])


@pytest.fixture
def pools():
    return Pools()


def make_cache(pools: Pools, **kw) -> SamcacheRadixCache:
    params = pools.params(eviction_policy=kw.pop("eviction_policy", "lru"))
    return SamcacheRadixCache(params, model_id=kw.pop("model_id", MODEL), **kw)


def key(tokens, extra_key=None, cache_salt=None) -> RadixKey:
    return RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)


def match(cache, tokens, extra_key=None, cache_salt=None):
    return cache.match_prefix(MatchPrefixParams(key=key(tokens, extra_key, cache_salt)))


def matched_indices(cache, tokens, **kw) -> list[int]:
    m = match(cache, tokens, **kw)
    return cache.path_device_indices(m.last_device_node)[: m.device_prefix_len].tolist()


def insert_allocated(cache, pools, tokens, **kw) -> torch.Tensor:
    """Insert ``tokens`` with freshly allocated slots; free the duplicates as SGLang does."""
    slots = pools.alloc.alloc(len(tokens))
    assert slots is not None
    res = cache.insert(InsertParams(key=key(tokens, **kw), value=slots.clone()))
    pools.alloc.free(slots[: res.prefix_len])
    return slots


# A request's life in SGLang's scheduler: match + lock, a row holding the prefix's slots and new
# slots for the rest, KV written, then checkpoint (the tree takes the KV), free, unlock.


def start_request(cache, pools, tokens, rid, *, extra_key=None, cache_salt=None, mm_inputs=None) -> Req:
    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
              sampling_params=SamplingParams(temperature=0, max_new_tokens=1), extra_key=extra_key,
              cache_salt=cache_salt)
    req.multimodal_inputs = mm_inputs
    req.refresh_fill_ids()
    match_kv_cache(req, cache)
    req.lock = cache.lock(req.last_node)
    pools.rows.alloc([req])
    n, p = len(tokens), req.prefix_len
    prefix = cache.prefix_device_indices(req)
    new = pools.alloc.alloc(n - p)
    assert new is not None
    pools.rows.write((req.kv.req_pool_idx, slice(0, n)), torch.cat([prefix, new]).to(torch.int32))
    req.kv.cache_protected_len = p
    req.kv.kv_allocated_len = n
    pools.write_kv(new, float(hash(rid) % 1000))
    return req


def request_slots(pools, req) -> torch.Tensor:
    return pools.rows.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len].to(torch.int64)


def finish_request(cache, pools, req) -> None:
    """What SGLang's release_kv_cache does for a finished request that keeps its KV."""
    up_to = req.kv.kv_allocated_len
    req.finished_reason = FINISH_LENGTH(length=0)
    req.refresh_fill_ids()
    cache.checkpoint(req, up_to=up_to)
    cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, up_to)])
    cache.unlock(req.lock)
    req.lock = None
    pools.rows.free(req)


def image_prompt(pixels, namespace, *, before=5, n_image=8, after=4, seed=0):
    """Token ids with one image (placeholder tokens padded by SGLang) and its multimodal inputs."""
    rng = random.Random(seed)
    ids = [rng.randrange(1, 5000) for _ in range(before)] + [IMAGE_TOKEN] * n_image
    ids += [rng.randrange(1, 5000) for _ in range(after)]
    item = MultimodalDataItem(modality=Modality.IMAGE, offsets=[(before, before + n_image - 1)])
    content_key = assign_image_identity(item, namespace, image=pixels)
    mm = MultimodalInputs(mm_items=[item], im_token_id=IMAGE_TOKEN)
    return list(pad_mm_tokens(array("q", ids), mm)), mm, content_key


def pixels(seed, shape=(28, 28, 3)):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# registration and construction


@contextlib.contextmanager
def published_server(**fields):
    # SGLang's test_utils.published_topology, inlined: that module imports its benchmark suite.
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cpu", **fields)
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    try:
        yield server_args
    finally:
        reset_context()


def build_context(server_args, pools, **kw) -> TreeCacheBuildContext:
    model_config = SimpleNamespace(model_path="tiny-qwen-vl", revision=None, dtype=torch.float32,
                                   hf_config=SimpleNamespace(architectures=["Qwen2_5_VLForConditionalGeneration"]))
    fields = {"server_args": server_args, "params": pools.params(), "is_hybrid_swa": False,
              "is_hybrid_ssm": False, "enable_hierarchical_cache": False, "disable_radix_cache": False,
              "tp_worker": None, "model_config": model_config, "tp_size": 1, "tp_rank": 0, "tp_group": None}
    fields.update(kw)
    return TreeCacheBuildContext(**fields)


def test_sglang_selection_chain_builds_the_backend(pools):
    name = "samcache-radix-test"  # not "samcache": register() of the plugin owns that name
    if get_radix_cache_factory(name) is None:
        register_radix_cache_backend(name, make_radix_cache)
    with published_server(radix_cache_backend=name) as server_args:
        cache = create_tree_cache(build_context(server_args, pools))
    assert isinstance(cache, SamcacheRadixCache) and isinstance(cache, RadixCache)
    assert isinstance(cache.eviction_strategy, ImageLastEviction)
    assert cache.token_to_kv_pool_allocator is pools.alloc and cache.req_to_token_pool is pools.rows
    assert "tiny-qwen-vl" in cache.model_id and "Qwen2_5_VL" in cache.model_id


@pytest.mark.parametrize("flag", ["is_hybrid_swa", "is_hybrid_ssm", "enable_hierarchical_cache"])
def test_factory_refuses_what_needs_the_unified_tree(pools, flag):
    ctx = build_context(SimpleNamespace(kv_cache_dtype="auto"), pools, **{flag: True})
    with pytest.raises(ValueError, match="radix-cache-backend samcache"):
        make_radix_cache(ctx)


def test_factory_honours_disable_radix_cache(pools):
    cache = make_radix_cache(build_context(SimpleNamespace(kv_cache_dtype="auto"), pools, disable_radix_cache=True))
    cache.insert(InsertParams(key=key([1, 2, 3]), value=torch.tensor([7, 8, 9])))
    assert cache.total_size() == 0 and match(cache, [1, 2, 3]).device_prefix_len == 0


def test_bad_arguments_raise_value_errors(pools):
    with pytest.raises(ValueError, match="model_id"):
        SamcacheRadixCache(pools.params(), model_id="")
    with pytest.raises(TypeError, match="tenant_of"):
        SamcacheRadixCache(pools.params(), model_id=MODEL, tenant_of="acme")
    cache = make_cache(pools)
    with pytest.raises(TypeError, match="key"):
        cache.scoped([1, 2, 3])
    with pytest.raises(ValueError, match="n must"):
        cache.fork(key([1]), n=0)
    with pytest.raises(TypeError, match="source"):
        cache.fork([1, 2])
    with pytest.raises(TypeError, match="within"):
        ImageLastEviction(within="lru")


# ---------------------------------------------------------------------------------------------
# SGLang's radix contract, on random shapes


def _reference_match(inserted, query, page_size):
    """Longest cached prefix and its slots: the first insert that covered a position owns it
    (whole pages only: a page is shared when all its tokens agree)."""

    def shared(seq):
        n = 0
        while n < min(len(seq), len(query)) and seq[n] == query[n]:
            n += 1
        return n // page_size * page_size

    lcps = [shared(seq) for seq, _ in inserted]
    best = max(lcps, default=0)
    slots = [next(vals[i] for (_, vals), n in zip(inserted, lcps) if n > i) for i in range(best)]
    return best, slots


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_insert_and_match_random(pools, page_size, seed):
    rng = random.Random(seed)
    cache = SamcacheRadixCache(pools.params(page_size=page_size), model_id=MODEL)
    inserted, next_slot = [], 1
    stems = [[rng.randrange(1, 6) for _ in range(rng.randrange(0, 9))] for _ in range(3)]
    for _ in range(25):
        seq = rng.choice(stems) + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))]
        aligned = len(seq) // page_size * page_size
        if aligned == 0:
            continue
        vals = list(range(next_slot, next_slot + aligned))
        next_slot += aligned
        prior, _ = _reference_match(inserted, seq, page_size)
        res = cache.insert(InsertParams(key=key(seq), value=torch.tensor(vals, dtype=torch.int64)))
        assert res.prefix_len == prior
        inserted.append((seq[:aligned], vals))
        query = rng.choice(stems) + [rng.randrange(1, 6) for _ in range(rng.randrange(0, 12))]
        want_len, want_slots = _reference_match(inserted, query, page_size)
        assert match(cache, query).device_prefix_len == want_len
        assert matched_indices(cache, query) == want_slots
    pages = {tuple(seq[:k]) for seq, _ in inserted for k in range(page_size, len(seq) + 1, page_size)}
    assert cache.total_size() == page_size * len(pages)


def test_splits_keep_slots(pools):
    # SGLang's test_advanced_prefix_match_with_node_splits, on the scoped tree.
    cache = make_cache(pools)
    seq1, seq2 = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 10]
    val1 = insert_allocated(cache, pools, seq1)
    insert_allocated(cache, pools, seq2)
    assert cache.total_size() == 10
    assert matched_indices(cache, [1, 2, 3, 4, 999, 1000]) == val1[:4].tolist()
    assert matched_indices(cache, [1, 2, 3, 4, 5, 6, 777]) == val1[:6].tolist()
    assert matched_indices(cache, seq1) == val1.tolist()
    assert cache.total_size() == 10


def test_extra_key_isolation_is_kept(pools):
    # SGLang's test_extra_key_isolation: the request's extra_key still separates namespaces.
    cache = make_cache(pools)
    slots = {k: insert_allocated(cache, pools, [1, 2, 3], extra_key=k).tolist() for k in ("key1", "key2", None, "")}
    for k, want in slots.items():
        assert matched_indices(cache, [1, 2, 3], extra_key=k) == want
    assert match(cache, [1, 2, 3], extra_key="nonexistent").device_prefix_len == 0
    assert len({tuple(v) for v in slots.values()}) == 4


# ---------------------------------------------------------------------------------------------
# tenant and model scope


def test_other_tenant_never_matches(pools):
    cache = make_cache(pools)
    rng = random.Random(1)
    tokens = [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 40))]
    slots = insert_allocated(cache, pools, tokens, cache_salt="acme")
    assert matched_indices(cache, tokens, cache_salt="acme") == slots.tolist()
    assert match(cache, tokens, cache_salt="globex").device_prefix_len == 0
    assert match(cache, tokens).device_prefix_len == 0  # no tenant is a tenant of its own


def test_tenant_from_extra_key(pools):
    # A deployment that names the tenant in extra_key ("tenant/lora") scopes by its first part.
    cache = make_cache(pools, tenant_of=lambda k: (k.extra_key or "").split("/")[0] or None)
    insert_allocated(cache, pools, [5, 6, 7, 8], extra_key="acme/a")
    assert match(cache, [5, 6, 7, 8], extra_key="acme/a").device_prefix_len == 4
    assert match(cache, [5, 6, 7, 8], extra_key="globex/a").device_prefix_len == 0
    assert cache.namespace_of(key([], "acme/x")).tenant == "acme"


def test_scope_is_injective_and_per_model(pools):
    a, b = make_cache(pools), make_cache(pools, model_id="sglang|other-model")
    keys = [key([1], e, s) for e in (None, "", "x", "x:y") for s in (None, "acme")]
    scoped = [a.scoped(k).extra_key for k in keys]
    assert len(set(scoped)) == len(keys)
    assert all(a.scoped(k).extra_key != b.scoped(k).extra_key for k in keys)
    assert a.scoped(key([1], "lora" + "0" * 28)).extra_key.endswith("lora" + "0" * 28)  # LoRA id tail kept


def test_request_lifecycle_shares_within_tenant_only(pools):
    cache = make_cache(pools)
    tokens = list(range(10, 30))
    a = start_request(cache, pools, tokens, "a", cache_salt="acme")
    finish_request(cache, pools, a)
    b = start_request(cache, pools, tokens + [99], "b", cache_salt="acme")
    assert b.prefix_len == len(tokens)
    c = start_request(cache, pools, tokens, "c", cache_salt="globex")
    assert c.prefix_len == 0
    for r in (b, c):
        finish_request(cache, pools, r)
    assert cache.total_size() == 2 * len(tokens) + 1
    assert pools.alloc.available_size() + cache.total_size() == 512


# ---------------------------------------------------------------------------------------------
# lock refs and eviction


@pytest.mark.parametrize("seed", range(3))
def test_locked_nodes_are_never_evicted(pools, seed):
    rng = random.Random(seed)
    cache = make_cache(pools)
    seqs = [[rng.randrange(1, 4) for _ in range(rng.randrange(2, 16))] for _ in range(12)]
    for s in seqs:
        insert_allocated(cache, pools, s)
    locked = []
    for s in rng.sample(seqs, 4):
        m = match(cache, s)
        locked.append((cache.lock(m.last_device_node), cache.path_device_indices(m.last_device_node)))
    protected = cache.protected_size()
    assert protected == len({i for _, idx in locked for i in idx.tolist()})
    assert cache.evictable_size() + protected == cache.total_size()
    pools.write_kv(torch.cat([idx for _, idx in locked]), 42.0)
    cache.evict(EvictParams(num_tokens=10**6))
    assert cache.total_size() == protected and cache.evictable_size() == 0
    free = pools.free_slots()
    for lock, idx in locked:
        assert not free & set(idx.tolist())
        assert bool((pools.read_kv(idx).abs() == 42.0).all())
    for lock, _ in locked:
        cache.unlock(lock)
    assert cache.protected_size() == 0
    cache.evict(EvictParams(num_tokens=10**6))
    assert cache.total_size() == 0 and pools.alloc.available_size() == 512


def test_text_leaves_are_evicted_before_image_leaves(pools):
    cache = make_cache(pools)
    rng = random.Random(3)
    ns = cache.namespace_of(key([]))
    image_nodes, text_nodes = [], []
    for i in range(6):  # interleaved, images mostly older than text
        ids, _, _ = image_prompt(pixels(i), ns, before=2, n_image=rng.randrange(4, 9), after=2, seed=100 + i)
        ids[0] = 50_000 + i  # distinct first tokens: independent leaves
        insert_allocated(cache, pools, ids)
        image_nodes.append(ids)
        txt = [60_000 + i] + [rng.randrange(1, 5000) for _ in range(rng.randrange(3, 12))]
        insert_allocated(cache, pools, txt)
        text_nodes.append(txt)
    text_total = sum(map(len, text_nodes))
    evicted = cache.evict(EvictParams(num_tokens=text_total)).num_tokens_evicted
    assert evicted == text_total
    assert all(match(cache, t).device_prefix_len == 0 for t in text_nodes)
    assert all(match(cache, t).device_prefix_len == len(t) for t in image_nodes)
    # Within the image class the order is LRU: touch all but image 0, then evict one leaf.
    for t in image_nodes[1:]:
        match(cache, t)
    cache.evict(EvictParams(num_tokens=1))
    assert match(cache, image_nodes[0]).device_prefix_len == 0
    assert all(match(cache, t).device_prefix_len == len(t) for t in image_nodes[1:])


def test_text_tail_after_an_image_goes_first(pools):
    # An older screenshot turn (a leaf ending in image KV) and a newer conversation whose text
    # answer hangs below its image: the answer goes first, although it is the most recent.
    cache = make_cache(pools)
    ns = cache.namespace_of(key([]))
    old_turn, _, _ = image_prompt(pixels(6), ns, before=3, n_image=6, after=0, seed=1)
    insert_allocated(cache, pools, old_turn)
    ids, _, _ = image_prompt(pixels(7), ns, before=3, n_image=6, after=0, seed=2)
    insert_allocated(cache, pools, ids)  # the prompt turn, then its answer below it
    insert_allocated(cache, pools, ids + [11, 12, 13, 14])
    match(cache, ids + [11, 12, 13, 14])  # the conversation is the most recent
    assert cache.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4
    assert match(cache, ids + [11, 12, 13, 14]).device_prefix_len == len(ids)
    assert match(cache, old_turn).device_prefix_len == len(old_turn)
    # Then images in LRU order (matches refresh recency): the old turn before the conversation's.
    match(cache, ids)
    cache.evict(EvictParams(num_tokens=1))
    assert match(cache, old_turn).device_prefix_len == 0 and match(cache, ids).device_prefix_len == len(ids)


def test_within_class_order_follows_the_configured_policy(pools):
    cache = make_cache(pools)
    insert_allocated(cache, pools, [1, 2, 3])
    insert_allocated(cache, pools, [4, 5, 6])
    match(cache, [1, 2, 3])  # LRU: [4, 5, 6] is now older
    cache.evict(EvictParams(num_tokens=1))
    assert match(cache, [1, 2, 3]).device_prefix_len == 3 and match(cache, [4, 5, 6]).device_prefix_len == 0
    mru = make_cache(pools, eviction_policy="mru")
    insert_allocated(mru, pools, [7, 8])
    insert_allocated(mru, pools, [9, 10])
    match(mru, [7, 8])
    mru.evict(EvictParams(num_tokens=1))
    assert match(mru, [7, 8]).device_prefix_len == 0 and match(mru, [9, 10]).device_prefix_len == 2


# ---------------------------------------------------------------------------------------------
# image identity


def test_other_pixels_at_the_same_positions_never_match(pools):
    cache = make_cache(pools)
    ns = cache.namespace_of(key([]))
    img = pixels(11)
    ids_a, mm_a, key_a = image_prompt(img, ns, before=5, n_image=8, after=4)
    changed = img.copy()
    changed[3, 4, 1] ^= 1  # one bit of one pixel
    ids_b, _, key_b = image_prompt(changed, ns, before=5, n_image=8, after=4)
    assert key_a != key_b and ids_a[:5] == ids_b[:5] and ids_a[5:13] != ids_b[5:13]
    req = start_request(cache, pools, ids_a, "a", mm_inputs=mm_a)
    finish_request(cache, pools, req)
    assert match(cache, ids_b).device_prefix_len == 5  # the text before the image only
    assert match(cache, ids_a).device_prefix_len == len(ids_a)
    ids_a2, _, _ = image_prompt(np.ascontiguousarray(img), ns, before=5, n_image=8, after=4)
    assert ids_a2 == ids_a  # same pixels, same tokens


def test_image_identity_is_per_tenant(pools):
    cache = make_cache(pools)
    img = pixels(5)
    ns_a = cache.namespace_of(key([], cache_salt="acme"))
    ns_b = cache.namespace_of(key([], cache_salt="globex"))
    ids_a, _, key_a = image_prompt(img, ns_a)
    ids_b, _, key_b = image_prompt(img, ns_b)
    assert key_a != key_b and ids_a != ids_b
    insert_allocated(cache, pools, ids_a, cache_salt="acme")
    assert match(cache, ids_a, cache_salt="globex").device_prefix_len == 0


def test_nodes_record_the_image_keys_they_hold(pools):
    cache = make_cache(pools)
    ns = cache.namespace_of(key([]))
    ids, mm, content_key = image_prompt(pixels(21), ns, before=4, n_image=8, after=3)
    req = start_request(cache, pools, ids, "r", mm_inputs=mm)
    finish_request(cache, pools, req)
    node = match(cache, ids).last_device_node
    assert cache.image_keys(node) == {content_key}
    # A split inside the image: both halves hold image tokens of the same key.
    m = match(cache, ids[:8])
    assert cache.image_keys(m.last_device_node) == {content_key}
    assert cache.image_keys(match(cache, ids).last_device_node) == {content_key}
    # A split before the image: the text head holds none, the path still does.
    head = match(cache, ids[:3]).last_device_node
    assert cache.image_keys(head) == frozenset()
    assert cache.path_image_keys(match(cache, ids).last_device_node) == {content_key}
    assert key_from_identity(mm.mm_items[0].identity, ns) == content_key
    assert key_from_identity(mm.mm_items[0].identity, Namespace(MODEL, "other")) is None


def test_sglang_hashed_items_get_namespaced_keys(pools):
    # Items SGLang hashed itself (no samcache identity) are keyed by its hash under the namespace.
    item = MultimodalDataItem(modality=Modality.IMAGE, offsets=[(2, 5)])
    item.set_hash(0x1234_5678_9ABC_DEF0)
    a, b = Namespace(MODEL, "acme"), Namespace(MODEL, "globex")
    assert image_key(item, a) == image_key(item, a) != image_key(item, b)
    cache = make_cache(pools)
    ids = list(pad_mm_tokens(array("q", [1, 2] + [IMAGE_TOKEN] * 4 + [3]),
                             MultimodalInputs(mm_items=[item], im_token_id=IMAGE_TOKEN)))
    assert min(ids[2:6]) >= MM_PAD_SHIFT_VALUE
    cache.register_images([item], key([], cache_salt="acme"))
    insert_allocated(cache, pools, ids, cache_salt="acme")
    assert cache.image_keys(match(cache, ids, cache_salt="acme").last_device_node) == {image_key(item, a)}


# ---------------------------------------------------------------------------------------------
# copy-on-write branches


def _agent_prefix(cache, pools, n=24, seed=0):
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 5000) for _ in range(n)]
    req = start_request(cache, pools, tokens, f"plan-{seed}")
    finish_request(cache, pools, req)
    return tokens


def test_fork_shares_the_prefix_by_reference(pools):
    cache = make_cache(pools)
    tokens = _agent_prefix(cache, pools)
    before = pools.alloc.available_size()
    a, b, c = cache.fork(key(tokens + [1, 2, 3]), n=3)  # the uncached tail is not shared
    assert pools.alloc.available_size() == before  # nothing allocated, nothing copied
    assert len(a) == len(tokens) and a.node is b.node is c.node
    assert cache.branch_indices(a).tolist() == cache.branch_indices(b).tolist() == matched_indices(cache, tokens)
    assert a.node.lock_ref == 3 and cache.protected_size() == len(tokens)
    for br in (a, b, c):
        cache.release(br)
    assert cache.protected_size() == 0 and cache.evictable_size() == len(tokens)


def test_branch_suffixes_are_private_and_survive_each_other(pools):
    cache = make_cache(pools)
    rng = random.Random(4)
    tokens = _agent_prefix(cache, pools)
    shared = torch.tensor(matched_indices(cache, tokens))
    pools.write_kv(shared, 7.0)
    a, b = cache.fork(key(tokens))
    suffix_a = [rng.randrange(1, 5000) for _ in range(rng.randrange(3, 20))]
    suffix_b = [rng.randrange(5000, 9000) for _ in range(rng.randrange(3, 20))]
    slots_a, slots_b = pools.alloc.alloc(len(suffix_a)), pools.alloc.alloc(len(suffix_b))
    pools.write_kv(slots_a, 1.0)
    pools.write_kv(slots_b, 2.0)
    idx_a = cache.extend(a, suffix_a, slots_a)
    idx_b = cache.extend(b, suffix_b, slots_b)
    assert idx_a[: len(tokens)].tolist() == idx_b[: len(tokens)].tolist() == shared.tolist()
    assert idx_a[len(tokens):].tolist() == slots_a.tolist() and not set(slots_a.tolist()) & set(slots_b.tolist())
    # Sub-agent A finishes; everything evictable goes.
    cache.release(a)
    cache.evict(EvictParams(num_tokens=10**6))
    free = pools.free_slots()
    assert set(slots_a.tolist()) <= free  # A's private suffix is back in the pool
    assert not free & set(idx_b.tolist())  # nothing B uses is
    # Reuse every free slot: B's KV is untouched.
    grabbed = pools.alloc.alloc(pools.alloc.available_size())
    pools.write_kv(grabbed, -99.0)
    assert bool((pools.read_kv(shared).abs() == 7.0).all()) and bool((pools.read_kv(slots_b).abs() == 2.0).all())
    assert cache.branch_indices(b).tolist() == idx_b.tolist()
    pools.alloc.free(grabbed)
    cache.release(b)
    cache.evict(EvictParams(num_tokens=10**6))
    assert cache.total_size() == 0 and pools.alloc.available_size() == 512


def test_same_suffix_in_two_branches_is_stored_once(pools):
    cache = make_cache(pools)
    tokens = _agent_prefix(cache, pools, n=8)
    a, b = cache.fork(key(tokens))
    s1, s2 = pools.alloc.alloc(4), pools.alloc.alloc(4)
    idx_a = cache.extend(a, [1, 2, 3, 4], s1)
    free_before = pools.alloc.available_size()
    idx_b = cache.extend(b, [1, 2, 3, 4], s2)
    assert idx_a.tolist() == idx_b.tolist()  # B now points at A's slots
    assert pools.alloc.available_size() == free_before + 4 and set(s2.tolist()) <= pools.free_slots()
    assert a.node is b.node and a.node.lock_ref == 2
    cache.release(a)
    cache.evict(EvictParams(num_tokens=10**6))
    assert cache.branch_indices(b).tolist() == idx_b.tolist() and not pools.free_slots() & set(idx_b.tolist())
    cache.release(b)


def test_nested_forks_and_release_errors(pools):
    cache = make_cache(pools)
    tokens = _agent_prefix(cache, pools, n=6)
    (parent,) = cache.fork(key(tokens), n=1)
    cache.extend(parent, [9, 9], pools.alloc.alloc(2))
    kids = cache.fork(parent, n=2)
    assert all(k.node is parent.node and len(k) == 8 for k in kids)
    cache.release(parent)
    cache.evict(EvictParams(num_tokens=10**6))
    assert match(cache, tokens + [9, 9]).device_prefix_len == 8  # the kids still hold it
    for k in kids:
        cache.release(k)
    with pytest.raises(ValueError, match="already released"):
        cache.release(kids[0])
    with pytest.raises(ValueError, match="already released"):
        cache.fork(kids[0])
    with pytest.raises(ValueError, match="already released"):
        cache.extend(kids[0], [1], torch.tensor([1]))
    (br,) = cache.fork(key(tokens), n=1)
    with pytest.raises(ValueError, match="kv_indices"):
        cache.extend(br, [1, 2], torch.tensor([5]))
    cache.release(br)
    assert isinstance(br, Branch) and cache.protected_size() == 0


def test_finishing_one_request_never_frees_what_a_running_one_uses(pools):
    # The same guarantee through SGLang's request path: two sub-agent requests share a prefix.
    cache = make_cache(pools)
    tokens = _agent_prefix(cache, pools, n=16)
    a = start_request(cache, pools, tokens + [1, 2, 3], "sub-a")
    b = start_request(cache, pools, tokens + [4, 5, 6, 7], "sub-b")
    assert a.prefix_len == b.prefix_len == 16
    b_slots = request_slots(pools, b)
    b_kv = pools.read_kv(b_slots).clone()
    finish_request(cache, pools, a)
    cache.evict(EvictParams(num_tokens=10**6))
    assert not pools.free_slots() & set(b_slots.tolist())
    grabbed = pools.alloc.alloc(pools.alloc.available_size())
    pools.write_kv(grabbed, -5.0)
    assert torch.equal(pools.read_kv(b_slots), b_kv)
    pools.alloc.free(grabbed)
    finish_request(cache, pools, b)
    assert match(cache, tokens + [4, 5, 6, 7]).device_prefix_len == 20


def test_checkpoint_of_a_running_request(pools):
    # SGLang's cache_unfinished_req, now checkpoint(): a chunk is cached while the request runs.
    cache = make_cache(pools)
    tokens = list(range(100, 140))
    req = start_request(cache, pools, tokens, "chunked", cache_salt="acme")
    req.refresh_fill_ids()
    cache.checkpoint(req, up_to=20)
    assert req.kv.cache_protected_len == 20 and match(cache, tokens, cache_salt="acme").device_prefix_len == 20
    assert cache.protected_size() == 20  # the running request holds its chunk
    cache.evict(EvictParams(num_tokens=10**6))
    assert match(cache, tokens, cache_salt="acme").device_prefix_len == 20
    finish_request(cache, pools, req)
    assert match(cache, tokens, cache_salt="acme").device_prefix_len == 40
    assert pools.alloc.available_size() + cache.total_size() == 512


def test_approximate_kv_enters_the_tree_only_up_to_the_exact_tokens(pools):
    """A request the model override marked (a splice left its KV approximate from token 12 on): the
    tree keeps its first 12 tokens only; the rest goes back to the pool. An identical re-send then
    matches those 12 and computes the rest, whose exact KV the tree takes in their place."""
    from samcache.integrations.sglang.exactness import exact_tokens, mark

    cache = make_cache(pools)
    tokens = list(range(300, 340))
    first = start_request(cache, pools, tokens, "spliced")
    spliced_slots = request_slots(pools, first)
    mark(first, 20)
    mark(first, 12)  # a later chunk's splice: the smaller bound holds
    assert exact_tokens(first) == 12
    first.refresh_fill_ids()
    cache.checkpoint(first, up_to=30)  # a running request's chunk, checkpointed
    assert first.kv.cache_protected_len == 12 and match(cache, tokens).device_prefix_len == 12
    finish_request(cache, pools, first)
    assert match(cache, tokens).device_prefix_len == 12
    assert matched_indices(cache, tokens) == spliced_slots[:12].tolist()
    assert pools.alloc.available_size() + cache.total_size() == 512  # the approximate slots went back
    again = start_request(cache, pools, tokens, "re-send")  # not marked: computed exactly
    assert again.prefix_len == 12
    fresh = request_slots(pools, again)[12:].tolist()
    finish_request(cache, pools, again)
    assert match(cache, tokens).device_prefix_len == 40
    assert matched_indices(cache, tokens)[12:] == fresh  # the tree holds the re-send's exact KV
    assert pools.alloc.available_size() + cache.total_size() == 512


def test_an_unmarked_request_enters_the_tree_whole_and_marks_are_checked(pools):
    from samcache.integrations.sglang.exactness import mark

    cache = make_cache(pools)
    tokens = list(range(400, 424))
    req = start_request(cache, pools, tokens, "exact")
    finish_request(cache, pools, req)
    assert match(cache, tokens).device_prefix_len == 24
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="exact_tokens must be an int >= 0"):
            mark(req, bad)
