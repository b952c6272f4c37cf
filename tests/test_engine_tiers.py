"""Image KV below the device pool: what the store lets go is demoted to host memory or disk and
comes back on the next lookup: exact from host memory, FP8/INT8 from disk; records that differ are
misses; a turn pins the images it reuses."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from samcache.engine import screenshot  # noqa: E402
from samcache.engine.prompt import user_message  # noqa: E402
from samcache.hashing import Namespace, hash_bytes  # noqa: E402
from samcache.cache.tiers import DiskTier, LowerTiers  # noqa: E402
from samcache.cache.tiers.transfer import LayerLoad  # noqa: E402

from engine_helpers import SIZE, assert_clean, make_engine  # noqa: E402


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return tiny_checkpoints["qwen2_5_vl"]


def _small_store(engine_kwargs, model):
    """An engine whose image-KV store holds two screenshots: a third pushes the oldest out."""
    probe = make_engine(model)
    blocks = -(-probe.build_prompt([user_message([screenshot(0, SIZE)], "x")]).images[0].length // 16) + 1
    return make_engine(model, image_kv_cache_bytes=2 * blocks * probe.runner.block_bytes, prefix_cache=False,
                       **engine_kwargs)


def _turns(engine):
    """Screenshots a, b, c one per turn (a is pushed out), then c and a at new positions."""
    a, b, c = screenshot(1, SIZE), screenshot(2, SIZE), screenshot(4, SIZE)
    out = []
    for system, images in (("First.", [a]), ("Second.", [b]), ("Third.", [c]),
                           ("Fourth, a much longer system prompt.", [c, a])):
        r = engine.chat(messages=[{"role": "system", "content": system}, user_message(images, "Describe.")],
                        max_new_tokens=6, ignore_eos=True)
        out.append(r)
    return out


@pytest.mark.parametrize("opts", [{}, {"recompute_tracks": "heads"}, {"recompute_ratio": 0.0}])
def test_host_tier_brings_a_demoted_image_back_exactly(model, opts, monkeypatch):
    """Track 2 scores the spliced keys before the forward (the load completes first); the other
    settings load layer by layer during the forward. Either way: the reference's tokens."""
    reference = _turns(make_engine(model, prefix_cache=False, **opts))  # a store big enough for both
    tiered = _small_store({"host_kv_cache_bytes": 64 << 20, **opts}, model)
    events = []  # ("wait", l): a load's layer l awaited; ("layer", l): the forward computes layer l
    wait, attention_inputs = LayerLoad.wait, tiered.runner._attention_inputs
    monkeypatch.setattr(LayerLoad, "wait", lambda self, layer: (events.append(("wait", layer)), wait(self, layer))[1])
    monkeypatch.setattr(tiered.runner, "_attention_inputs",
                        lambda l, *a: (events.append(("layer", l)), attention_inputs(l, *a))[1])
    got = _turns(tiered)
    waits = [i for i, e in enumerate(events) if e[0] == "wait"]
    assert waits, "no load from the host tier ran"
    forward, layers = events[waits[0]:], tiered.runner.num_layers
    first_waits = []  # each layer's first wait, in the order they came
    for e in forward:
        if e[0] == "wait" and e not in first_waits:
            first_waits.append(e)
    assert [l for _, l in first_waits] == list(range(layers))
    loaded_ahead = forward.index(("layer", 0)) > forward.index(("wait", layers - 1))
    if opts:  # layer by layer: layer l's copy is awaited after layer l-1 ran, just before layer l
        assert not loaded_ahead
        for l in range(1, layers):
            assert forward.index(("layer", l - 1)) < forward.index(("wait", l)) < forward.index(("layer", l))
    else:  # track 2 reads the spliced keys: the whole load lands before the forward
        assert loaded_ahead
    m = got[3].metrics
    assert m.image_kv_hits == 2 and m.image_kv_host_hits == 1 and m.image_kv_disk_hits == 0
    assert reference[3].metrics.image_kv_hits == 2
    assert got[3].token_ids == reference[3].token_ids  # host memory is lossless
    assert m.tier_load_s > 0 and 0 <= m.tier_load_wait_s
    assert tiered.lower_tiers.stats["demoted"] >= 1
    a = tiered.executor.layout(tiered.build_prompt([user_message([screenshot(1, SIZE)], "x")]),
                               Namespace(tiered.model_id, tiered.tenant)).images[0].key
    assert a in tiered.image_kv_store  # promoted: held in the pool again
    assert_clean(tiered)
    # Without lower tiers the same store loses the first image.
    plain = _turns(_small_store({}, model))
    assert plain[3].metrics.image_kv_hits == 1 and plain[3].metrics.image_kv_misses == 1


