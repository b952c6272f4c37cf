"""What the engine keeps apart, refuses, or survives: edge-shaped images, tenants, calibration
that cannot reuse, full pools, mismatched weights or curves, failures, and bad arguments."""

import json
import math
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from samcache import Namespace  # noqa: E402
from samcache.engine import SAMcacheEngine, screenshot  # noqa: E402
from samcache.engine.prompt import user_message  # noqa: E402
from samcache.random_checkpoints import build_tiny_model  # noqa: E402

from engine_helpers import SIZE, make_engine  # noqa: E402
from engine_helpers import assert_clean as clean  # noqa: E402


@pytest.fixture(scope="module")
def path(tiny_checkpoints):
    return tiny_checkpoints["qwen2_5_vl"]


@pytest.mark.parametrize("shape", [(3, 150, 3), (1, 120, 3), (150, 3, 3)])
def test_images_one_or_three_pixels_tall_are_read_channels_last(path, shape):
    engine = make_engine(path)
    rng = np.random.default_rng(sum(shape))
    image = rng.integers(0, 256, shape, dtype=np.uint8)
    r = engine.chat(images=[image], prompt="What is this?", max_new_tokens=1)
    assert r.metrics.vit_calls == 1
    span = engine.build_prompt([user_message([image], "What is this?")]).images[0]
    cached = engine.vit_store.get(Namespace(engine.model_id).key(span.image.content), check=span.image.grid)
    inputs = engine.processor.image_processor(images=[image], return_tensors="pt", input_data_format="channels_last")
    assert tuple(inputs["image_grid_thw"][0].tolist()) == tuple(span.image.grid)
    expected = engine.runner.encode_images(inputs["pixel_values"], inputs["image_grid_thw"])[0]
    torch.testing.assert_close(cached[0], expected[0], atol=0, rtol=0)
    clean(engine)


def test_vit_outputs_are_not_shared_across_tenants(path):
    engine = make_engine(path)
    shot = screenshot(5, SIZE)
    engine.chat(images=[shot], prompt="alice looks", max_new_tokens=1, tenant="alice")
    r = engine.chat(images=[shot], prompt="mallory looks", max_new_tokens=1, tenant="mallory")
    assert r.metrics.vit_hits == 0 and r.metrics.vit_calls == 1 and r.metrics.image_kv_hits == 0
    r = engine.chat(images=[shot], prompt="alice again", max_new_tokens=1, tenant="alice")
    assert r.metrics.vit_calls == 0 and r.metrics.image_kv_hits == 1
    # the fidelity reference reads the turn's tenant's ViT outputs but never adds any
    before = len(engine.vit_store)
    r = engine.chat(images=[shot, screenshot(6, SIZE)], prompt="alice, fidelity", max_new_tokens=1, tenant="alice",
                    fidelity=True, fidelity_tokens=1)
    assert r.metrics.fidelity is not None and len(engine.vit_store) == before + 1
    clean(engine)


def test_heads_only_recomputes_exactly_the_span_heads(path, monkeypatch):
    engine = make_engine(path, recompute_ratio=0.5, recompute_tracks="heads")
    images = [screenshot(80, SIZE), screenshot(81, SIZE)]
    engine.chat(messages=[{"role": "system", "content": "One."}, user_message(images, "a")], max_new_tokens=1)
    second = [{"role": "system", "content": "Another, longer system prompt."}, user_message(images[::-1], "b")]
    prompt = engine.build_prompt(second)
    seen = []
    real = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda batch: seen.append(batch.all_rows.meta.q_pos.clone()) or real(batch))
    r = engine.chat(messages=second, max_new_tokens=1)
    assert r.metrics.image_kv_hits == 2
    computed = set(seen[0].tolist())
    in_images = {p for s in prompt.images for p in range(s.start, s.end)}
    heads = {s.start + k for s in prompt.images for k in range(math.ceil(0.1 * s.length))}
    assert computed & in_images == heads  # track 1 only, whatever the ratio
    clean(engine)


def test_calibration_runs_on_its_own_state_and_leaves_the_engines_untouched(path):
    engine = make_engine(path, recompute_budget="layer-aware")
    engine.chat(images=[screenshot(90, SIZE)], prompt="serve one turn first", max_new_tokens=2)
    bits = lambda t: t.view(torch.int32).clone()  # noqa: E731  (bitwise: unwritten slots may hold NaN)
    pool_before, k_before, v_before = engine.pool.stats(), bits(engine.runner.k_cache), bits(engine.runner.v_cache)
    stores_before = (len(engine.vit_store), len(engine.image_kv_store), engine.image_kv_store.used_bytes)
    curves = engine.calibrate(rates=(0.0, 1.0), progress=False)
    assert engine.sensitivity is curves and curves.loss[:, 0].min() > 0  # reuse was approximate: it measured
    assert engine.pool.stats() == pool_before
    assert (len(engine.vit_store), len(engine.image_kv_store), engine.image_kv_store.used_bytes) == stores_before
    assert torch.equal(bits(engine.runner.k_cache), k_before) and torch.equal(bits(engine.runner.v_cache), v_before)
    r = engine.chat(images=[screenshot(90, SIZE)], prompt="and it still serves from its caches", max_new_tokens=1)
    assert r.metrics.vit_calls == 0 and r.metrics.image_kv_hits == 1
    clean(engine)


