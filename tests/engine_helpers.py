"""Helpers shared by the engine test modules (imported by them; not a test module)."""

from samcache.engine import SAMcacheEngine

SIZE = (112, 168)  # small screenshots: 24-90 image tokens each on the tiny models


def make_engine(path, **kw):
    """An engine for tests: CPU, a 16 MiB pool, the uniform budget and reuse at any index unless told otherwise."""
    kw.setdefault("recompute_budget", "uniform")
    # Random weights carry no image order to protect: these tests exercise reuse at any index, so they
    # say so (without a profile the engine keeps the order: tests/test_reuse_profile.py).
    kw.setdefault("keep_image_order", False)
    if "num_blocks" not in kw:
        kw.setdefault("kv_cache_bytes", 16 << 20)
    kw.setdefault("device", "cpu")
    return SAMcacheEngine(path, **kw)


def assert_clean(engine):
    """Pool and stores consistent, and no sequence left behind but the image-KV store's holders."""
    engine.check_invariants()
    assert engine.pool.stats()["live_sequences"] == len(engine.image_kv_store)