@pytest.mark.parametrize("qtype", ["fp8_e4m3", "int8", None])
def test_disk_tier_brings_it_back_quantized(model, tmp_path, qtype):
    reference = _turns(make_engine(model, prefix_cache=False))
    tiered = _small_store({"disk_kv_cache_dir": tmp_path / "kv", "cold_kv_qtype": qtype}, model)
    got = _turns(tiered)
    m = got[3].metrics
    assert m.image_kv_hits == 2 and m.image_kv_disk_hits == 1
    files = list((tmp_path / "kv").iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    if qtype is None:
        assert got[3].token_ids == reference[3].token_ids
    tiered.check_invariants()


def test_a_damaged_disk_item_is_recomputed_never_used(model, tmp_path):
    tiered = _small_store({"disk_kv_cache_dir": tmp_path / "kv"}, model)
    a, b, c = screenshot(1, SIZE), screenshot(2, SIZE), screenshot(4, SIZE)
    for images in ([a], [b], [c]):
        tiered.chat(messages=[{"role": "system", "content": "S."}, user_message(images, "D.")], max_new_tokens=1)
    for f in (tmp_path / "kv").iterdir():
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    r = tiered.chat(messages=[{"role": "system", "content": "Other."}, user_message([c, a], "D.")], max_new_tokens=1)
    assert r.metrics.image_kv_disk_hits == 0 and r.metrics.image_kv_misses == 1
    assert tiered.lower_tiers.disk.stats()["dropped"] == 1


def test_lower_tiers_refuse_other_records_and_spill_to_disk(tmp_path):
    ns = Namespace("m", "t")
    keys = [ns.key(hash_bytes(bytes([i]))) for i in range(3)]
    kv = torch.randn(2, 2, 10, 1, 8)
    tiers = LowerTiers(host_bytes=kv.numel() * 4 * 2, disk=DiskTier(tmp_path, 1 << 20, qtype=None))
    for k in keys:
        tiers.demote(ns, k, kv, position=5, check=((1, 2, 4), 10, 2))
    assert len(tiers) == 2 and tiers.stats["to_disk"] == 1  # the oldest went down
    assert tiers.fetch(ns, keys[1], ((1, 2, 4), 10, 3)) is None  # another model depth: a miss
    assert tiers.fetch(Namespace("m", "u"), keys[1], ((1, 2, 4), 10, 2)) is None  # another tenant
    got = tiers.fetch(ns, keys[0], ((1, 2, 4), 10, 2))
    assert got.tier == "disk" and got.position == 5 and torch.equal(got.kv, kv)
    got = tiers.fetch(ns, keys[2], [[1, 2, 4], 10, 2])
    assert got.tier == "host" and len(tiers) == 1  # taken out: it goes back up
    with pytest.raises(ValueError, match="host tier"):
        LowerTiers(0)


def test_a_turn_pins_the_images_it_reuses(model):
    engine = make_engine(model)
    engine.chat(images=[screenshot(3, SIZE)], prompt="a", max_new_tokens=1)
    store = engine.image_kv_store
    (key,) = [h.key for h in store.entries.payloads()]
    assert store.pin(key)
    store.evict_for_blocks(engine.pool.num_blocks)  # asks for everything: the pinned entry stays
    assert key in store
    store.unpin(key)
    store.evict_for_blocks(engine.pool.num_blocks)
    assert key not in store
    assert not store.pin(key)
    engine.check_invariants()


def test_bad_tier_options_are_refused(model, tmp_path):
    with pytest.raises(ValueError, match="cold_kv_qtype"):
        make_engine(model, disk_kv_cache_dir=tmp_path, cold_kv_qtype="int4")
    with pytest.raises(ValueError, match="host_kv_cache_bytes"):
        make_engine(model, host_kv_cache_bytes=-1)
    with pytest.raises(ValueError, match="prefetch_horizon"):
        make_engine(model, prefetch_horizon=-1)
    assert make_engine(model, image_kv_cache=False, host_kv_cache_bytes=1 << 20).lower_tiers is None
    np.testing.assert_equal(make_engine(model).lower_tiers, None)


def test_prefetch_lifts_items_from_disk_into_host_memory(tmp_path):
    ns = Namespace("m", "t")
    keys = [ns.key(hash_bytes(bytes([i]))) for i in range(3)]
    kv = torch.randn(2, 2, 10, 1, 8)
    check = ((1, 2, 4), 10, 2)
    tiers = LowerTiers(host_bytes=kv.numel() * 4 * 2, disk=DiskTier(tmp_path, 1 << 20, qtype=None))
    try:
        for k in keys:
            tiers.demote(ns, k, kv, position=5, check=check)
        assert not tiers.fetch(ns, keys[2], check) is None  # host: 1 left there, keys[0] on disk
        assert tiers.holds(keys[0]) and tiers.holds(keys[1]) and not tiers.holds(ns.key(hash_bytes(b"x")))
        # keys[0] is on disk only; a wrong record or an unknown key lifts nothing.
        done = tiers.prefetch([(ns, keys[0], check), (ns, keys[1], check), (ns, keys[2], ((1, 2, 4), 10, 3))])
        assert len(done) == 2  # keys[1] is in host memory already: skipped
        assert [f.result() for f in done] == [True, None]  # None: no lower tier has that record
        assert tiers.stats["prefetched"] == 1 and tiers.stats["prefetch_seconds"] > 0
        got = tiers.fetch(ns, keys[0], check)
        assert got.tier == "host" and torch.equal(got.kv, kv) and got.position == 5
        # Until fetched, what the plan asked for (keys[1], keys[2]) is not spilled: the newcomer goes down.
        tiers.demote(ns, keys[2], kv, position=5, check=check)
        tiers.demote(ns, keys[0], kv, position=5, check=check)
        assert keys[1] in tiers._host and keys[2] in tiers._host and keys[0] in tiers.disk
        assert tiers.stats["to_disk"] == 2
        # A fetch of an item still on its way waits for it, then finds it in host memory.
        assert tiers.fetch(ns, keys[1], check).tier == "host"  # makes room
        pending = tiers.prefetch([(ns, keys[0], check)])
        got = tiers.fetch(ns, keys[0], check)
        assert pending[0].done() and got is not None and got.tier == "host"
    finally:
        tiers.close()


@pytest.mark.parametrize("host_images", [2, 0])
def test_a_turn_prefetches_what_it_will_take_from_disk_as_soon_as_it_is_admitted(model, tmp_path, host_images):
    """The first screenshot goes pool -> host -> disk; the turn that re-sends it starts lifting it
    up as soon as its plan is known (room for two images in host memory: the one this turn also
    takes from there stays, the other goes down), or, without a host tier, reads it from disk
    itself. Either way the tokens are the reference's (lossless disk items)."""
    probe = make_engine(model)
    tokens = probe.build_prompt([user_message([screenshot(0, SIZE)], "x")]).images[0].length
    layers, _, _, heads, dim = probe.runner.k_cache.shape
    image_bytes = layers * 2 * tokens * heads * dim * probe.runner.k_cache.element_size()
    engine = _small_store({"host_kv_cache_bytes": host_images * image_bytes, "disk_kv_cache_dir": tmp_path / "kv",
                           "cold_kv_qtype": None}, model)
    reference = make_engine(model, prefix_cache=False)
    shots = [screenshot(60 + i, SIZE) for i in range(5)]

    def turn(e, images):
        return e.chat(messages=[{"role": "system", "content": "Look."}, user_message(images, "Describe.")],
                      max_new_tokens=4, ignore_eos=True)

    for s in shots:  # the pool holds two, host memory two more: shots[0] goes down to disk
        turn(engine, [s])
    assert engine.lower_tiers.disk is not None and len(engine.lower_tiers.disk) >= 1
    assert engine.image_tier(shots[0]) == "disk" and engine.image_tier(shots[4]) == "device"
    assert engine.image_tier(shots[1]) == ("host" if host_images else "disk")
    assert engine.image_tier(screenshot(99, SIZE)) is None and engine.image_tier(shots[4], tenant="x") is None
    got = turn(engine, [shots[1], shots[0]])
    assert got.token_ids == turn(reference, [shots[1], shots[0]]).token_ids
    m, stats = got.metrics, engine.lower_tiers.stats
    if host_images:
        assert stats["prefetched"] == 1  # shots[0] came up from disk before its lookup ...
        assert m.image_kv_host_hits == 2 and m.image_kv_disk_hits == 0  # ... and both were found in host memory
    else:
        assert stats["prefetched"] == 0 and m.image_kv_disk_hits == 2
    assert engine.image_tier(shots[0]) == "device"
    tiers = engine.tier_stats()
    assert tiers["image_kv"]["prefetched"] == stats["prefetched"] and tiers["image_kv_disk"]["hits"] >= 1
    engine.lower_tiers.close()
    engine.check_invariants()


def test_workflow_prefetch_brings_the_next_agents_images_up_a_tier(model, tmp_path):
    from samcache.policies import Workflow

    engine = _small_store({"disk_kv_cache_dir": tmp_path / "kv", "cold_kv_qtype": None, "host_kv_cache_bytes": 0,
                           "eviction_policy": "workflow", "prefetch_horizon": 0}, model)
    agents = ("a1", "a2", "a3", "a4")
    engine.plan_workflow(Workflow.sequence("wf", agents))
    shots = {a: screenshot(50 + i, SIZE) for i, a in enumerate(agents)}

    def turn(a):
        return engine.chat(messages=[{"role": "system", "content": f"Agent {a}."}, user_message([shots[a]], "Go.")],
                           max_new_tokens=1, agent="wf/" + a)

    for a in agents:  # the store holds two screenshots: a1's and a2's went down to disk
        turn(a)
    assert engine.prefetch(wait=True) == 0  # host_kv_cache_bytes=0: nothing can come up ...
    engine.lower_tiers.host_bytes = 64 << 20  # ... give the host tier room (as host_kv_cache_bytes would)
    # a1 runs now; the images of a2 and a3 come next: those not in the pool come up from disk.
    plan = [k for k in engine.prefetch_plan(horizon=2) if not isinstance(k, tuple)]
    below = [k for k in plan if k not in engine.image_kv_store]
    assert len(plan) == 2 and below  # the pool holds two of the four: at least one is below
    assert engine.prefetch(horizon=2, wait=True) == len(below)
    assert all(engine.lower_tiers.holds(k) for k in below) and engine.lower_tiers.stats["prefetched"] == len(below)
    hits = [turn(a).metrics for a in agents[:3]]
    assert sum(m.image_kv_host_hits for m in hits[1:]) == len(below)  # a2, a3 found them in host memory
    assert sum(m.image_kv_disk_hits for m in hits[1:]) == 0
    # With a horizon the engine sends them up by itself after every batch of turns, without waiting.
    calls = []
    engine.prefetch = lambda horizon=None, wait=True: calls.append((horizon, wait)) or 0
    turn("a4")
    assert calls == []  # prefetch_horizon=0: never
    engine.prefetch_horizon = 2
    turn("a1")
    assert calls == [(None, False)]
    engine.lower_tiers.close()
    engine.check_invariants()


def test_host_tier_spills_the_lowest_priority_first(tmp_path):
    ns = Namespace("m", "t")
    keys = [ns.key(hash_bytes(bytes([i]))) for i in range(4)]
    kv = torch.randn(2, 2, 10, 1, 8)
    check = ((1, 2, 4), 10, 2)
    tiers = LowerTiers(host_bytes=kv.numel() * 4 * 2, disk=DiskTier(tmp_path, 1 << 20, qtype=None))
    priority = {keys[0]: 5, keys[1]: -3, keys[2]: 0, keys[3]: -9}
    tiers.priority_of = priority.__getitem__
    for k in keys[:3]:
        tiers.demote(ns, k, kv, position=1, check=check)
    assert tiers.holds(keys[0]) and keys[1] in tiers.disk  # the oldest has the highest priority: it stays
    assert [k for k in keys[:3] if k in tiers._host] == [keys[0], keys[2]]
    tiers.demote(ns, keys[3], kv, position=1, check=check)  # the newcomer is the lowest: straight down
    assert keys[3] in tiers.disk and keys[3] not in tiers._host
    tiers.priority_of = None  # plain LRU: the least recently used goes
    tiers.demote(ns, keys[1], kv, position=1, check=check)
    assert keys[0] not in tiers._host and keys[0] in tiers.disk


def test_engine_demotes_by_its_policy(model, tmp_path):
    engine = _small_store({"host_kv_cache_bytes": 64 << 20, "eviction_policy": "workflow"}, model)
    assert engine.lower_tiers.priority_of == engine.priorities.priority_of
    assert _small_store({"host_kv_cache_bytes": 64 << 20}, model).lower_tiers.priority_of is None


def test_a_users_own_policy_class_decides_what_goes_down(model):
    """The policy is a small class anyone can write: most recently used out first here, so the
    device store keeps the oldest screenshot and demotes newer ones (LRU does the opposite)."""
    from samcache.policies import EvictionPolicy

    class MostRecentFirst(EvictionPolicy):
        name = "mru"

        def priority(self, item, now):
            return -item.last_use

    shots = [screenshot(80 + i, SIZE) for i in range(6)]
    first_kept = {}
    for policy in ("lru", MostRecentFirst()):
        engine = _small_store({"host_kv_cache_bytes": 64 << 20, "eviction_policy": policy}, model)
        keys = []
        for i, shot in enumerate(shots):
            msgs = [{"role": "system", "content": f"Turn {i}."}, user_message([shot], "Describe.")]
            engine.chat(messages=msgs, max_new_tokens=2)
            prompt = engine.build_prompt(msgs)
            keys.append(engine.executor.layout(prompt, Namespace(engine.model_id, engine.tenant)).images[0].key)
        first_kept[getattr(policy, "name", policy)] = keys[0] in engine.image_kv_store
        below = [k for k in keys if engine.lower_tiers.holds(k)]
        assert below and not any(k in engine.image_kv_store for k in below)  # went down a tier, not lost
    assert first_kept == {"lru": False, "mru": True}


def test_evicted_prefix_blocks_come_back_from_host_memory(model, tmp_path):
    """A pool too small for two agents' contexts: the first agent's blocks are evicted by the
    second's turn; with the prefix tier they come back, and the tokens equal a roomy engine's."""
    def role(i):
        return f"You are agent {i}. " + " ".join(f"rule{i}x{j}" for j in range(150))

    def run(engine):
        out = []
        for i in (0, 1, 0):
            r = engine.chat(messages=[{"role": "system", "content": role(i)}, {"role": "user", "content": "Go."}],
                            max_new_tokens=3, ignore_eos=True)
            out.append(r)
        return out

    probe = make_engine(model)
    blocks = -(-len(probe.build_prompt([{"role": "system", "content": role(0)}, {"role": "user", "content": "Go."}]))
               // 16) + 2
    roomy = run(make_engine(model))
    tight = run(make_engine(model, num_blocks=int(blocks * 1.5)))
    tiered_engine = make_engine(model, num_blocks=int(blocks * 1.5), host_prefix_cache_bytes=64 << 20)
    tiered = run(tiered_engine)
    assert roomy[2].metrics.prefix_reused_tokens > 0  # the roomy pool kept agent 0's context
    assert tight[2].metrics.prefix_reused_tokens < roomy[2].metrics.prefix_reused_tokens  # the tight one lost its tail
    m = tiered[2].metrics
    assert m.prefix_restored_tokens > 0 and m.prefix_reused_tokens == roomy[2].metrics.prefix_reused_tokens
    assert tiered[2].token_ids == roomy[2].token_ids  # exact copies: the same tokens
    assert tiered_engine.executor.tiers.prefix_tier.stats["demoted"] > 0
    tiered_engine.check_invariants()
    with pytest.raises(ValueError, match="host_prefix_cache_bytes"):
        make_engine(model, host_prefix_cache_bytes=-1)

    # Host memory for one block only: the rest spill to disk (lossless) and come back from there.
    disk_engine = make_engine(model, num_blocks=int(blocks * 1.5), host_prefix_cache_bytes=probe.runner.block_bytes,
                              disk_kv_cache_dir=tmp_path, disk_prefix_cache_bytes=64 << 20)
    on_disk = run(disk_engine)
    stats = disk_engine.executor.tiers.prefix_tier.stats
    assert stats["spilled"] > 0 and stats["restored_from_disk"] > 0
    assert on_disk[2].metrics.prefix_reused_tokens == roomy[2].metrics.prefix_reused_tokens
    assert on_disk[2].token_ids == roomy[2].token_ids
    for f in (tmp_path / "prefix-blocks").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    disk_engine.check_invariants()
    with pytest.raises(ValueError, match="host_prefix_cache_bytes > 0"):
        make_engine(model, disk_kv_cache_dir=tmp_path, disk_prefix_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="need disk_kv_cache_dir"):
        make_engine(model, host_prefix_cache_bytes=1 << 20, disk_prefix_cache_bytes=1 << 20)


def test_vit_outputs_the_cache_lets_go_come_back_from_disk(model, tmp_path):
    """A ViT cache holding one image: the other's ViT output spills to disk and is read back
    instead of running the vision tower again; the logits equal a fresh engine's."""
    a, b = screenshot(71, SIZE), screenshot(72, SIZE)
    probe = make_engine(model)
    out = probe.executor
    prompt = probe.build_prompt([user_message([a], "first")])
    one = sum(t.numel() * t.element_size() for t in [out.runner.encode_images(*_pixels(probe, a))[0][0]])
    engine = make_engine(model, vit_cache_bytes=one + one // 2, image_kv_cache=False, prefix_cache=False,
                         disk_kv_cache_dir=tmp_path, disk_vit_cache_bytes=64 << 20)
    engine.chat(images=[a], prompt="first", max_new_tokens=1)
    engine.chat(images=[b], prompt="second", max_new_tokens=1)  # a's ViT output goes to disk
    assert len(list((tmp_path / "vit").iterdir())) >= 1
    pre, logits = engine.prefill(prompt)
    engine.pool.free_sequence(pre.seq)
    assert pre.metrics.vit_disk_hits == 1 and pre.metrics.vit_calls == 0
    ref_pre, ref = probe.prefill(prompt)
    probe.pool.free_sequence(ref_pre.seq)
    torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="need disk_kv_cache_dir"):
        make_engine(model, disk_vit_cache_bytes=1 << 20)


def test_vit_outputs_go_device_then_host_memory_then_disk(model, tmp_path):
    """One ViT output's room on the device and one in host memory: of three images, the newest
    stays on the device, the one before in host memory, the oldest goes to disk; each comes back
    from where it is without running the vision tower, with a fresh engine's logits."""
    shots = [screenshot(73 + i, SIZE) for i in range(3)]
    probe = make_engine(model)
    one = sum(t.numel() * t.element_size() for t in [probe.runner.encode_images(*_pixels(probe, shots[0]))[0][0]])
    engine = make_engine(model, vit_cache_bytes=one + one // 2, host_vit_cache_bytes=one + one // 2,
                         image_kv_cache=False, prefix_cache=False, disk_kv_cache_dir=tmp_path,
                         disk_vit_cache_bytes=64 << 20)
    for i, shot in enumerate(shots):
        engine.chat(images=[shot], prompt=f"turn {i}", max_new_tokens=1)
    for shot, tier in ((shots[1], "vit_host_hits"), (shots[0], "vit_disk_hits")):
        prompt = engine.build_prompt([user_message([shot], "again")])
        pre, logits = engine.prefill(prompt)
        engine.pool.free_sequence(pre.seq)
        m = pre.metrics
        assert getattr(m, tier) == 1 and m.vit_calls == 0 and m.vit_hits == 1
        ref_pre, ref = probe.prefill(prompt)
        probe.pool.free_sequence(ref_pre.seq)
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    stats = engine.tier_stats()
    assert stats["vit_host"]["hits"] == 1 and stats["vit_disk"]["hits"] == 1
    with pytest.raises(ValueError, match="host_vit_cache_bytes"):
        make_engine(model, host_vit_cache_bytes=-1)
    # Host memory too small for any ViT output: what the device lets go goes on to disk, not lost.
    small = make_engine(model, vit_cache_bytes=one + one // 2, host_vit_cache_bytes=one // 2, image_kv_cache=False,
                        prefix_cache=False, disk_kv_cache_dir=tmp_path / "small", disk_vit_cache_bytes=64 << 20)
    for i, shot in enumerate(shots[:2]):
        small.chat(images=[shot], prompt=f"turn {i}", max_new_tokens=1)
    pre, _ = small.prefill(small.build_prompt([user_message([shots[0]], "again")]))
    small.pool.free_sequence(pre.seq)
    assert pre.metrics.vit_disk_hits == 1 and pre.metrics.vit_host_hits == 0 and pre.metrics.vit_calls == 0


def _pixels(engine, image):
    from samcache.engine.images import prepare_image

    prepared = prepare_image(image, engine.geometry, engine._preprocess)
    inputs = engine.processor.image_processor(images=[prepared.pixels], return_tensors="pt",
                                              input_data_format="channels_last")
    return inputs["pixel_values"], inputs["image_grid_thw"]


def test_a_full_disk_drops_the_item_cleanly(tmp_path, monkeypatch):
    import errno

    import samcache.cache.tiers.disk as disk_module

    ns = Namespace("m", "t")
    key = ns.key(hash_bytes(b"x"))
    tiers = LowerTiers(0, disk=DiskTier(tmp_path, 1 << 20, qtype=None))

    class Full:
        def __init__(self, fd, mode):
            os.close(fd)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.os, "fdopen", Full)
    with pytest.warns(RuntimeWarning, match="cannot write an item"):
        tiers.demote(ns, key, torch.randn(2, 2, 4, 1, 8), position=0, check=[1])
    assert tiers.stats["dropped"] == 1 and tiers.disk.stats()["failed"] == 1
    assert list(tmp_path.iterdir()) == []  # nothing half-written stays
    assert tiers.fetch(ns, key, [1]) is None  # recomputed, never read


