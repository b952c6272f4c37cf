"""The shared tier on a real Mooncake Store (``mooncake_master`` started here on loopback ports):
items round-trip, keys are namespaced, damaged items are removed, an unreachable master fails
fast, and two engine processes share image KV and ViT outputs: what one computed, the other reuses."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from needs import need_module  # noqa: E402

need_module("mooncake.store", "make test installs mooncake-transfer-engine-non-cuda (and Debian's libibverbs1)")

from samcache.hashing import Namespace, hash_bytes  # noqa: E402
from samcache.cache.tiers import MooncakeStore, RemoteStoreError, RemoteTier  # noqa: E402
from samcache.cache.tiers.mooncake_local import LocalMooncakeMaster, free_port  # noqa: E402

NS = Namespace("tiny", tenant="acme")


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with LocalMooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log") as m:
        yield m


@pytest.fixture(scope="module")
def store(master):
    s = MooncakeStore(master.master, master.metadata, segment_bytes=64 << 20, buffer_bytes=32 << 20)
    yield s
    s.close()


def test_items_round_trip_under_namespaced_keys(store):
    tier = RemoteTier(store, qtype=None)
    key = NS.key(hash_bytes(b"screenshot"))
    kv = torch.randn(2, 2, 30, 2, 8)
    assert tier.put(NS, key, kv, {"position": 3, "check": [1]})
    name = RemoteTier.key_of(NS, key)
    assert name == f"samcache/{NS.digest.hex()}/{key.digest.hex()}/kv" and store.exists(name)
    got = tier.get(NS, key)
    assert torch.equal(got.kv, kv) and got.meta == {"position": 3, "check": [1]}
    # Another tenant's namespace is another key: nothing there.
    other = Namespace("tiny", tenant="other")
    assert tier.get(other, other.key(hash_bytes(b"screenshot"))) is None
    fp8 = RemoteTier(store, qtype="fp8_e4m3")
    key2 = NS.key(hash_bytes(b"second"))
    assert fp8.put(NS, key2, kv)
    assert (fp8.get(NS, key2).kv - kv).abs().max() < 0.2 * kv.abs().max()
    assert store.exists_many([name, RemoteTier.key_of(NS, key2), "samcache/none"]) == [True, True, False]


def test_batches_move_through_the_registered_buffer_zero_copy(store):
    """put_many / get_many are one batch_put_from / batch_get_into each, through the registered
    staging buffer, which grows for a batch larger than it; absent keys are None."""
    rng = np.random.default_rng(0)
    items = [(f"samcache/test/batch/{i}", rng.integers(0, 256, n, dtype=np.uint8).tobytes())
             for i, n in enumerate((10, 70_000, 1, 3 << 20))]  # the last one outgrows the first buffer
    assert store.put_many(items[:3]) == [True] * 3
    first = store._staging.nbytes
    assert store.put_many(items[3:]) == [True]
    assert store.zero_copy and store._staging.nbytes >= 3 << 20 > first
    got = store.get_many([k for k, _ in items] + ["samcache/test/batch/none"])
    assert got[:4] == [d for _, d in items] and got[4] is None
    assert store.get(items[1][0]) == items[1][1] and store.get_many([]) == [] and store.put_many([]) == []


def test_a_damaged_item_is_removed_and_missed(store):
    tier = RemoteTier(store, qtype=None)
    key = NS.key(hash_bytes(b"damaged"))
    assert store.put(RemoteTier.key_of(NS, key), b"SAMKV\x00\x01\n" + b"\x00" * 40)
    assert tier.get(NS, key) is None and tier.stats["dropped"] == 1


def test_an_unreachable_master_fails_fast_and_clearly():
    with pytest.raises(RemoteStoreError, match="cannot reach the Mooncake master"):
        MooncakeStore(f"127.0.0.1:{free_port()}", "http://127.0.0.1:1/metadata")
    with pytest.raises(ValueError, match="host:port"):
        MooncakeStore("nowhere", "http://127.0.0.1:1/metadata")
    with pytest.raises(TypeError, match="RemoteStore"):
        RemoteTier(object())


PUBLISHER = textwrap.dedent("""
    import sys
    from samcache.engine import SAMcacheEngine, screenshot
    from samcache.engine.prompt import user_message
    from samcache.cache.tiers import MooncakeStore
    model, master, metadata = sys.argv[1:4]
    store = MooncakeStore(master, metadata, segment_bytes=64 << 20, buffer_bytes=32 << 20)
    engine = SAMcacheEngine(model, device="cpu", recompute_budget="uniform", kv_cache_bytes=16 << 20,
                            remote_kv_store=store, cold_kv_qtype=None)
    r = engine.chat(messages=[{"role": "system", "content": "Publisher."},
                              user_message([screenshot(77, (112, 168))], "Describe.")], max_new_tokens=2)
    print("published", engine.lower_tiers.stats["published"], flush=True)
    sys.stdin.readline()  # its segment holds the data: stay up until the reader is done
    store.close()
