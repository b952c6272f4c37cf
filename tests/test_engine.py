"""The reference engine on tiny random-weight checkpoints of both families (CPU, seconds each).

Every claim of reuse is checked against a computation without it: the engine's full prefill
against transformers' own forward, and every kind of reuse against the engine's full prefill.
"""

import json
import math
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from samcache import ImageLoadError, Namespace, PromptTooLong, UnsupportedModel, ops  # noqa: E402
from samcache.engine import SAMcacheEngine, screenshot  # noqa: E402
from samcache.engine.prompt import user_message  # noqa: E402
from samcache.engine.calibration import Calibrator  # noqa: E402
from samcache.recompute import SensitivityCurves, solve_layer_budget  # noqa: E402
from samcache.engine.executor import RequestOptions  # noqa: E402
from samcache.engine.fidelity import greedy_decode, reference_prefill  # noqa: E402
from samcache.random_checkpoints import FAMILIES, build_tiny_model  # noqa: E402

from engine_helpers import SIZE, assert_clean, make_engine  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints):
    return tiny_checkpoints


@pytest.fixture(scope="module")
def engines(checkpoints):
    return {f: make_engine(p) for f, p in checkpoints.items()}


def shots(*seeds):
    return [screenshot(s, SIZE) for s in seeds]


def messages(system, images, question):
    return [{"role": "system", "content": system}, user_message(images, question)]


def full(engine, prompt):
    ref, logits = reference_prefill(engine.executor, prompt, engine.model_id, Namespace(engine.model_id))
    engine.pool.free_sequence(ref.seq)
    return logits


def second_turn(engine, first_msgs, second_msgs):
    """Run ``first_msgs`` as a turn, then prefill ``second_msgs``: (first result, prompt, prefill, logits)."""
    first = engine.chat(messages=first_msgs, max_new_tokens=1)
    prompt = engine.build_prompt(second_msgs)
    pre, logits = engine.prefill(prompt)
    engine.pool.free_sequence(pre.seq)
    return first, prompt, pre, logits