def test_concurrent_demotion_fetch_and_prefetch_keep_the_tiers_consistent(tmp_path):
    """Threads demote, fetch and prefetch the same items at once: the accounting holds and every
    fetched item is exactly what was demoted under its key (lossless tiers)."""
    import random
    import threading

    ns = Namespace("m", "t")
    keys = [ns.key(hash_bytes(bytes([i]))) for i in range(12)]
    values = {k: torch.full((2, 2, 8, 1, 8), float(i)) for i, k in enumerate(keys)}
    item = values[keys[0]].numel() * 4
    tiers = LowerTiers(host_bytes=3 * item, disk=DiskTier(tmp_path, 1 << 22, qtype=None))
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(150):
                k = rng.choice(keys)
                op = rng.random()
                if op < 0.45:
                    tiers.demote(ns, k, values[k], position=1, check=[2])
                elif op < 0.85:
                    got = tiers.fetch(ns, k, [2])
                    if got is not None and not torch.equal(got.kv, values[k]):
                        errors.append(f"wrong KV for {k}")
                else:
                    tiers.prefetch([(ns, rng.choice(keys), [2]) for _ in range(3)])
                if rng.random() < 0.05:
                    tiers.check_invariants()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tiers.close()
    assert errors == []
    tiers.check_invariants()
    for k in keys:  # whatever survived is exact
        got = tiers.fetch(ns, k, [2])
        assert got is None or torch.equal(got.kv, values[k])


