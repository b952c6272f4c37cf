"""samcache's HiCache storage backend held to SGLang's contract, on SGLang's real classes.

Runs where SGLang is installed (`.venv-sglang`); elsewhere it skips. The pages come from SGLang's
own host pool (`MHATokenToKVPoolHost` over a real `MHATokenToKVPool` on CPU) in every host
layout SGLang writes to storage, and the backend is built by SGLang's own `dynamic` factory.
The checks follow SGLang's storage unit tests (exists before and after a batch set, batch get
into page buffers, prefix counts for partial key lists) and add what samcache promises: every
read lands in a buffer poisoned first, eviction under the byte bound only ever loses pages,
and no other model, rank, layout, tenant or page geometry can read a page.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

# PyPI's torchvision is a CUDA build whose ops fail to register on CPU torch; SGLang imports it
# for pure-Python parts only, so empty registration modules let it import.
for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))

pytest.importorskip("sglang")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from samcache.hashing import Namespace, hash_bytes  # noqa: E402
from samcache.integrations.sglang import hicache  # noqa: E402
from samcache.integrations.sglang.hicache import (  # noqa: E402
    SamcacheHiCacheStorage,
    SharedTensorStore,
    reset_shared_store,
    shared_store,
)

PAGE = 4  # tokens a page
LAYERS, HEADS, HEAD_DIM = 3, 2, 8
DTYPE = torch.bfloat16
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * DTYPE.itemsize  # K and V of every layer
EXTRA = {
    "backend_name": "samcache",
    "module_path": "samcache.integrations.sglang.hicache",
    "class_name": "SamcacheHiCacheStorage",
}
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def config(extra: dict | None = None, **fields) -> HiCacheStorageConfig:
    base = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="Qwen/Qwen3-VL-2B",
    )
    base.update(fields)
    return HiCacheStorageConfig(**base, extra_config={**EXTRA, **(extra or {})})


def host_pool(layout: str, seed: int = 0) -> MHATokenToKVPoolHost:
    """SGLang's host pool over its device pool, on CPU, filled with random KV."""
    device = MHATokenToKVPool(
        size=64, page_size=PAGE, dtype=DTYPE, head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False,
    )
    host = MHATokenToKVPoolHost(
        device._mha_buffer_info(), host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=64, start_layer=0, end_layer=LAYERS,
    )
    gen = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(DTYPE))
    return host


def pages(host, offsets) -> list[torch.Tensor]:
    return [host.get_data_page(o, flat=True).clone() for o in offsets]


def indices(offsets) -> torch.Tensor:
    return torch.cat([torch.arange(o, o + PAGE) for o in offsets])


def poison(host) -> None:
    host.kv_buffer.fill_(float("nan"))


