"""The shared tier on a real Redis server (Debian ``redis-server``, started here on a loopback
port without persistence): items round-trip under namespaced keys, damaged items are removed,
an unreachable server fails fast, and two engines share image KV and ViT outputs through it."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from needs import need_module, need_program  # noqa: E402

need_module("redis", "make test installs the redis client")
need_program("redis-server", "make test installs Debian's redis-server")

from samcache.hashing import Namespace, hash_bytes  # noqa: E402
from samcache.cache.tiers import RedisStore, RemoteStoreError, RemoteTier  # noqa: E402
from samcache.cache.tiers.mooncake_local import free_port  # noqa: E402

NS = Namespace("tiny", tenant="acme")


def _start_redis(directory) -> tuple[subprocess.Popen, str]:
    """A redis-server on a free loopback port, without persistence, once it answers."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(directory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            RedisStore(url).close()
            break
        except RemoteStoreError:
            time.sleep(0.05)
    return proc, url


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    proc, url = _start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_items_round_trip_under_namespaced_keys(url):
    store = RedisStore(url)
    tier = RemoteTier(store, qtype=None)
    key = NS.key(hash_bytes(b"screenshot"))
    kv = torch.randn(2, 2, 30, 2, 8)
    assert tier.put(NS, key, kv, {"position": 3, "check": [1]})
    assert not store.put(RemoteTier.key_of(NS, key), b"other")  # written once
    got = tier.get(NS, key)
    assert torch.equal(got.kv, kv) and got.meta == {"position": 3, "check": [1]}
    other = Namespace("tiny", tenant="other")
    assert tier.get(other, other.key(hash_bytes(b"screenshot"))) is None
    names = [RemoteTier.key_of(NS, key), "samcache/none"]
    assert store.exists_many(names) == [True, False]
    assert store.get_many(names)[1] is None and store.get_many([]) == []
    assert store.remove(names[0]) and not store.exists(names[0])
    store.close()


def test_a_damaged_item_is_removed_and_missed(url):
    store = RedisStore(url)
    tier = RemoteTier(store, qtype=None)
    key = NS.key(hash_bytes(b"damaged"))
    assert store.put(RemoteTier.key_of(NS, key), b"SAMKV\x00\x01\n" + b"\x00" * 40)
    assert tier.get(NS, key) is None and tier.stats["dropped"] == 1
    assert not store.exists(RemoteTier.key_of(NS, key))


def test_an_unreachable_server_fails_fast_and_clearly():
    start = time.perf_counter()
    with pytest.raises(RemoteStoreError, match="cannot reach Redis"):
        RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout=1.0)
    assert time.perf_counter() - start < 10
    with pytest.raises(ValueError, match="redis://"):
        RedisStore("127.0.0.1:6379")


def test_two_engines_share_image_kv_and_vit_outputs(url, tiny_checkpoints):
    pytest.importorskip("transformers")
    from samcache.engine import SAMcacheEngine, screenshot
    from samcache.engine.prompt import user_message

    model = tiny_checkpoints["qwen2_5_vl"]
    engines = [SAMcacheEngine(model, device="cpu", recompute_budget="uniform", kv_cache_bytes=16 << 20,
                              remote_kv_store=RedisStore(url), cold_kv_qtype=None) for _ in range(2)]
    shot = screenshot(91, (112, 168))
    engines[0].chat(messages=[{"role": "system", "content": "First."}, user_message([shot], "Describe.")],
                    max_new_tokens=1)
    msgs = [{"role": "system", "content": "Second, another prompt."}, user_message([shot], "Describe.")]
    r = engines[1].chat(messages=msgs, max_new_tokens=3, ignore_eos=True)
    assert r.metrics.image_kv_remote_hits == 1 and r.metrics.vit_remote_hits == 1 and r.metrics.vit_calls == 0
    own = SAMcacheEngine(model, device="cpu", recompute_budget="uniform", kv_cache_bytes=16 << 20)
    own.chat(messages=[{"role": "system", "content": "First."}, user_message([shot], "Describe.")], max_new_tokens=1)
    assert own.chat(messages=msgs, max_new_tokens=3, ignore_eos=True).token_ids == r.token_ids
    for e in engines:
        e.check_invariants()


def test_two_engines_share_prefix_blocks_and_tenants_stay_apart(url, tiny_checkpoints):
    """A long system prompt one instance prefilled: the other takes its exact blocks from the
    store instead of prefilling them (the same tokens as a fresh engine), once; another tenant's
    prompt with the same text finds nothing (the prefix hash chains from the tenant)."""
    pytest.importorskip("transformers")
    from samcache.engine import SAMcacheEngine

    model = tiny_checkpoints["qwen2_5_vl"]
    system = "You are the planner. " + " ".join(f"rule{j}" for j in range(120))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Go."}]

    def engine(**kw):
        return SAMcacheEngine(model, device="cpu", recompute_budget="uniform", kv_cache_bytes=16 << 20,
                              host_prefix_cache_bytes=8 << 20, remote_kv_store=RedisStore(url), **kw)

    first, second, other = engine(), engine(), engine(tenant="globex")
    first.chat(messages=msgs, max_new_tokens=1)
    published = first.executor.tiers.prefix_tier.stats["published"]
    assert published > 0
    first.chat(messages=msgs, max_new_tokens=1)  # the same prompt again: nothing new to offer
    assert first.executor.tiers.prefix_tier.stats["published"] == published
    r = second.chat(messages=msgs, max_new_tokens=4, ignore_eos=True)
    blocks = first.executor.tiers.prefix_tier.stats["published"]
    assert r.metrics.prefix_restored_tokens == blocks * second.pool.block_size
    assert second.executor.tiers.prefix_tier.stats["restored_from_remote"] == blocks
    fresh = SAMcacheEngine(model, device="cpu", recompute_budget="uniform", kv_cache_bytes=16 << 20)
    assert fresh.chat(messages=msgs, max_new_tokens=4, ignore_eos=True).token_ids == r.token_ids
    assert second.executor.tiers.prefix_tier.stats["published"] == 0  # restored blocks are not offered again
    assert other.chat(messages=msgs, max_new_tokens=1).metrics.prefix_restored_tokens == 0
    for e in (first, second, other):
        e.check_invariants()


def test_the_store_going_away_degrades_to_local_tiers(tiny_checkpoints, tmp_path):
    """Kill the server mid-run: requests go on (computed or from local tiers), errors are counted."""
    pytest.importorskip("transformers")
    from samcache.engine import SAMcacheEngine, screenshot
    from samcache.engine.prompt import user_message

    proc, url = _start_redis(tmp_path)
    engine = SAMcacheEngine(tiny_checkpoints["qwen2_5_vl"], device="cpu", recompute_budget="uniform",
                            kv_cache_bytes=16 << 20, remote_kv_store=RedisStore(url, timeout=1.0), cold_kv_qtype=None)
    shots = [screenshot(100 + i, (112, 168)) for i in range(3)]
    engine.chat(messages=[user_message([shots[0]], "One.")], max_new_tokens=1)
    proc.kill()
    proc.wait(timeout=30)
    with pytest.warns(RuntimeWarning, match="shared store failed"):
        for i in (1, 2, 0):
            r = engine.chat(messages=[{"role": "system", "content": f"Turn {i}."}, user_message([shots[i]], "Go.")],
                            max_new_tokens=2, ignore_eos=True)
            assert len(r.token_ids) == 2
    assert r.metrics.image_kv_hits == 1  # the device store still has it
    assert engine.lower_tiers.remote.stats["errors"] > 0
    engine.check_invariants()