def test_publishing_runs_beside_the_turn_and_flush_waits_for_it():
    """A slow shared store: publish returns at once (the KV already copied), the put happens in
    the publisher thread, flush waits for it, and the item read back is what was published."""
    import threading

    from samcache.cache.tiers import RemoteStore, RemoteTier

    gate = threading.Event()

    class Slow(RemoteStore):
        def __init__(self):
            self.items = {}

        def put(self, key, data):
            gate.wait(10)
            self.items.setdefault(key, data)
            return True

        def get(self, key):
            return self.items.get(key)

        def exists(self, key):
            return key in self.items

        def remove(self, key):
            return self.items.pop(key, None) is not None

    ns = Namespace("m", "t")
    key = ns.key(hash_bytes(b"slow"))
    tiers = LowerTiers(0, remote=RemoteTier(Slow(), qtype=None))
    kv = torch.randn(2, 2, 5, 1, 8)
    assert tiers.publish(ns, key, kv, position=3, check=[1])
    kv.zero_()  # the caller's blocks are reused: the copy was taken already
    assert tiers.stats["published"] == 0 and (ns, key) not in tiers.remote
    gate.set()
    tiers.flush()
    assert tiers.stats["published"] == 1
    got = tiers.fetch(ns, key, [1])
    assert got is not None and got.position == 3 and torch.count_nonzero(got.kv) > 0
    tiers.close()


