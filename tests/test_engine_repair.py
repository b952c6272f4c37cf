"""The repair methods inside the engine, on the shipped trained checkpoint (6 layers): the
deviation method picks the later layers' rows in the forward from the keys it just computed, the
isolated method keeps KV computed without left context, the store remembers at which index an
image was computed, and the engine refuses settings that do not fit the method."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from samcache.cache.block_pool import slot_ids
from samcache.engine.prompt import user_message
from samcache.engine.fidelity import reference_prefill
from samcache.hashing import Namespace
from samcache.recompute import Boundary, Deviation, key_deviation, span_positions
from samcache.tasks import visual_qa
from samcache.tasks.checkpoint import trained_model

from engine_helpers import assert_clean, make_engine  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return trained_model()


def shots(*seeds):
    return [visual_qa.render(visual_qa._random_gui(np.random.default_rng(s), (84, 84))) for s in seeds]


def turn(system, images, question="Which screenshot shows a Save button?"):
    return [{"role": "system", "content": system}, user_message(images, question)]


def test_deviation_picks_the_later_layers_rows_from_the_fresh_keys_of_its_check_layer(model):
    engine = make_engine(model, recompute_ratio=0.3, recompute_method="deviation", keep_image_order=False)
    a, b, c = shots(1, 2, 3)
    engine.chat(messages=turn("You operate a computer.", [a, b]), max_new_tokens=1)
    prompt = engine.build_prompt(turn("You operate a computer. Step 2.", [b, c, a]))
    ex, r, bs = engine.executor, engine.runner, engine.pool.block_size
    ns = Namespace(engine.model_id)
    pre = ex.prepare(prompt, ns, engine.request_options())
    plan, step = pre.plan, pre.step
    assert plan.select_layer == 1 and step.select is not None and step.select.layer == 1
    reused = span_positions(plan.reused_spans)
    assert reused.size == 2 * prompt.images[0].length  # a and b spliced, c new
    quota = plan.recompute.quota
    assert quota[0] == quota[1] == reused.size and quota[2] == int(np.ceil(0.3 * reused.size))
    slots = slot_ids(engine.pool.block_table(pre.seq), reused, bs)
    spliced = r.layer_keys(1, slots).clone()
    ran = []
    choose = step.select.choose
    step.select.choose = lambda deviation: ran.append(deviation.copy()) or choose(deviation)
    for l in range(2, r.num_layers):  # poisoned: the forward must fill them in
        step.layer_rows[l] = plan.new_rows.copy()
    ex.forward([step])
    assert len(ran) == 1  # the selection ran, once, in the forward
    fresh = r.layer_keys(1, slots)
    ref, _ = reference_prefill(ex, prompt, engine.model_id, ns)
    # Layer 0 recomputed every reused token, so layer 1's fresh keys are a full prefill's.
    torch.testing.assert_close(fresh, r.layer_keys(1, slot_ids(engine.pool.block_table(ref.seq), reused, bs)),
                               atol=2e-3, rtol=2e-3)
    deviation = key_deviation(spliced, fresh).double().numpy()
    np.testing.assert_allclose(ran[0], deviation, rtol=1e-6)
    assert deviation.max() > 0  # the images moved: their deeper keys are wrong
    top = reused[np.argsort(-deviation, kind="stable")]
    for l in range(2, r.num_layers):
        assert step.layer_rows[l].tolist() == np.union1d(plan.new_rows, top[:quota[l]]).tolist()
    assert pre.metrics.recomputed_token_layers == sum(quota)
    for seq in (pre.seq, ref.seq):
        engine.pool.free_sequence(seq)
    # Through chat: the same turn, counted the same way.
    out = engine.chat(messages=turn("You operate a computer. Step 2.", [b, c, a]), max_new_tokens=2)
    assert out.metrics.recomputed_token_layers == sum(quota)
    assert_clean(engine)


def test_isolated_keeps_image_kv_computed_without_left_context(model):
    engine = make_engine(model, recompute_ratio=0.0, recompute_method="isolated", keep_image_order=False)
    a, b = shots(4, 5)
    first = engine.chat(messages=turn("You operate a computer.", [a, b]), max_new_tokens=1)
    prompt = engine.build_prompt(turn("You operate a computer.", [a, b]))
    assert first.metrics.isolated_tokens == sum(s.length + 1 for s in prompt.images)
    store, r, bs = engine.image_kv_store, engine.runner, engine.pool.block_size
    ns = Namespace(engine.model_id)
    for span in prompt.images:
        held = store.get(ns.key(span.image.content), check=engine.executor.kv_check(span))
        assert held is not None and held.index is None  # computed alone
        got_k, got_v = r.gather_kv(store.slots(held, 0, held.length))
        # The reference: the frame token and the image, nothing before them.
        alone = engine.build_prompt(turn("x", [a if span.index == 0 else b]))
        lo, hi = alone.images[0].start - 1, alone.images[0].end
        alone.token_ids, alone.positions = alone.token_ids[lo:hi], alone.positions[:, lo:hi]
        alone.images[0].start, alone.images[0].index = 1, 0
        ref, _ = reference_prefill(engine.executor, alone, engine.model_id, ns)
        ref_k, ref_v = r.gather_kv(slot_ids(engine.pool.block_table(ref.seq), np.arange(1, hi - lo), bs))
        # Keys sit at other positions (re-rotation moves them); values do not depend on position.
        torch.testing.assert_close(got_v, ref_v, atol=2e-3, rtol=2e-3)
        engine.pool.free_sequence(ref.seq)
        if span.index == 1:  # the second image saw the first in context: its stored KV differs
            pre, _ = reference_prefill(engine.executor, prompt, engine.model_id, ns)
            ctx_k, ctx_v = r.gather_kv(slot_ids(engine.pool.block_table(pre.seq), np.arange(span.start, span.end), bs))
            assert not torch.allclose(ctx_v[-1], got_v[-1], atol=1e-3)
            engine.pool.free_sequence(pre.seq)
    # The next turn reuses both, each flagged as moved (nothing was before them when computed).
    again = engine.build_prompt(turn("You operate a computer, step 2.", [a, b]))
    pre, _ = engine.prefill(again)
    assert pre.metrics.image_kv_hits == 2 and all(s.moved for s in pre.plan.spliced)
    engine.pool.free_sequence(pre.seq)
    assert_clean(engine)


def test_the_store_remembers_the_index_an_image_was_computed_at(model):
    engine = make_engine(model, recompute_ratio=0.2, recompute_method="boundary", keep_image_order=False)
    a, b, c = shots(6, 7, 8)
    engine.chat(messages=turn("You operate a computer.", [a, b]), max_new_tokens=1)
    prompt = engine.build_prompt(turn("You operate a computer. Step 2.", [a, c, b]))
    pre, _ = engine.prefill(prompt)
    moved = {s.image: s.moved for s in pre.plan.spliced}
    assert moved == {0: False, 2: True}  # a kept index 0; b went from index 1 to 2
    # Boundary spends the whole first-layer quota on b, front to back.
    b_span = prompt.images[2]
    q = pre.plan.recompute.quota[0]
    assert pre.plan.recompute.positions(0).tolist() == list(range(b_span.start, b_span.start + q))
    engine.pool.free_sequence(pre.seq)
    assert_clean(engine)


def test_the_engine_refuses_settings_that_do_not_fit_the_method(model):
    with pytest.raises(ValueError, match="unknown recompute method 'blend'"):
        make_engine(model, recompute_method="blend")
    with pytest.raises(ValueError, match="head_fraction shape recompute_method='two-track', not 'boundary'"):
        make_engine(model, recompute_method="boundary", head_fraction=0.2)
    with pytest.raises(ValueError, match="recompute_tracks"):
        make_engine(model, recompute_method="deviation", recompute_tracks="heads")
    with pytest.raises(ValueError, match="check_layer 6 needs a model deeper than its 6 layers"):
        make_engine(model, recompute_method=Deviation(check_layer=6))
    engine = make_engine(model, recompute_method=Boundary())
    assert engine.recompute_method == "boundary" and engine.request_options().isolated_images is False
    assert make_engine(model, recompute_method="isolated").request_options().isolated_images is True


@pytest.mark.parametrize("method", ["deviation", "isolated"])
def test_methods_that_change_the_step_or_the_store_refuse_compression(tiny_checkpoints, method):
    with pytest.raises(ValueError, match=f"recompute_method '{method}' does not combine with compression_enabled"):
        make_engine(tiny_checkpoints["qwen3_vl_moe"], compression_enabled=True, recompute_method=method)
    make_engine(tiny_checkpoints["qwen3_vl_moe"], compression_enabled=True, recompute_method="boundary")


def test_the_engine_plans_through_the_shared_per_request_path(model, monkeypatch):
    import samcache.engine.executor as executor

    calls = []
    real = executor.plan_request
    monkeypatch.setattr(executor, "plan_request", lambda *a, **k: calls.append(k["lookup"] is not None) or real(*a, **k))
    engine = make_engine(model, recompute_ratio=0.1, keep_image_order=False)
    a, b = shots(11, 12)
    engine.chat(messages=turn("One.", [a, b]), max_new_tokens=1)
    r = engine.chat(messages=turn("Two.", [b, a]), max_new_tokens=1)
    assert calls == [True, True] and r.metrics.image_kv_hits == 2


def test_the_forward_refuses_a_plan_whose_declared_second_phase_is_not_done(model):
    from dataclasses import replace

    engine = make_engine(model, recompute_ratio=0.3, recompute_method="two-track", keep_image_order=False)
    a, b = shots(1, 2)
    engine.chat(messages=turn("You operate a computer.", [a, b]), max_new_tokens=1)
    prompt = engine.build_prompt(turn("You operate a computer. Step 2.", [b, a]))
    pre = engine.executor.prepare(prompt, Namespace(engine.model_id), engine.request_options())
    assert not pre.plan.needs_scores and pre.plan.recompute is not None  # prepare completed it
    incomplete = replace(pre.plan, needs_scores=True)
    table = engine.pool.block_table(pre.seq)
    with pytest.raises(RuntimeError, match="reuse plan is incomplete"):
        engine.executor.sequence_step(prompt, incomplete, table, pre.vit)
    engine.executor.sequence_step(prompt, pre.plan, table, pre.vit)  # the complete one runs
    engine.executor.discard_prepared(pre)
