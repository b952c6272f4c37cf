"""Many requests served together: batched prefill and decode, continuous admission, failures
that stay with their request, several threads; and what the pool keeps between turns (image KV
held once, approximate KV never served as an exact prefix)."""

import threading

import numpy as np
import pytest

pytest.importorskip("transformers")

from samcache import ImageLoadError, Namespace, PromptTooLong  # noqa: E402
from samcache.engine import BatchError, ChatRequest, screenshot  # noqa: E402
from samcache.engine.prompt import user_message  # noqa: E402

from engine_helpers import SIZE, assert_clean, make_engine  # noqa: E402


@pytest.fixture(scope="module")
def path(tiny_checkpoints):
    return tiny_checkpoints["qwen2_5_vl"]


def requests(n, seed=0, **kw):
    """n requests with their own system prompts and screenshots (nothing one could reuse from another)."""
    return [ChatRequest(messages=[{"role": "system", "content": f"You are agent number {seed + i}."},
                                  user_message([screenshot(1000 * seed + 10 * i + j, SIZE) for j in range(2)],
                                               f"What should agent {i} click?")],
                        max_new_tokens=6, ignore_eos=True, **kw) for i in range(n)]


def work(m):
    return (m.prompt_tokens, m.prefilled_tokens, m.prefix_reused_tokens, m.image_reused_tokens, m.vit_calls,
            m.decode_tokens)


@pytest.mark.parametrize("max_step_tokens", [16384, 150])  # all at once, or admitted step by step
def test_a_batch_gives_exactly_what_serving_each_alone_gives(path, max_step_tokens):
    batched = make_engine(path, max_step_tokens=max_step_tokens)
    alone = make_engine(path, share_weights_with=batched)
    reqs = requests(5)
    steps = []
    real = batched.executor.forward
    batched.executor.forward = lambda s: steps.append([int(x.rows.size) for x in s]) or real(s)
    together = batched.chat_batch(reqs)
    one_by_one = [alone.chat(**vars(r)) for r in reqs]
    for a, b in zip(together, one_by_one):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert work(a.metrics) == work(b.metrics)
    if max_step_tokens == 16384:
        assert steps[0] == [r.metrics.prefilled_tokens for r in together]  # one step prefills all five
        assert all(s == [1] * 5 for s in steps[1:])  # then they decode in lock-step
        assert len(steps) == 6
    else:  # each prompt (~110 tokens) alone fills a step: later prompts are prefilled beside decode rows
        assert any(max(s) > 1 and 1 in s for s in steps)
    assert_clean(batched)
    assert_clean(alone)


def test_one_bad_request_does_not_stop_the_others(path):
    engine = make_engine(path, num_blocks=64)
    reqs = requests(2)
    bad_image = ChatRequest(images=[np.zeros((8, 8, 3), np.float32)], prompt="x")
    too_long = ChatRequest(images=[screenshot(5, (896, 896))], prompt="1,024 image tokens: too long for 1,024 slots")
    results = engine.chat_batch([reqs[0], bad_image, too_long, reqs[1]], return_exceptions=True)
    assert isinstance(results[1], ImageLoadError) and isinstance(results[2], PromptTooLong)
    assert [len(r.token_ids) for r in (results[0], results[3])] == [6, 6]
    with pytest.raises(BatchError, match="1 of 2 requests failed; the first, request 1: ImageLoadError") as info:
        engine.chat_batch([reqs[0], bad_image])
    assert info.value.results[0].token_ids == results[0].token_ids
    with pytest.raises(TypeError, match="list of ChatRequest"):
        engine.chat_batch(reqs[0])
    session = engine.new_session("One conversation.")
    with pytest.raises(ValueError, match="requests 0 and 1 continue the same Session"):
        engine.chat_batch([ChatRequest(prompt="a", session=session), ChatRequest(prompt="b", session=session)])
    assert session.messages == [{"role": "system", "content": "One conversation."}]
    assert_clean(engine)


def test_a_failed_step_fails_its_requests_only_and_leaves_the_pool_consistent(path, monkeypatch):
    engine = make_engine(path, max_step_tokens=150)
    reqs = requests(3, seed=1)
    calls = []
    real = engine.executor.forward

    def fail_on_the_second_step(steps):  # request 0's first decode row and request 1's prefill
        calls.append(len(steps))
        if len(calls) == 2:
            raise RuntimeError("injected step failure")
        return real(steps)

    monkeypatch.setattr(engine.executor, "forward", fail_on_the_second_step)
    results = engine.chat_batch(reqs, return_exceptions=True)
    assert calls[:2] == [1, 2]
    assert [type(r).__name__ for r in results] == ["RuntimeError", "RuntimeError", "ChatResult"]
    assert_clean(engine)
    monkeypatch.undo()
    assert all(not isinstance(r, BaseException) for r in engine.chat_batch(reqs, return_exceptions=True))
    assert_clean(engine)


def test_several_threads_share_one_engine(path):
    engine = make_engine(path)
    reference = make_engine(path, share_weights_with=engine)
    reqs = requests(4, seed=2)
    expected = [reference.chat(**vars(r)).token_ids for r in reqs]
    got, errors = [None] * 4, []

    def worker(i):
        try:
            got[i] = engine.chat(**vars(reqs[i])).token_ids
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == expected
    assert_clean(engine)