def test_fidelity_that_does_not_fit_the_pool_keeps_the_turn(path):
    engine = make_engine(path, num_blocks=8, kv_cache_bytes=None)
    text = "word " * 11  # 58 tokens: 4 of the 8 blocks, the reference the other 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = engine.chat(prompt=text, max_new_tokens=1, fidelity=True, fidelity_tokens=30)
    assert r.metrics.fidelity is None and len(r.token_ids) == 1
    assert any("fidelity not measured" in str(w.message) for w in caught)
    clean(engine)


def test_shared_weights_and_saved_curves_must_belong_to_the_model(path, tmp_path):
    owner = make_engine(path)
    other = build_tiny_model("qwen2_5_vl", tmp_path / "seed7", seed=7)
    with pytest.raises(ValueError, match="share_weights_with holds the weights of"):
        make_engine(other, share_weights_with=owner)
    twin = tmp_path / "copy"
    twin.mkdir()
    for f in path.iterdir():
        (twin / f.name).write_bytes(f.read_bytes())
    make_engine(twin, share_weights_with=owner)  # the same checkpoint in another folder is fine
    curves = tmp_path / "curves.json"
    curves.write_text(json.dumps({"model_id": "some-other-model", "rates": [0.0, 1.0], "loss": [[1.0, 0.0]] * 2}))
    with pytest.raises(ValueError, match="calibrated on model some-other-model"):
        make_engine(path, sensitivity=curves)


def test_a_failed_turn_evicts_only_its_own_blocks(path, monkeypatch):
    engine = make_engine(path)
    msgs = [{"role": "user", "content": "word " * 13}]
    # 64 tokens, 4 whole blocks: the retry adopts 3 (never the last token) and fills a duplicate
    # of the 4th, which is freed, not cached, when the retry fails
    assert len(engine.build_prompt(msgs)) % engine.pool.block_size == 0
    engine.chat(messages=msgs, max_new_tokens=1)
    cached = engine.pool.stats()["cached_blocks"]
    assert cached >= 2

    def boom(batch):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.runner, "forward", boom)
    with pytest.raises(RuntimeError, match="injected"):
        engine.chat(messages=msgs, max_new_tokens=1)  # adopts the cached blocks, then fails
    monkeypatch.undo()
    assert engine.pool.stats()["cached_blocks"] == cached  # the earlier turn's valid blocks stay
    r = engine.chat(messages=msgs, max_new_tokens=1)
    assert r.metrics.prefix_reused_tokens > 0
    clean(engine)


def test_bad_chat_arguments_are_clear_errors(path):
    engine = make_engine(path)
    cases = [
        (dict(messages=[]), ValueError, "messages is empty"),
        (dict(messages=[{"role": "user", "content": None}]), TypeError, "content must be a str or a list"),
        (dict(messages="hello"), TypeError, "messages must be a list"),
        (dict(prompt="x", temperature=float("nan")), ValueError, "temperature must be a finite number"),
        (dict(prompt="x", temperature=float("inf")), ValueError, "temperature must be a finite number"),
        (dict(prompt="x", seed=2**70), ValueError, "seed must be an int"),
        (dict(prompt="x", max_new_tokens=True), ValueError, "max_new_tokens must be an int"),
        (dict(prompt="x", top_p=True), ValueError, "top_p"),
        (dict(messages=[{"role": "bot", "content": "hi"}]), ValueError, "role must be one of system, user"),
        (dict(images=[np.zeros((3, 112, 168), np.uint8)], prompt="x"), ValueError, "channels first"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            engine.chat(**kwargs)
    with pytest.raises(TypeError, match="images must be a list"):
        engine.chat(images=np.zeros((56, 56, 3), np.uint8))  # one array, not a list of images
    for bad in (-1, 2**63, True):
        with pytest.raises(ValueError, match="seed must be an int"):
            make_engine(path, seed=bad)
    edge = make_engine(path, seed=2**63 - 1)
    for _ in range(2):  # the per-turn seed wraps instead of overflowing
        edge.chat(prompt="x", max_new_tokens=2, temperature=1.0)
    clean(engine)


def test_image_only_turns_and_warnings_that_point_at_the_caller(path, tmp_path):
    engine = SAMcacheEngine(path, device="cpu", kv_cache_bytes=16 << 20,  # layer-aware, not calibrated
                            keep_image_order=False)  # random weights: reuse at any index, said explicitly
    engine.chat(images=[screenshot(90, SIZE)], prompt="first", max_new_tokens=1)
    with pytest.warns(UserWarning, match="no sensitivity curves") as caught:
        r = engine.chat(images=[screenshot(91, SIZE), screenshot(90, SIZE)], max_new_tokens=1)  # no text at all
    assert r.metrics.image_kv_hits == 1 and caught[0].filename == __file__
    with pytest.raises(ValueError, match="sensitivity='.*nope.json': cannot read the curves file"):
        make_engine(path, sensitivity=tmp_path / "nope.json")
    clean(engine)


def test_warm_up_leaves_nothing_a_real_prompt_can_hit(path):
    engine = make_engine(path)
    engine.warm_up()
    assert engine.pool.stats()["cached_blocks"] == 0 and len(engine.vit_store) == len(engine.image_kv_store) == 0
    r = engine.chat(messages=[{"role": "system", "content": "A real system prompt."},
                              user_message([screenshot(92, SIZE)], "hello")], max_new_tokens=1)
    assert r.metrics.prefix_reused_tokens == 0 and r.metrics.vit_calls == 1 and r.metrics.image_kv_hits == 0
    with pytest.raises(ValueError):
        engine.warm_up(size=(4, 4))
    clean(engine)