def poisoned(n: int = PAGE_BYTES // DTYPE.itemsize) -> torch.Tensor:
    return torch.full((n,), float("nan"), dtype=DTYPE)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (NaN-safe, unlike torch.equal)."""
    return a.dtype == b.dtype and a.numel() == b.numel() and bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(
        b.contiguous().view(torch.uint8).numpy()
    )


@pytest.fixture
def store():
    return SharedTensorStore("test", 1 << 20)


@pytest.fixture
def fresh_shared():
    reset_shared_store()
    yield
    reset_shared_store()


def backend(store, extra=None, pool=None, **fields) -> SamcacheHiCacheStorage:
    b = SamcacheHiCacheStorage(config(extra, **fields), {"store": store})
    if pool is not None:
        b.register_mem_pool_host(pool)
    return b


# ---- construction through SGLang's own factory ------------------------------------------------


def test_dynamic_factory_builds_the_backend_on_the_shared_store(fresh_shared):
    b = StorageBackendFactory.create_backend("dynamic", config({"capacity_bytes": 1 << 20, "tenant": "acme"}), None)
    assert isinstance(b, SamcacheHiCacheStorage) and isinstance(b, HiCacheStorage)
    assert b.store is shared_store() and b.store.index.capacity_bytes == 1 << 20
    assert b.tenant == "acme"
    # A second backend in the process shares the store; naming another capacity is refused.
    again = StorageBackendFactory.create_backend("dynamic", config(), None)
    assert again.store is b.store
    with pytest.raises(ValueError, match="capacity_bytes"):
        StorageBackendFactory.create_backend("dynamic", config({"capacity_bytes": 1 << 21}), None)


def test_default_capacity_when_none_is_configured(fresh_shared):
    b = StorageBackendFactory.create_backend("dynamic", config(), None)
    assert b.store.index.capacity_bytes == hicache.DEFAULT_CAPACITY_BYTES


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": "8GB"}, "capacity_bytes"),
        ({"capacity_bytes": True}, "capacity_bytes"),
        ({"capacity_bytes": 1.5}, "capacity_bytes"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": 7}, "tenant"),
    ],
)
def test_bad_extra_config_names_the_key(fresh_shared, extra, key):
    with pytest.raises(ValueError, match=key):
        StorageBackendFactory.create_backend("dynamic", config(extra), None)


def test_head_splitting_is_refused(store):
    with pytest.raises(ValueError, match="tp_lcm_size"):
        backend(store, should_split_heads=True)


# ---- the tensor API (SGLang's default path: batch_get / batch_set on flat pages) --------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_set_get_exists_round_trip(store, layout):
    host = host_pool(layout)
    b = backend(store, pool=host)
    keys = [f"page-{i:02d}" for i in range(6)]
    values = pages(host, [i * PAGE for i in range(6)])

    assert b.batch_exists(keys) == 0
    assert b.batch_set(keys, values)
    assert b.batch_exists(keys) == len(keys)
    assert b.batch_exists(keys[:3] + ["absent"] + keys[3:]) == 3  # a prefix count, not a total
    assert all(b.exists(k) for k in keys) and not b.exists("absent")

    targets = [poisoned() for _ in keys]
    got = b.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets))  # read into the caller's buffers
    assert all(same(g, v) for g, v in zip(got, values))
    # Writes are copies: the host pool reusing its slots changes nothing stored.
    poison(host)
    assert same(b.get(keys[0], poisoned()), values[0])


def test_missing_keys_are_misses_and_leave_buffers_alone(store):
    b = backend(store, pool=host_pool("layer_first"))
    target = poisoned()
    assert b.get("never-stored", target) is None
    assert torch.isnan(target.float()).all()
    assert b.batch_get(["a", "b"], [poisoned(), poisoned()]) == [None, None]
    assert b.batch_exists(["a"]) == 0 and b.batch_exists([]) == 0


def test_get_without_target_reads_into_a_pool_page(store):
    host = host_pool("page_first")
    b = backend(store, pool=host)
    (value,) = pages(host, [8])
    assert b.set("k", value)
    assert same(b.get("k"), value)


def test_get_without_target_or_pool_is_an_error(store):
    b = backend(store)
    with pytest.raises(ValueError, match="host pool"):
        b.get("k")


def test_set_keeps_a_copy_not_the_callers_buffer(store):
    # MLA host pools hand out pages as views of the pool; the pool then reuses the slot.
    b = backend(store)
    buffer = torch.randn(64)
    want = buffer.clone()
    assert b.set("k", buffer[16:48])
    buffer.fill_(float("nan"))
    assert same(b.get("k", torch.full((32,), float("nan"))), want[16:48])


def test_set_of_present_key_is_success_and_keeps_one_copy(store):
    b = backend(store)
    value = torch.randn(16)
    assert b.set("k", value) and b.set("k", value)
    assert len(store) == 1 and b.store_stats()["pages"] == 1


def test_bad_calls_raise_clear_errors(store):
    b = backend(store)
    with pytest.raises(TypeError, match="tensor"):
        b.set("k", [1, 2, 3])
    with pytest.raises(ValueError, match="values"):
        b.batch_set(["a", "b"], [torch.zeros(2)])
    with pytest.raises(TypeError, match="strings"):
        b.exists(b"bytes-key")


# ---- the v1 API: straight to and from the host pool (extra_config interface_v1) ---------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_through_the_host_pool(store, layout):
    host = host_pool(layout, seed=1)
    b = backend(store, {"interface_v1": 1}, pool=host)
    keys = ["h0", "h1", "h2", "h3"]
    src = [0, 4, 12, 20]
    expected = pages(host, src)
    assert b.batch_set_v1(keys, indices(src), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 4

    poison(host)  # everything the reads do not write stays NaN
    dst = [40, 32, 44, 36]  # other slots, out of order
    assert b.batch_get_v1(keys + ["absent"], indices(dst + [48])) == [True] * 4 + [False]
    for offset, want in zip(dst, expected):
        assert same(host.get_data_page(offset, flat=True), want)
    assert torch.isnan(host.get_data_page(48, flat=True).float()).all()


def test_v1_and_tensor_api_read_each_others_pages(store):
    host = host_pool("layer_first", seed=2)
    b = backend(store, pool=host)
    expected = pages(host, [0, 4])
    assert b.batch_set_v1(["x", "y"], indices([0, 4])) == [True, True]
    assert same(b.get("x", poisoned()), expected[0])
    assert b.set("z", expected[1])
    poison(host)
    assert b.batch_get_v1(["z"], indices([8])) == [True]
    assert same(host.get_data_page(8, flat=True), expected[1])


def test_v1_rejects_mismatched_indices(store):
    b = backend(store, pool=host_pool("layer_first"))
    with pytest.raises(ValueError, match="host indices"):
        b.batch_set_v1(["a", "b"], torch.arange(PAGE))


# ---- SGLang's controller code driving the backend ---------------------------------------------


@pytest.mark.parametrize("interface_v1", [0, 1])
def test_sglang_controller_backup_then_prefetch(store, interface_v1):
    """HiCacheController's own backup and prefetch steps (not its threads, which need a process
    group), with the page functions it selects for a `dynamic` backend."""
    from functools import partial

    from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation

    host = host_pool("layer_first", seed=9)
    b = StorageBackendFactory.create_backend("dynamic", config({"interface_v1": interface_v1}), host, store=store)
    b.register_mem_pool_host(host)
    ctl = types.SimpleNamespace(storage_backend=b, storage_host_pool=host, mem_pool_host=host, page_size=PAGE)
    if interface_v1:  # what attach_storage_backend picks when extra_config has interface_v1
        ctl.page_set_func = partial(HiCacheController._page_set_zero_copy, ctl)
        ctl.page_get_func = partial(HiCacheController._page_get_zero_copy, ctl)
    else:
        ctl.page_set_func = partial(HiCacheController._generic_page_set, ctl)
        ctl.page_get_func = partial(HiCacheController._generic_page_get, ctl)

    keys = [f"{i:064x}" for i in range(5)]  # SGLang's page hashes are hex digests
    src = [0, 4, 8, 12, 16]
    expected = pages(host, src)
    backup = StorageOperation(indices(src), list(range(5 * PAGE)), hash_value=keys, prefix_keys=[])
    HiCacheController._page_backup(ctl, backup)
    assert backup.completed_tokens == 5 * PAGE
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 5

    poison(host)
    dst = [40, 44, 48, 52, 56]
    prefetch = PrefetchOperation("req", list(range(5 * PAGE)), None, [])
    hits = HiCacheController._page_transfer_kv_batch(ctl, prefetch, keys, indices(dst), HiCacheStorageExtraInfo(), [])
    assert hits == 5
    for offset, want in zip(dst, expected):
        assert same(host.get_data_page(offset, flat=True), want)
    assert torch.isnan(host.get_data_page(0, flat=True).float()).all()  # untouched slots stay poisoned


# ---- eviction under the byte bound -------------------------------------------------------------


def test_eviction_only_loses_pages_never_corrupts_them():
    store = SharedTensorStore("small", 5 * PAGE_BYTES)  # five pages fit
    host = host_pool("page_first", seed=3)
    b = backend(store, pool=host)
    keys = [f"p{i}" for i in range(12)]
    values = pages(host, [(i % 16) * PAGE for i in range(12)])
    for k, v in zip(keys, values):
        assert b.set(k, v)
    assert store.used_bytes <= 5 * PAGE_BYTES and b.store_stats()["pages"] == 5
    alive = [k for k in keys if b.exists(k)]
    assert alive == keys[-5:]  # least recently used went first
    for k, v in zip(keys, values):
        target = poisoned()
        got = b.get(k, target)
        if k in alive:
            assert same(got, v)
        else:
            assert got is None and torch.isnan(target.float()).all()
    poison(host)
    results = b.batch_get_v1(keys, indices([i * PAGE for i in range(12)]))
    assert results == [k in alive for k in keys]
    store.check_invariants()


def test_a_page_larger_than_the_store_is_a_failed_write():
    store = SharedTensorStore("tiny", PAGE_BYTES - 1)
    b = backend(store)
    assert not b.set("big", torch.zeros(PAGE_BYTES // 2, dtype=DTYPE))
    assert not b.exists("big") and b.store_stats()["rejected"] == 1


def test_recently_read_pages_survive_eviction():
    store = SharedTensorStore("lru", 3 * PAGE_BYTES)
    b = backend(store)
    vals = [torch.randn(PAGE_BYTES // 2).to(DTYPE) for _ in range(4)]
    for k, v in zip("abc", vals):
        b.set(k, v)
    assert b.get("a", poisoned()) is not None  # a is now the most recent
    b.set("d", vals[3])
    assert [b.exists(k) for k in "abcd"] == [True, False, True, True]


# ---- nobody else's pages -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [
        dict(model_name="Qwen/Qwen2.5-VL-3B"),
        dict(tp_rank=1, tp_size=2),
        dict(tp_size=2),
        dict(pp_rank=1, pp_size=2),
        dict(attn_cp_rank=1, attn_cp_size=2),
        dict(extra={"tenant": "acme"}),
    ],
)
def test_other_namespaces_do_not_find_a_page(store, other):
    value = torch.randn(PAGE_BYTES // 2).to(DTYPE)
    writer = backend(store)
    assert writer.set("shared-hash", value)
    extra = other.pop("extra", None)
    reader = backend(store, extra, **other)
    target = poisoned()
    assert not reader.exists("shared-hash") and reader.get("shared-hash", target) is None
    assert torch.isnan(target.float()).all()
    assert same(backend(store).get("shared-hash", poisoned()), value)  # the writer's own scope still hits


def test_tenants_do_not_share(store):
    a, b = backend(store, {"tenant": "a"}), backend(store, {"tenant": "b"})
    assert a.set("k", torch.ones(8)) and b.set("k", torch.zeros(8))
    assert same(a.get("k", torch.full((8,), float("nan"))), torch.ones(8))
    assert same(b.get("k", torch.full((8,), float("nan"))), torch.zeros(8))


def test_host_layouts_do_not_share_pages(store):
    # page_first orders a page's bytes differently from layer_first: a page written in one
    # layout must never be copied into a pool of the other.
    first = host_pool("page_first", seed=4)
    writer = backend(store, pool=first)
    assert writer.batch_set_v1(["k"], indices([0])) == [True]
    other = host_pool("layer_first", seed=5)
    reader = backend(store, pool=other)
    poison(other)
    assert reader.batch_exists(["k"]) == 0 and reader.batch_get_v1(["k"], indices([0])) == [False]
    assert torch.isnan(other.get_data_page(0, flat=True).float()).all()


def test_a_record_of_another_geometry_is_a_miss(store):
    b = backend(store)
    assert b.set("k", torch.randn(32))  # float32, 32 elements
    assert b.get("k", torch.full((32,), float("nan"), dtype=torch.bfloat16)) is None
    assert b.get("k", torch.full((16,), float("nan"))) is None
    assert b.get("k", torch.full((32,), float("nan"))) is not None
    # With a host pool registered, exists judges by the pool's page geometry too.
    b.register_mem_pool_host(host_pool("layer_first"))
    assert not b.exists("k") and b.batch_exists(["k"]) == 0
    # A write of the pool's geometry replaces the stale record instead of being blocked by it.
    value = torch.randn(PAGE_BYTES // 2).to(DTYPE)
    assert b.set("k", value) and b.exists("k") and same(b.get("k", poisoned()), value)


def test_a_record_whose_check_differs_is_a_miss_in_the_store(store):
    b = backend(store, pool=host_pool("layer_first"))
    key = b._key("k")
    store.put(key, torch.zeros(PAGE_BYTES // 2, dtype=DTYPE), check=("something else", 0))
    target = poisoned()
    assert not b.exists("k") and b.get("k", target) is None and torch.isnan(target.float()).all()


# ---- clear, stats, the shared store ------------------------------------------------------------


def test_clear_drops_only_this_backends_pages(store):
    mine, theirs = backend(store), backend(store, model_name="other-model")
    for k in "abc":
        mine.set(k, torch.randn(8))
    theirs.set("a", torch.randn(8))
    image_key = Namespace("image-kv").key(hash_bytes(b"img"))
    released = []
    store.put(image_key, torch.randn(4), "grid", on_evict=released.append)
    mine.clear()
    assert not any(mine.exists(k) for k in "abc") and mine.store_stats()["pages"] == 0
    assert theirs.exists("a") and store.get(image_key, "grid") is not None and not released
    store.check_invariants()


def test_get_stats_returns_sglang_storage_metrics(store):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    host = host_pool("layer_first")
    b = SamcacheHiCacheStorage(config(enable_storage_metrics=True), {"store": store})
    b.register_mem_pool_host(host)
    b.batch_set_v1(["a", "b"], indices([0, 4]))
    b.batch_get_v1(["a", "b"], indices([8, 12]))
    stats = b.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [2] and stats.prefetch_pgs == [2]
    assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
    assert b.get_stats().backup_pgs == []  # drained
    assert backend(store).get_stats() is None  # metrics off: SGLang substitutes its own
    counts = b.store_stats()
    assert counts["writes"] == 2 and counts["hits"] == 2 and counts["pages"] == 2


def test_shared_store_is_one_object_per_process(fresh_shared):
    s = shared_store(1 << 20)
    assert shared_store() is s and shared_store(1 << 20) is s
    with pytest.raises(ValueError, match="capacity_bytes"):
        shared_store(1 << 21)
    reset_shared_store()
    assert shared_store() is not s


def test_shared_store_evicts_image_kv_and_pages_under_one_bound():
    store = SharedTensorStore("both", 3 * PAGE_BYTES)
    released = []
    image_key = Namespace("image-kv").key(hash_bytes(b"screenshot"))
    assert store.put(image_key, "held blocks", "grid", size_bytes=PAGE_BYTES, on_evict=released.append)
    b = backend(store)
    for k in "abc":  # three more pages push the image out: one bound, one LRU order
        assert b.set(k, torch.zeros(PAGE_BYTES // 2, dtype=DTYPE))
    assert released == ["held blocks"] and store.get(image_key, "grid") is None
    store.check_invariants()


def test_concurrent_prefetch_and_backup_threads(store, run_threads):
    host = host_pool("layer_first", seed=6)
    b = backend(store, pool=host)
    values = pages(host, [i * PAGE for i in range(8)])

    def worker(seed):
        for round_ in range(20):
            k = f"t{(seed + round_) % 8}"
            b.set(k, values[(seed + round_) % 8])
            got = b.get(k, poisoned())
            assert got is None or same(got, values[(seed + round_) % 8])

    run_threads(worker, n=4)
    store.check_invariants()


# ---- v2 (hybrid models: KV plus side pools) -----------------------------------------------------


def test_v2_side_pool_round_trip_and_hit_policies(store):
    kv, side = host_pool("layer_first", seed=7), host_pool("layer_first", seed=8)
    b = backend(store, pool=kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(side, PoolName.MAMBA)
    keys = [f"k{i}" for i in range(4)]
    b.batch_set_v1(keys, indices([0, 4, 8, 12]))
    # The side pool holds only the last two pages' state (a trailing window).
    want = pages(side, [0, 4])
    res = b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=indices([0, 4]), keys=keys[2:])])
    assert res == {"mamba": [True, True]}

    trailing = PoolTransfer(name=PoolName.MAMBA, keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = b.batch_exists_v2(keys, [trailing])
    assert hit.kv_hit_pages == 4 and hit.extra_pool_hit_pages[PoolName.KV] == 4
    assert hit.restorable_prefix_pages == [4]
    every = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    assert b.batch_exists_v2(keys, [every]).kv_hit_pages == 0  # pages 0 and 1 have no side state
    assert b.batch_exists_v2(keys).kv_hit_pages == 4

    poison(side)
    got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=indices([20, 24]), keys=keys[2:] )])
    assert got == {"mamba": [True, True]}
    assert same(side.get_data_page(20, flat=True), want[0]) and same(side.get_data_page(24, flat=True), want[1])
    with pytest.raises(ValueError, match="no host pool"):
        b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=indices([0]), keys=["k0"])])
    with pytest.raises(ValueError, match="hit policy"):
        b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