# ---- the runner against transformers ----------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_full_prefill_matches_transformers_forward(engines, family):
    engine = engines[family]
    images = shots(1, 2)
    msgs = messages("Be brief.", images, "What is on the screen?")
    prompt = engine.build_prompt(msgs)
    proc = engine.processor
    text = proc.apply_chat_template(
        [msgs[0], {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is on the screen?"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    inputs = proc(text=[text], images=images, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == prompt.token_ids.tolist()
    if engine.family.mrope:
        hf_pos, _ = engine.runner.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
        assert torch.equal(hf_pos[:, 0], prompt.positions)
    else:  # 1-D RoPE (InternVL): row 0 counts tokens; rows 1-2 place image tokens on their grid
        assert torch.equal(prompt.positions[0], torch.arange(len(prompt)))
        span = prompt.images[0]
        rows = prompt.positions[1:, span.start:span.end] - span.start
        assert rows.min() == 0 and rows[0].max() < span.length and len(set(map(tuple, rows.T.tolist()))) == span.length
    with torch.no_grad():
        hf = engine.runner.model(**inputs).logits[0, -1]
    ours = full(engine, prompt)
    torch.testing.assert_close(ours, hf, atol=1e-5, rtol=1e-5)
    assert_clean(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_matches_transformers_generate(engines, family):
    engine = engines[family]
    images = shots(3)
    msgs = [user_message(images, "Describe it.")]
    result = engine.chat(messages=msgs, max_new_tokens=6)
    proc = engine.processor
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
                                    tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        out = engine.runner.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    hf_tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert result.token_ids[: len(hf_tokens)] == hf_tokens
    assert_clean(engine)


# ---- reuse reproduces the full prefill where it must ------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_ratio_one_reproduces_full_prefill(checkpoints, family):
    engine = make_engine(checkpoints[family], recompute_ratio=1.0)
    images = shots(4, 5)
    _, prompt, pre, logits = second_turn(engine, messages("First system prompt.", images, "Look."),
                                 messages("A different, longer system prompt for turn two.", images[::-1], "Now?"))
    m = pre.metrics
    assert m.image_reused_tokens == sum(s.length for s in prompt.images) and m.prefix_reused_tokens == 0
    assert m.recomputed_tokens == m.image_reused_tokens and m.recompute_rates == [1.0] * engine.runner.num_layers
    torch.testing.assert_close(logits, full(engine, prompt), atol=1e-5, rtol=1e-5)
    assert_clean(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_prefix_reuse_reproduces_full_prefill(checkpoints, family):
    engine = make_engine(checkpoints[family], image_kv_cache=False)
    msgs = messages("Same prompt twice.", shots(6), "Same question.")
    first, prompt, pre, logits = second_turn(engine, msgs, msgs)
    bs = engine.pool.block_size
    assert first.metrics.prefix_reused_tokens == 0
    assert pre.metrics.prefix_reused_tokens == (len(prompt) - 1) // bs * bs > 0
    assert pre.metrics.vit_calls == 0 and pre.metrics.image_reused_tokens == 0
    torch.testing.assert_close(logits, full(engine, prompt), atol=1e-5, rtol=1e-5)
    assert_clean(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_at_the_same_position_with_ratio_zero_reproduces_full_prefill(checkpoints, family):
    engine = make_engine(checkpoints[family], prefix_cache=False, recompute_ratio=0.0)
    images = shots(7)
    _, prompt, pre, logits = second_turn(engine, messages("Fixed system prompt.", images, "First question?"),
                                 messages("Fixed system prompt.", images, "A second question."))
    assert pre.metrics.image_reused_tokens == prompt.images[0].length and pre.metrics.recomputed_tokens == 0
    torch.testing.assert_close(logits, full(engine, prompt), atol=1e-5, rtol=1e-5)
    assert_clean(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_rerotated_kv_at_a_new_position_equals_the_first_layer_of_a_full_prefill(checkpoints, family):
    engine = make_engine(checkpoints[family], recompute_ratio=0.0)
    images = shots(8, 9)
    engine.chat(messages=messages("Short.", images, "Look."), max_new_tokens=1)
    prompt = engine.build_prompt(messages("A much longer system prompt that moves every image.", images[::-1], "Q?"))
    pre, _ = engine.prefill(prompt)
    ref, _ = reference_prefill(engine.executor, prompt, engine.model_id, Namespace(engine.model_id))
    r = engine.runner
    moved = [s for s in prompt.images]
    reused = sum(s.length for s in moved)
    # no ViT ran and no image token was computed: only the spliced KV can hold the images' keys
    assert pre.metrics.image_reused_tokens == reused and pre.metrics.vit_calls == 0
    assert pre.metrics.prefilled_tokens == len(prompt) - reused
    for layer in range(r.num_layers):
        got_k, got_v = ops.paged_gather(r.k_cache[layer], r.v_cache[layer], engine.pool.block_table(pre.seq), len(prompt))
        ref_k, ref_v = ops.paged_gather(r.k_cache[layer], r.v_cache[layer], engine.pool.block_table(ref.seq), len(prompt))
        for span in moved:
            sl = slice(span.start, span.end)
            if layer == 0:  # no left context has flowed in yet: re-rotation alone must be exact
                torch.testing.assert_close(got_k[sl], ref_k[sl], atol=2e-5, rtol=1e-5)
                torch.testing.assert_close(got_v[sl], ref_v[sl], atol=1e-6, rtol=1e-6)
            else:  # deeper layers saw another context: reuse is an approximation there
                assert not torch.allclose(got_k[sl], ref_k[sl], atol=1e-4)
    engine.pool.free_sequence(pre.seq)
    engine.pool.free_sequence(ref.seq)
    assert_clean(engine)


def test_keep_image_order_reuses_an_image_only_at_its_own_index(checkpoints):
    engine = make_engine(checkpoints["qwen2_5_vl"], keep_image_order=True, recompute_ratio=0.0)
    a, b = shots(12, 13)
    engine.chat(messages=messages("First.", [a, b], "Look."), max_new_tokens=1)
    # the same two images, swapped: each is at another index, so no KV is reused, only ViT outputs
    prompt = engine.build_prompt(messages("Another system prompt.", [b, a], "Now?"))
    pre, logits = engine.prefill(prompt)
    m = pre.metrics
    assert m.image_kv_hits == 0 and m.image_kv_misses == 2 and m.vit_calls == 0 and m.vit_hits == 2
    assert m.image_reused_tokens == 0 and m.prefix_reused_tokens < prompt.images[0].start + 1
    torch.testing.assert_close(logits, full(engine, prompt), atol=1e-5, rtol=1e-5)  # all computed: exact
    engine.pool.free_sequence(pre.seq)
    # each image at its first index again, after other text: both reused
    r = engine.chat(messages=messages("A third, much longer system prompt for the next agent.", [a, b], "Q?"),
                    max_new_tokens=1)
    assert r.metrics.image_kv_hits == 2 and r.metrics.image_reused_tokens > 0 and r.metrics.vit_calls == 0
    # the option off: the swapped images' KV is reused at any index
    free = make_engine(checkpoints["qwen2_5_vl"], recompute_ratio=0.0)
    free.chat(messages=messages("First.", [a, b], "Look."), max_new_tokens=1)
    r = free.chat(messages=messages("Another system prompt.", [b, a], "Now?"), max_new_tokens=1)
    assert r.metrics.image_kv_hits == 2
    with pytest.raises(TypeError, match="keep_image_order"):
        make_engine(checkpoints["qwen2_5_vl"], keep_image_order="yes")
    with pytest.raises(TypeError, match="keep_image_order"):
        RequestOptions(keep_image_order=1)
    assert_clean(engine)
    assert_clean(free)


def test_keep_image_order_auto_follows_the_calibrations_image_order_check(checkpoints):
    from samcache.recompute.image_order import ImageOrderCheck

    path = checkpoints["qwen2_5_vl"]
    L = make_engine(path).runner.num_layers
    rates, nan = np.array([0.0, 0.2, 0.5, 1.0]), np.nan
    # Reuse at another index changed confident tokens up to 0.5 with the solved rates, only at 0
    # with uniform ones; recomputing everything changed none.
    order = ImageOrderCheck(rates, [[10, 10], [50, 100], [80, 100], [100, 100]], confident=100, pairs=2)
    checked = [[nan, nan], [0.1, 0.5], [0.5, 0.1], [nan, nan]]  # end to end, uniform won at 0.5 only
    curves = SensitivityCurves(rates, np.ones((L, 4)), checked=checked, image_order=order)
    a, b = shots(14, 15)

    def swapped_hits(**kw) -> int:
        engine = make_engine(path, **{"keep_image_order": "auto", **kw})
        engine.chat(messages=messages("First.", [a, b], "Look."), max_new_tokens=1)
        hits = engine.chat(messages=messages("Another system prompt.", [b, a], "Now?"), max_new_tokens=1).metrics.image_kv_hits
        assert_clean(engine)
        return hits

    layer_aware = dict(recompute_budget="layer-aware", sensitivity=curves)
    assert swapped_hits(recompute_ratio=0.2, **layer_aware) == 0  # solved rates at 0.2: order kept
    assert swapped_hits(recompute_ratio=0.5, **layer_aware) == 2  # the check's uniform rates at 0.5: repaired
    assert swapped_hits(recompute_ratio=0.2, recompute_budget="uniform", sensitivity=curves) == 2
    assert swapped_hits(recompute_ratio=0.2, keep_image_order=False, **layer_aware) == 2  # told, not auto
    # No curves and no profile: the order is kept (exact), nothing is reused at another index.
    assert swapped_hits(recompute_ratio=0.2, recompute_budget="layer-aware") == 0
    engine = make_engine(path, recompute_ratio=0.2, keep_image_order="auto", **layer_aware)
    assert [engine.keeps_image_order(r) for r in (0.0, 0.2, 0.5, 1.0)] == [True, True, False, False]
    assert engine.request_options().keep_image_order and not engine.request_options(1.0).keep_image_order
    with pytest.raises(ValueError, match="recompute_ratio"):
        engine.keeps_image_order(1.5)
    with pytest.raises(TypeError, match="True, False or 'auto'"):
        make_engine(path, keep_image_order="always")


def test_calibration_checks_image_order_on_the_pairs_where_an_index_changed(checkpoints, tmp_path):
    engine = make_engine(checkpoints["qwen2_5_vl"], recompute_budget="layer-aware")
    moved = (messages("You are an agent.", shots(80, 81), "Step 1?"), messages("You are an agent.", shots(81, 82), "Step 2?"))
    kept = (messages("Plan.", shots(83, 84), "a"), messages("Sub-agent 1 of a planner.", shots(83, 85), "b"))
    rates = (0.0, 0.5, 1.0)
    curves = engine.calibrate(requests=[moved, kept], rates=rates, continuation=6, progress=False,
                              save=tmp_path / "curves.json")
    order = curves.image_order
    assert order.pairs == 1 and 0 <= order.confident <= 6  # the moved pair's reference tokens only
    assert np.isfinite(order.agreed).all() and (order.agreed <= order.confident).all()  # 0, 0.5 and 1: all measured
    assert order.agreed[-1, 0] == order.confident  # recomputing everything keeps every confident token
    # A random-weight model is rarely confident: too few tokens to give up reuse at another index.
    assert not engine.keeps_image_order() and order.confident < 50
    loaded = make_engine(checkpoints["qwen2_5_vl"], sensitivity=tmp_path / "curves.json")
    assert np.array_equal(loaded.sensitivity.image_order.agreed, order.agreed)
    # Pairs whose images all keep their index, or no end-to-end check: nothing to say.
    assert engine.calibrate(requests=[kept], rates=rates, continuation=2, progress=False).image_order is None
    assert engine.calibrate(requests=[moved], rates=rates, continuation=2, check=False, progress=False).image_order is None
    assert_clean(engine)


# ---- wrong-content safety -----------------------------------------------------------------------
def test_different_images_one_pixel_model_id_and_tenant_never_share_entries(checkpoints):
    path = checkpoints["qwen2_5_vl"]
    engine = make_engine(path)
    a, b = shots(10, 11)
    engine.chat(images=[a], prompt="first", max_new_tokens=1)
    r = engine.chat(images=[b], prompt="second", max_new_tokens=1)
    assert r.metrics.image_kv_hits == 0 and r.metrics.vit_calls == 1  # another image: a miss
    a2 = a.copy()
    a2[5, 7, 1] ^= 1
    r = engine.chat(images=[a2], prompt="third", max_new_tokens=1)
    assert r.metrics.image_kv_hits == 0 and r.metrics.vit_calls == 1 and r.metrics.prefix_reused_tokens < \
        engine.build_prompt([user_message([a2], "third")]).images[0].end  # one pixel: a miss everywhere
    r = engine.chat(images=[a], prompt="fourth", max_new_tokens=1)
    assert r.metrics.image_kv_hits == 1 and r.metrics.vit_calls == 0  # the same pixels hit
    r = engine.chat(images=[a], prompt="fourth", max_new_tokens=1, tenant="bob")
    assert r.metrics.image_kv_hits == 0 and r.metrics.prefix_reused_tokens == 0  # another tenant misses KV
    other = make_engine(path, model_id="another-model")
    other.vit_store, other.image_kv_store, other.pool, other.runner = (
        engine.vit_store, engine.image_kv_store, engine.pool, engine.runner)  # even with the same stores
    r = other.chat(images=[a], prompt="fourth", max_new_tokens=1)
    assert r.metrics.image_kv_hits == 0 and r.metrics.vit_hits == 0 and r.metrics.prefix_reused_tokens == 0
    assert engine.model_id != make_engine(build_tiny_model("qwen2_5_vl", path.parent / "seed1", seed=1)).model_id
    assert_clean(engine)


# ---- both families end to end -------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_agent_session_end_to_end(checkpoints, family):
    engine = make_engine(checkpoints[family])
    session = engine.new_session("You operate a computer.")
    window, results = [], []
    for step in range(4):  # a sliding window of the last two screenshots, the whole history resent
        window = (window + shots(20 + step))[-2:]
        r = engine.chat(images=window, prompt=f"Step {step}: what next?", session=session, max_new_tokens=4,
                        fidelity=True, ignore_eos=True)
        results.append(r)
        assert r.metrics.decode_tokens == 4 and r.finish_reason == "length"
        assert_clean(engine)
    assert len(session.messages) == 1 + 2 * 4 and session.messages[-1]["role"] == "assistant"
    m = [r.metrics for r in results]
    # Each turn encodes only its new screenshot. Its history is adopted up to the first image whose KV
    # was spliced in (never approximate KV as an exact prefix); every later screenshot of the history
    # and of the window is spliced: 1 known screenshot at turn 1, then 3, then 5.
    assert [x.vit_calls for x in m] == [1, 1, 1, 1] and [x.image_kv_misses for x in m] == [1, 1, 1, 1]
    assert [x.image_kv_hits for x in m] == [0, 1, 3, 5]
    assert m[0].prefix_reused_tokens == 0 and all(x.prefix_reused_tokens > 0 for x in m[1:])
    lengths = [s.length for s in engine.build_prompt(session.messages[:-1]).images]
    assert m[3].image_reused_tokens == sum(lengths[1:-1])  # all but the history's first and the new screenshot
    # Fidelity: the first turn reused nothing (exact); later ones are close to a full prefill, not equal.
    assert m[0].fidelity.kl < 1e-9 and m[0].fidelity.greedy_agree == 1.0 and m[0].fidelity.top1_agree
    assert all(0 < x.fidelity.kl < 0.05 for x in m[1:])
    rates = m[-1].recompute_rates
    assert all(a >= b for a, b in zip(rates, rates[1:])) and rates[0] > 0


def test_temperature_sampling_is_seeded(engines):
    engine = engines["qwen2_5_vl"]
    kw = dict(images=shots(30), prompt="Say something.", max_new_tokens=6, temperature=1.0, top_p=0.9)
    a, b = engine.chat(**kw, seed=3), engine.chat(**kw, seed=3)
    assert a.token_ids == b.token_ids
    assert any(engine.chat(**kw, seed=s).token_ids != a.token_ids for s in range(4, 10))


def test_images_as_paths_pil_and_arrays_hash_alike(engines, tmp_path):
    from PIL import Image

    engine = engines["qwen2_5_vl"]
    img = shots(31)[0]
    Image.fromarray(img).save(tmp_path / "shot.png")
    first = engine.chat(images=[str(tmp_path / "shot.png")], prompt="path", max_new_tokens=1)
    again = engine.chat(images=[Image.fromarray(img)], prompt="pil", max_new_tokens=1)
    assert first.metrics.vit_calls == 1 and again.metrics.vit_calls == 0 and again.metrics.image_kv_hits == 1


# ---- the layer-aware budget ----------------------------------------------------------------------
def test_calibrate_on_request_pairs_scores_the_continuation(checkpoints):
    engine = make_engine(checkpoints["qwen2_5_vl"], recompute_budget="layer-aware")
    # Consecutive turns of an agent: a window of screenshots that slides by one.
    pairs = [(messages("You are an agent.", shots(70, 71), "Step 1?"), messages("You are an agent.", shots(71, 72), "Step 2?")),
             (messages("Plan.", shots(73, 74), "a"), messages("Sub-agent 1 of a planner.", shots(74, 73), "b"))]
    rates = (0.0, 0.5, 1.0)
    one = [engine.calibrate(requests=[p], rates=rates, continuation=1, progress=False).loss for p in pairs]
    both = engine.calibrate(requests=pairs, rates=rates, continuation=1, progress=False)
    assert np.allclose(both.loss, (one[0] + one[1]) / 2)  # the mean over the pairs
    longer = engine.calibrate(requests=pairs, rates=rates, continuation=4, progress=False)
    # The first term of the sum is the same next-token KL; three more non-negative terms follow.
    assert (longer.loss >= both.loss - 1e-9).all() and longer.loss.sum() > both.loss.sum()
    assert np.allclose(longer.loss[:, 0], longer.loss[0, 0])  # rate 0 is the same run at every layer
    assert engine.sensitivity is longer
    assert_clean(engine)


def test_a_forced_step_gives_the_logits_decoding_one_token_at_a_time_gives(engines):
    from samcache.engine.calibration import _forced, _greedy

    engine = engines["qwen2_5_vl"]
    ex, ns = engine.executor, Namespace(engine.model_id)
    prompt = engine.build_prompt(messages("Teacher forcing.", shots(90, 91), "Describe."))
    a, first_a = reference_prefill(ex, prompt, engine.model_id, ns)
    b, first_b = reference_prefill(ex, prompt, engine.model_id, ns)
    try:
        tokens, stepped = _greedy(ex, a.seq, first_a, prompt.next_position, 9, stop=set())
        assert len(tokens) == len(stepped) == 9
        chunked = _forced(ex, b.seq, first_b, prompt.next_position, tokens)
        assert len(chunked) == 9 and ex.pool.num_tokens(b.seq) == ex.pool.num_tokens(a.seq)
        for x, y in zip(stepped, chunked):
            torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
        # The reply's end stops the reference: a stop token as the first one ends it there.
        assert _greedy(ex, a.seq, first_a, prompt.next_position, 9, stop={tokens[0]})[0] == tokens[:1]
    finally:
        ex.pool.free_sequence(a.seq)
        ex.pool.free_sequence(b.seq)
    with pytest.raises(ValueError, match="one sequence"):
        ex.forward([], every_row=True)
    assert_clean(engine)


def test_calibrate_probes_every_layer_and_drives_the_budget(checkpoints, tmp_path):
    engine = make_engine(checkpoints["qwen2_5_vl"], recompute_budget="layer-aware")
    engine.chat(images=shots(40), prompt="x", max_new_tokens=1)
    with pytest.warns(UserWarning, match="uniform across layers"):  # the first turn that reuses an image
        engine.chat(messages=messages("Another system prompt.", shots(40), "y"), max_new_tokens=1)
    curves = engine.calibrate(rates=(0.0, 0.1, 0.5, 1.0), save=tmp_path / "curves.json", progress=False)
    L = engine.runner.num_layers
    assert curves.loss.shape == (L, 4)
    assert np.allclose(curves.loss[:, 0], curves.loss[0, 0])  # rate 0 is the same run at every layer
    # Exact KV never hurts on average here (up to float32 rounding: layer 0 is exact after re-rotation).
    assert (curves.loss[:, -1] <= curves.loss[:, 0] * (1 + 1e-6) + 1e-9).all()
    saved = json.loads((tmp_path / "curves.json").read_text())
    assert saved["loss"] == curves.loss.tolist()
    # The end-to-end check ran at the probe rates strictly between 0 and 1, through the served path.
    assert np.isnan(curves.checked[[0, 3]]).all() and np.isfinite(curves.checked[[1, 2]]).all()
    assert (curves.checked[[1, 2]] >= 0).all()
    for i, rate in ((1, 0.1), (2, 0.5)):
        if np.allclose(solve_layer_budget(curves, rate).rates, rate):  # nothing to choose between
            assert curves.checked[i, 0] == curves.checked[i, 1]
    assert saved["checked"][0] == [None, None] and saved["checked"][1] == curves.checked[1].tolist()
    assert_clean(engine)
    again = make_engine(checkpoints["qwen2_5_vl"], recompute_budget="layer-aware", sensitivity=tmp_path / "curves.json",
                        recompute_ratio=0.3)
    again.chat(images=shots(41, 42), prompt="x", max_new_tokens=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = again.chat(images=shots(42, 41), prompt="y", max_new_tokens=1)
    rates, reused = r.metrics.recompute_rates, r.metrics.image_reused_tokens
    assert np.array_equal(again.sensitivity.checked, curves.checked, equal_nan=True)
    solved = again.layer_budget(0.3).rates
    assert np.mean(solved) <= 0.3 + 1e-9 and all(a >= b for a, b in zip(solved, solved[1:]))
    assert rates == [math.ceil(b * reused - 1e-9) / reused for b in solved]  # each layer's rate, in whole tokens
    assert r.metrics.recomputed_tokens == round(rates[0] * reused)


def test_layer_aware_budget_falls_back_to_uniform_where_the_check_found_it_better(checkpoints):
    L = make_engine(checkpoints["qwen2_5_vl"]).runner.num_layers
    rates = np.array([0.0, 0.2, 0.5, 1.0])
    loss = np.tile([1.0, 1.0, 1.0, 0.0], (L, 1))
    loss[0] = [1.0, 0.0, 0.0, 0.0]  # layer 0 alone repairs: the solver puts the budget there
    nan = np.nan
    checked = [[nan, nan], [0.1, 0.5], [0.5, 0.1], [nan, nan]]  # end to end, uniform won at 0.5 only
    engine = make_engine(checkpoints["qwen2_5_vl"], recompute_budget="layer-aware",
                         sensitivity=SensitivityCurves(rates, loss, checked=checked))
    solved = solve_layer_budget(engine.sensitivity, 0.2).rates
    assert not np.allclose(solved, 0.2) and np.allclose(engine.layer_budget(0.2).rates, solved)
    assert np.allclose(engine.layer_budget(0.5).rates, 0.5)


# ---- bad input -------------------------------------------------------------------------------
def test_unreadable_image_is_a_clear_error_and_leaves_the_cache_consistent(engines, tmp_path):
    engine = engines["qwen2_5_vl"]
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(ImageLoadError, match="cannot read image"):
        engine.chat(images=[str(tmp_path / "broken.png")], prompt="x")
    with pytest.raises(ImageLoadError, match="cannot read image"):
        engine.chat(images=[str(tmp_path / "missing.png")], prompt="x")
    with pytest.raises(ImageLoadError, match="uint8"):
        engine.chat(images=[np.zeros((8, 8, 3), np.float32)], prompt="x")
    assert_clean(engine)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM"):
        SAMcacheEngine(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        SAMcacheEngine(tmp_path / "nope")


def test_prompt_longer_than_the_pool_is_a_clear_error(checkpoints):
    engine = make_engine(checkpoints["qwen2_5_vl"], num_blocks=8)
    with pytest.raises(PromptTooLong, match="KV blocks"):
        engine.chat(images=[screenshot(50, (448, 448))], prompt="256 image tokens, 128 slots", max_new_tokens=4)
    assert_clean(engine)
    r = engine.chat(prompt="short", max_new_tokens=2)  # the engine still works
    assert r.metrics.decode_tokens >= 1
    assert_clean(engine)


def test_a_decode_step_makes_room_as_a_prefill_does(checkpoints, monkeypatch):
    """A pool just big enough for the turn: the decode step that opens a block finds it by
    releasing a cached image, as the prefill's allocation would, not by failing."""
    engine = make_engine(checkpoints["qwen2_5_vl"], num_blocks=16)
    bs = engine.pool.block_size
    turns = [("system prompt number 0 ", (252, 252)), ("system prompt number 1 " * 2, (196, 196)),
             ("system prompt number 2 " * 3 + " x" * 3, (196, 196))]
    for i, (system, size) in enumerate(turns[:2]):
        engine.chat(messages=messages(system, [screenshot(10 + i, size)], "Describe."), max_new_tokens=4,
                    ignore_eos=True)
    msgs = messages(turns[2][0], [screenshot(12, turns[2][1])], "Describe.")
    prompt = engine.build_prompt(msgs)
    starved = []  # decode steps that needed a block (opening one, or copying a shared last one) with none to give
    real = engine.executor.decode_step

    def watch(seq, *args, **kw):
        pool = engine.pool
        n, last = pool.num_tokens(seq), int(pool.block_table(seq)[-1])
        stats = pool.stats()
        if (n % bs == 0 or pool.refcount(last) > 1) and stats["free_blocks"] + stats["evictable_blocks"] == 0:
            starved.append(n)
        return real(seq, *args, **kw)

    monkeypatch.setattr(engine.executor, "decode_step", watch)
    evictions = engine.image_kv_store.stats.evictions
    r = engine.chat(messages=msgs, max_new_tokens=4, ignore_eos=True)
    assert r.metrics.decode_tokens == 4
    assert starved, len(prompt)  # the case this test is for: a decode step found the pool full ...
    assert engine.image_kv_store.stats.evictions > evictions  # ... and a cached image gave way
    assert_clean(engine)


def test_a_failed_prefill_leaves_no_adoptable_blocks(checkpoints, monkeypatch):
    engine = make_engine(checkpoints["qwen2_5_vl"])
    msgs = messages("A system prompt long enough to fill a few KV blocks of sixteen tokens.", [], "Hello?")

    def boom(batch):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.runner, "forward", boom)
    with pytest.raises(RuntimeError, match="injected"):
        engine.chat(messages=msgs, max_new_tokens=1)
    monkeypatch.undo()
    assert_clean(engine)
    r = engine.chat(messages=msgs, max_new_tokens=1)
    assert r.metrics.prefix_reused_tokens == 0  # nothing half-written was adopted
    assert_clean(engine)


def test_bad_arguments_are_clear_errors(engines, checkpoints):
    engine = engines["qwen2_5_vl"]
    with pytest.raises(ValueError, match="either messages"):
        engine.chat(messages=[user_message([], "x")], prompt="y")
    with pytest.raises(ValueError, match="needs a prompt or images"):
        engine.chat()
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.chat(prompt="x", max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.chat(prompt="x", temperature=-1)
    with pytest.raises(ValueError, match="content type"):
        engine.chat(messages=[{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}])
    with pytest.raises(ValueError, match="compression"):
        make_engine(checkpoints["qwen2_5_vl"], compression_enabled=True)
    with pytest.raises(ValueError, match="recompute_ratio"):
        make_engine(checkpoints["qwen2_5_vl"], recompute_ratio=1.5)
    with pytest.raises(ValueError, match="image placeholder"):
        engine.chat(prompt="literal <|image_pad|> in text")
    assert_clean(engine)


def test_a_failed_decode_step_leaves_no_adoptable_decode_blocks(checkpoints, monkeypatch):
    path = checkpoints["qwen2_5_vl"]
    msgs = messages("Decode then fail.", shots(60), "Talk.")
    good = make_engine(path).chat(messages=msgs, max_new_tokens=20)
    if len(good.token_ids) < 18:
        pytest.skip("the model stopped early")
    engine = make_engine(path)
    prompt = engine.build_prompt(msgs)
    real, calls = engine.runner.forward, []

    def fail_on_18th(batch):
        calls.append(1)
        if len(calls) == 18:  # the prefill, then the 17th decode step
            raise RuntimeError("injected decode failure")
        return real(batch)

    monkeypatch.setattr(engine.runner, "forward", fail_on_18th)
    with pytest.raises(RuntimeError, match="injected"):
        engine.chat(messages=msgs, max_new_tokens=20)
    assert_clean(engine)
    bs = engine.pool.block_size
    ids = np.concatenate([prompt.token_ids, np.asarray(good.token_ids[:17], np.int32)])
    matched = engine.pool.match_prefix(ids, prompt.extra_keys(), namespace=Namespace(engine.model_id))
    assert len(matched) <= len(prompt) // bs  # no block decode touched is adoptable
    assert len(matched) >= (len(prompt) - 1) // bs  # the prompt's own blocks still are


def test_heads_only_recompute_shared_weights_and_fixed_length_decode(checkpoints):
    path = checkpoints["qwen2_5_vl"]
    both = make_engine(path, recompute_ratio=0.5)
    heads = make_engine(path, recompute_ratio=0.5, recompute_tracks="heads", share_weights_with=both)
    assert heads.runner.model is both.runner.model and heads.runner.k_cache is not both.runner.k_cache
    images = shots(70, 71)
    first, second = messages("One.", images, "a"), messages("Another system prompt.", images[::-1], "b")
    for engine in (both, heads):
        engine.chat(messages=first, max_new_tokens=1)
    r_both = both.chat(messages=second, max_new_tokens=5, ignore_eos=True)
    r_heads = heads.chat(messages=second, max_new_tokens=5, ignore_eos=True)
    spans = both.build_prompt(second).images
    head_tokens = sum(-(-s.length // 10) for s in spans)
    assert r_heads.metrics.recomputed_tokens == head_tokens < r_both.metrics.recomputed_tokens
    assert r_both.metrics.decode_tokens == r_heads.metrics.decode_tokens == 5
    assert r_both.metrics.recomputed_token_layers == sum(
        round(rate * r_both.metrics.image_reused_tokens) for rate in r_both.metrics.recompute_rates)
    with pytest.raises(ValueError, match="recompute_tracks"):
        make_engine(path, recompute_tracks="track2")
    with pytest.raises(ValueError, match="device must be"):
        make_engine(path, device="gpu")
    assert_clean(both)
    assert_clean(heads)


def test_constructor_and_chat_arguments_are_checked(checkpoints, engines, tmp_path):
    path = checkpoints["qwen2_5_vl"]
    for kw, match in ((dict(head_fraction=2.0), "head_fraction"), (dict(track2_share=-0.1), "track2_share"),
                      (dict(block_size=0), "block_size"), (dict(num_blocks=-3), "num_blocks"),
                      (dict(vit_cache_bytes=0), "vit_cache_bytes"),
                      (dict(num_blocks=8, kv_cache_bytes=1 << 20), "num_blocks or kv_cache_bytes"),
                      (dict(kv_cache_bytes=100), "kv_cache_bytes=100 holds no KV block"),
                      (dict(model_id="m\x00approximate-prefix"), "without NUL characters")):
        with pytest.raises(ValueError, match=match):
            make_engine(path, **kw)
    for kw, match in ((dict(share_weights_with="engine"), "share_weights_with must be a SAMcacheEngine"),
                      (dict(tenant=7), "tenant must be")):
        with pytest.raises(TypeError, match=match):
            make_engine(path, **kw)
    (tmp_path / "bad.json").write_text('{"rates": [0, 1]}')
    with pytest.raises(ValueError, match="sensitivity-curves JSON"):
        make_engine(path, sensitivity=tmp_path / "bad.json")
    engine = engines["qwen2_5_vl"]
    with pytest.raises(TypeError, match="images must be a list"):
        engine.chat(images="shot.png", prompt="x")
    with pytest.raises(TypeError, match="system must be a str"):
        engine.new_session(system=["not", "text"])
    with pytest.raises(TypeError, match="session must be a Session"):
        engine.chat(prompt="x", session=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine.chat(prompt="x", max_new_tokens=0)
    with pytest.raises(TypeError, match="ignore_eos must be a bool"):
        engine.chat(prompt="x", ignore_eos="yes")
    with pytest.raises(TypeError, match="RequestOptions.budget must be a RecomputeBudget"):
        RequestOptions(budget=0.05)
    with pytest.raises(ValueError, match="one first token per sequence"):
        greedy_decode(engine.executor, [0], [], 0, 2)
    with pytest.raises(ValueError, match="n_tokens must be an int >= 1"):
        greedy_decode(engine.executor, [], [], 0, 0)
    with pytest.raises(TypeError, match="engine must be a SAMcacheEngine"):
        Calibrator(object())
    with pytest.raises(ValueError, match="at least one image"):
        engine.calibrate(images=[], progress=False)
    with pytest.raises(ValueError, match="rates must start at 0"):
        engine.calibrate(rates=(0.1, 0.5), progress=False)
    with pytest.raises(ValueError, match="continuation must be an int >= 1"):
        engine.calibrate(continuation=0, progress=False)
    pair = (messages("First.", shots(60, 61), "a"), messages("Second, longer prompt.", shots(61, 60), "b"))
    with pytest.raises(ValueError, match="images or requests, not both"):
        engine.calibrate(images=shots(60), requests=[pair], progress=False)
    with pytest.raises(ValueError, match="non-empty list of .first messages, reused messages. pairs"):
        engine.calibrate(requests=[], progress=False)
    with pytest.raises(ValueError, match="pair 1: the reused request shows none"):
        engine.calibrate(requests=[pair, (pair[0], messages("x", shots(62), "c"))], progress=False)
    assert_clean(engine)
