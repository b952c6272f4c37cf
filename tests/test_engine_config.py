"""The engine's settings as groups (samcache.engine.config): each group checks itself without a
model, the flat keywords land in the field they name, and an engine built from groups is the
engine built from the same keywords."""

import dataclasses
import inspect

import pytest

pytest.importorskip("transformers")

from samcache.engine import (CacheConfig, CompressionConfig, EngineConfig, EvictionConfig,  # noqa: E402
                             RecomputeConfig, SAMcacheEngine, TierConfig)
from samcache.engine.config import GROUPS, KEYWORDS  # noqa: E402
from samcache.policies import PriorityLRUPolicy  # noqa: E402
from samcache.recompute.methods import Deviation  # noqa: E402

from engine_helpers import make_engine  # noqa: E402


def test_the_constructor_takes_at_most_twelve_parameters():
    params = [p for p in inspect.signature(SAMcacheEngine.__init__).parameters if p != "self"]
    assert len(params) <= 12, params


def test_every_keyword_names_a_field_of_its_group_and_every_field_has_one():
    for keyword, (group, name) in KEYWORDS.items():
        assert name in {f.name for f in dataclasses.fields(GROUPS[group])}, keyword
    covered = {(group, name) for group, name in KEYWORDS.values()}
    for group, kind in GROUPS.items():
        for f in dataclasses.fields(kind):
            assert (group, f.name) in covered, (group, f.name)
    assert len(covered) == len(KEYWORDS)  # one keyword a field


@pytest.mark.parametrize("build, error, match", [
    (lambda: CacheConfig(block_size=0), ValueError, "block_size must be an int >= 1"),
    (lambda: CacheConfig(num_blocks=8, kv_cache_bytes=1 << 20), ValueError, "num_blocks or kv_cache_bytes"),
    (lambda: CacheConfig(prefix_reuse="sometimes"), ValueError, "prefix_reuse must be"),
    (lambda: CacheConfig(enabled="yes"), TypeError, "cache_enabled must be a bool"),
    (lambda: CacheConfig(model_id=""), ValueError, "model_id must be a non-empty str"),
    (lambda: CacheConfig(tenant=3), TypeError, "tenant must be"),
    (lambda: RecomputeConfig(ratio=1.5), ValueError, r"recompute_ratio must be a number in \[0, 1\]"),
    (lambda: RecomputeConfig(budget="greedy"), ValueError, "recompute_budget must be"),
    (lambda: RecomputeConfig(method="cacheblend"), ValueError, "cacheblend"),
    (lambda: RecomputeConfig(method="boundary", head_fraction=0.3), ValueError, "head_fraction shape"),
    (lambda: RecomputeConfig(tracks="all"), ValueError, "recompute_tracks must be"),
    (lambda: RecomputeConfig(relevance="random"), ValueError, "recompute_relevance must be"),
    (lambda: RecomputeConfig(keep_image_order="sometimes"), TypeError, "keep_image_order must be"),
    (lambda: CompressionConfig(enabled=1), TypeError, "compression_enabled must be a bool"),
    (lambda: TierConfig(host_kv_cache_bytes=-1), ValueError, "host_kv_cache_bytes must be an int >= 0"),
    (lambda: TierConfig(cold_kv_qtype="fp4"), ValueError, "cold_kv_qtype must be"),
    (lambda: TierConfig(disk_vit_cache_bytes=1 << 20), ValueError, "need disk_kv_cache_dir"),
    (lambda: TierConfig(remote_kv_store="redis://x"), TypeError, "remote_kv_store must be"),
    (lambda: EvictionConfig(policy="fifo"), ValueError, "fifo"),
    (lambda: EvictionConfig(policy=PriorityLRUPolicy(), options={"alpha": 1}), ValueError, "go with a policy name"),
    (lambda: EvictionConfig(prefetch_horizon=-1), ValueError, "prefetch_horizon must be an int >= 0"),
])
def test_each_group_checks_itself(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_keywords_land_in_their_group_and_override_a_group_given_beside_them():
    config = EngineConfig.resolve({"recompute": RecomputeConfig(ratio=0.2, method="boundary")},
                                  {"recompute_ratio": 0.1, "num_blocks": 64, "eviction_policy": "priority-lru"})
    assert config.recompute.ratio == 0.1 and config.recompute.method == "boundary"  # the keyword wins its field only
    assert config.cache.num_blocks == 64 and config.eviction.policy == "priority-lru"
    assert config.tiers == TierConfig() and config.compression == CompressionConfig()
    with pytest.raises(TypeError, match="unexpected keyword argument 'recompute_rate'"):
        EngineConfig.resolve({}, {"recompute_rate": 0.1})
    with pytest.raises(TypeError, match="cache must be a samcache.engine.config.CacheConfig"):
        EngineConfig.resolve({"cache": {"num_blocks": 64}}, {})
    with pytest.raises(ValueError, match="needs compression_enabled=True"):  # a check across two groups
        EngineConfig.resolve({}, {"recompute_relevance": "routing"})


def test_an_engine_from_groups_is_the_engine_from_keywords(tiny_checkpoints):
    path = tiny_checkpoints["qwen2_5_vl"]
    flat = make_engine(path, recompute_ratio=0.1, recompute_method=Deviation(check_layer=1), keep_image_order=True,
                       num_blocks=48, vit_cache_bytes=1 << 20, eviction_policy="priority-lru", tenant="t")
    grouped = SAMcacheEngine(path, device="cpu",
                             cache=CacheConfig(num_blocks=48, vit_cache_bytes=1 << 20, tenant="t"),
                             recompute=RecomputeConfig(ratio=0.1, budget="uniform", method=Deviation(check_layer=1),
                                                       keep_image_order=True),
                             eviction=EvictionConfig(policy="priority-lru"))
    assert grouped.config == flat.config
    assert grouped.request_options() == flat.request_options()
    assert (grouped.pool.num_blocks, grouped.tenant, grouped.keeps_image_order()) == (48, "t", True)
    assert grouped.recompute_method == "deviation" and grouped.eviction_policy.name == "priority-lru"
    with pytest.raises(ValueError, match="check_layer 9 needs a model deeper"):  # checked against the model
        SAMcacheEngine(path, device="cpu", recompute=RecomputeConfig(method=Deviation(check_layer=9)))