class _MemoryStore:
    """A RemoteStore in a dict (the interface is samcache's own), counting gets; ``down`` makes
    every call fail as an unreachable store does."""

    def __new__(cls):
        from samcache.cache.tiers import RemoteStore, RemoteStoreError

        class Store(RemoteStore):
            def __init__(self):
                self.items, self.gets, self.down = {}, 0, False

            def _check(self):
                if self.down:
                    raise RemoteStoreError("store unreachable")

            def put(self, key, data):
                self._check()
                return self.items.setdefault(key, bytes(data)) == bytes(data)

            def get(self, key):
                self._check()
                self.gets += 1
                return self.items.get(key)

            def exists(self, key):
                self._check()
                return key in self.items

            def remove(self, key):
                self._check()
                return self.items.pop(key, None) is not None

        return Store()


def test_a_failed_publish_is_offered_again_and_a_missing_item_is_looked_up_once(tmp_path):
    import warnings

    from samcache.cache.tiers import RemoteTier
    from samcache.cache.tiers.prefix import PrefixTier

    store = _MemoryStore()
    ns = Namespace("m", "t")
    tier = PrefixTier(1 << 20, remote=RemoteTier(store, qtype=None, retry_after_s=0.0), namespace=ns)
    block, kv = bytes(16), torch.randn(2, 2, 16, 1, 8)
    store.down = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tier.publish([(block, kv)])
        tier.flush()
    assert tier.stats["published"] == 0 and not tier.published(block)  # not in the store: not marked
    store.down = False
    assert tier.publish([(block, kv)]) == 1
    tier.flush()
    assert tier.published(block) and tier.stats["published"] == 1 and tier.publish([(block, kv)]) == 0
    tier.close()
    # A lift that finds nothing tells the fetch waiting for it: one lookup of the store, not two.
    lower = LowerTiers(1 << 20, remote=RemoteTier(store, qtype=None))
    key = ns.key(hash_bytes(b"never computed"))
    lower.prefetch([(ns, key, [1])])[0].result()  # the lift is over before the fetch looks
    assert lower.fetch(ns, key, [1]) is None and store.gets == 1 and lower.stats["misses"] == 1
    lower.prefetch([(ns, key, [1])])
    assert lower.fetch(ns, key, [1]) is None and store.gets == 2  # or still on its way: one lookup each time
    assert lower.fetch(ns, key, [1]) is None and store.gets == 3  # no plan: a plain lookup
    lower.close()