""")


def test_two_engine_processes_share_image_kv_through_the_store(master, tiny_checkpoints):
    pytest.importorskip("transformers")
    from samcache.engine import SAMcacheEngine, screenshot
    from samcache.engine.prompt import user_message

    model = tiny_checkpoints["qwen2_5_vl"]
    pub = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(model), master.master, master.metadata],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = pub.stdout.readline()
        assert line.strip() == "published 2", line  # the image KV and the ViT output
        store = MooncakeStore(master.master, master.metadata, segment_bytes=32 << 20, buffer_bytes=32 << 20)
        reader = SAMcacheEngine(model, device="cpu", recompute_budget="uniform", kv_cache_bytes=16 << 20,
                                remote_kv_store=store, cold_kv_qtype=None)
        shot = screenshot(77, (112, 168))
        msgs = [{"role": "system", "content": "Reader, another system prompt."}, user_message([shot], "Describe.")]
        r = reader.chat(messages=msgs, max_new_tokens=4, ignore_eos=True)
        assert r.metrics.image_kv_remote_hits == 1
        # Its ViT output too (the recompute rows need it): fetched, not encoded again.
        assert r.metrics.vit_remote_hits == 1 and r.metrics.vit_calls == 0
        # The same as an engine that computed the image itself in an earlier turn and reused it here.
        own = SAMcacheEngine(model, device="cpu", recompute_budget="uniform", kv_cache_bytes=16 << 20)
        own.chat(messages=[{"role": "system", "content": "Publisher."}, user_message([shot], "Describe.")],
                 max_new_tokens=2)
        assert own.chat(messages=msgs, max_new_tokens=4, ignore_eos=True).token_ids == r.token_ids
        reader.check_invariants()
        store.close()
    finally:
        pub.stdin.write("\n")
        pub.stdin.flush()
        pub.wait(timeout=60)


def test_the_master_going_away_degrades_to_local_tiers(tmp_path, tiny_checkpoints):
    """Stop mooncake_master mid-run: requests still succeed, failures are counted, and after one
    failed publish the tier is skipped instead of costing every request a timeout."""
    pytest.importorskip("transformers")
    import time

    from samcache.engine import SAMcacheEngine, screenshot
    from samcache.engine.prompt import user_message

    master = LocalMooncakeMaster(tmp_path / "master.log").__enter__()
    store = MooncakeStore(master.master, master.metadata, segment_bytes=32 << 20, buffer_bytes=16 << 20)
    engine = SAMcacheEngine(tiny_checkpoints["qwen2_5_vl"], device="cpu", recompute_budget="uniform",
                            kv_cache_bytes=16 << 20, remote_kv_store=store, cold_kv_qtype=None)
    shots = [screenshot(120 + i, (112, 168)) for i in range(4)]
    engine.chat(messages=[user_message([shots[0]], "One.")], max_new_tokens=1)
    master.__exit__(None, None, None)
    took = []
    for i in (1, 2, 3, 0):
        start = time.perf_counter()
        r = engine.chat(messages=[{"role": "system", "content": f"Turn {i}."}, user_message([shots[i]], "Go.")],
                        max_new_tokens=2, ignore_eos=True)
        took.append(time.perf_counter() - start)
        assert len(r.token_ids) == 2
    remote = engine.lower_tiers.remote
    assert r.metrics.image_kv_hits == 1  # the device store still serves what it holds
    assert remote.stats["errors"] >= 1 and remote.stats["skipped"] >= 1
    # The first turn pays the client's timeouts; the later ones skip the store (tens of ms here).
    assert max(took[1:]) < 2.0, took
    engine.check_invariants()