def test_image_kv_is_held_once_in_the_turns_own_blocks(path):
    engine = make_engine(path)
    shot = screenshot(70, (224, 336))  # 96 image tokens
    msgs = [{"role": "system", "content": "Hold this."}, user_message([shot], "Look.")]
    engine.chat(messages=msgs, max_new_tokens=1)
    prompt = engine.build_prompt(msgs)
    (span,) = prompt.images
    bs, store = engine.pool.block_size, engine.image_kv_store
    first, last = span.start // bs, (span.end - 1) // bs
    assert len(store) == 1 and store.used_bytes == (last - first + 1) * engine.runner.block_bytes
    held = store.get(Namespace(engine.model_id).key(span.image.content), check=engine.executor.kv_check(span))
    # the holder shares the prompt's cached blocks (found again through the prefix cache): no copy
    cached = engine.pool.match_prefix(prompt.token_ids, prompt.extra_keys(), namespace=Namespace(engine.model_id))
    table = engine.pool.block_table(held.seq).tolist()
    full = [int(b) for b in cached[first: last + 1]]  # the prompt's last block was partial: not in the prefix cache
    assert len(table) == last - first + 1 and table[: len(full)] == full and len(full) >= len(table) - 1
    assert all(engine.pool.refcount(b) == 1 for b in table)  # only the holder's reference: the turn is over
    one_copy = engine.runner.kv_bytes_per_token
    assert store.bytes_per_token() == store.used_bytes / 96 <= one_copy * (96 + 2 * (bs - 1)) / 96
    assert_clean(engine)


def test_held_images_give_way_when_a_prompt_needs_their_blocks(path):
    engine = make_engine(path, num_blocks=40)  # 640 slots
    for i in range(8):  # each turn: one 96-token screenshot, ~7 blocks held afterwards
        r = engine.chat(messages=[{"role": "system", "content": f"Turn {i}."},
                                  user_message([screenshot(200 + i, (224, 336))], "Look.")], max_new_tokens=1)
        assert r.metrics.vit_calls == 1
        assert_clean(engine)
    assert 0 < len(engine.image_kv_store) < 8 and engine.image_kv_store.stats.evictions > 0
    # the most recent screenshots are the ones still held
    recent = engine.chat(messages=[{"role": "system", "content": "Later."},
                                   user_message([screenshot(207, (224, 336))], "Again?")], max_new_tokens=1)
    assert recent.metrics.image_kv_hits == 1
    assert_clean(engine)


def _three_turns(engine):
    shots = [screenshot(300, SIZE), screenshot(301, SIZE)]
    engine.chat(messages=[{"role": "system", "content": "First."}, user_message(shots, "a")], max_new_tokens=1)
    moved = [{"role": "system", "content": "Another, longer system prompt moves them."}, user_message(shots, "b")]
    second = engine.chat(messages=moved, max_new_tokens=1)
    third = engine.chat(messages=moved, max_new_tokens=1)  # the very same prompt again
    return engine.build_prompt(moved), second, third


def test_blocks_holding_approximate_kv_are_never_adopted_as_exact(path):
    engine = make_engine(path, recompute_ratio=0.05)
    prompt, second, third = _three_turns(engine)
    bs = engine.pool.block_size
    assert second.metrics.image_kv_hits == 2 and second.metrics.exact_tokens == prompt.images[0].start
    # the repeat adopts only the blocks before the first spliced image, and splices the images again
    assert third.metrics.prefix_reused_tokens == prompt.images[0].start // bs * bs
    assert third.metrics.image_kv_hits == 2 and third.metrics.image_reused_tokens == second.metrics.image_reused_tokens
    assert_clean(engine)


def test_approximate_prefix_reuse_is_the_callers_choice_and_stays_apart(path):
    engine = make_engine(path, recompute_ratio=0.05, prefix_reuse="approximate")
    prompt, second, third = _three_turns(engine)
    assert third.metrics.prefix_reused_tokens == (len(prompt) - 1) // engine.pool.block_size * engine.pool.block_size
    assert third.metrics.image_kv_hits == 0
    exact = make_engine(path, recompute_ratio=0.05)
    exact.pool, exact.executor = engine.pool, engine.executor  # even on the same pool: another cache space
    exact.scheduler.executor = engine.executor
    r = exact.chat(messages=[{"role": "system", "content": "Another, longer system prompt moves them."},
                             user_message([screenshot(300, SIZE), screenshot(301, SIZE)], "b")], max_new_tokens=1)
    assert r.metrics.prefix_reused_tokens == 0 and r.metrics.image_kv_hits == 2  # image KV is shared, blocks not
    with pytest.raises(ValueError, match="prefix_reuse"):
        make_engine(path, prefix_reuse="always")
    assert_clean(engine)


def test_recomputing_everything_makes_the_whole_prompt_exact_again(path):
    engine = make_engine(path, recompute_ratio=1.0)
    prompt, second, third = _three_turns(engine)
    assert second.metrics.exact_tokens == len(prompt)
    assert third.metrics.prefix_reused_tokens == (len(prompt) - 1) // engine.pool.block_size * engine.pool.block_size
    assert_clean(engine)