def test_a_lift_that_cannot_fit_moves_nothing(tmp_path):
    """Host room for two items, one of them protected by the plan: a lift of a larger item is not
    kept, and the unprotected item stays in host memory (it is not spilled for nothing)."""
    ns = Namespace("m", "t")
    small, big = torch.randn(2, 2, 10, 1, 8), torch.randn(2, 2, 15, 1, 8)
    unit = small.numel() * 4
    keys = [ns.key(hash_bytes(bytes([i]))) for i in range(3)]
    tiers = LowerTiers(host_bytes=2 * unit, disk=DiskTier(tmp_path, 1 << 20, qtype=None))
    try:
        tiers.demote(ns, keys[2], big, position=0, check=[2])
        tiers.demote(ns, keys[0], small, position=0, check=[0])
        tiers.demote(ns, keys[1], small, position=0, check=[1])  # the oldest, keys[2], goes to disk
        assert tiers.in_host(keys[0]) and tiers.in_host(keys[1]) and keys[2] in tiers.disk
        done = tiers.prefetch([(ns, keys[0], [0]), (ns, keys[2], [2])])  # keys[0] protected, keys[2] lifted
        assert [f.result() for f in done] == [False]  # found on disk, no room beside the protected item
        assert tiers.in_host(keys[0]) and tiers.in_host(keys[1]) and tiers.stats["to_disk"] == 1
        tiers.check_invariants()
    finally:
        tiers.close()
